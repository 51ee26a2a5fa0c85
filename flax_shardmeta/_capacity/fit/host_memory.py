"""What of a compiled step's memory lives on the host, not the chip.

Arguments and outputs laid out with a host memory kind (``pinned_host``,
``unpinned_host``: optimizer state offloaded, say) are not in HBM. XLA's TPU
compiler counts them apart (``host_argument_size_in_bytes`` and the like),
so its device figures are the chip's already. The CPU compiler, and the GPU
compiler without a GPU (a compile-only topology, which drops memory kinds
altogether), put them into the device figures: here they are split out by
the arguments' memory kinds and the outputs', so that ``fit``'s device total
is what the chip holds, and a note says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from flax_shardmeta._units import signed_bytes

HOST_KINDS = frozenset({'pinned_host', 'unpinned_host'})
"""jax's memory kinds that are host memory."""


def on_host(sharding: Any) -> bool:
  """Whether ``sharding`` puts its array in host memory.

  Example:
    >>> import jax
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> s = jax.sharding.NamedSharding(mesh, jax.P(), memory_kind='pinned_host')
    >>> on_host(s), on_host(s.with_memory_kind('device')), on_host(None)
    (True, False, False)
  """
  return getattr(sharding, 'memory_kind', None) in HOST_KINDS


def output_leaves(compiled: Any) -> list[list[Any]]:
  """``[bytes per device, on the host]`` of each output leaf of ``compiled``,
  by the compiled program's own memory kinds (a compile-only GPU client
  drops them: :func:`given_hosts` tells those from the step)."""
  from flax_shardmeta._arrays import shard_bytes

  try:
    infos = jax.tree_util.tree_leaves(compiled.out_info)
    shardings = jax.tree_util.tree_leaves(
      compiled.output_shardings, is_leaf=lambda x: x is None
    )
  except Exception:  # an older jax without out_info: outputs unknown
    return []
  return [
    [int(shard_bytes(i.shape, i.dtype, s)) if s is not None else 0, on_host(s)]
    for i, s in zip(infos, shardings)
  ]


def given_hosts(given: Any, traced: Any) -> list[bool] | None:
  """Per output leaf of the traced step (``traced.out_tree``), whether
  ``given`` (its out_shardings, a prefix of the outputs' tree) puts it on
  the host; None where that cannot be told."""
  tree = getattr(traced, 'out_tree', None)
  if given is None or tree is None:
    return None
  n = tree.num_leaves
  if isinstance(given, jax.sharding.Sharding):
    return [on_host(given)] * n
  try:
    value = jax.tree_util.tree_unflatten(tree, [0] * n)
    per = jax.tree_util.tree_map(
      lambda s, sub: [on_host(s)] * len(jax.tree_util.tree_leaves(sub)),
      given,
      value,
      is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding),
    )
  except (ValueError, TypeError):  # not a prefix of the outputs
    return None
  flat = [
    h
    for group in jax.tree_util.tree_leaves(per, is_leaf=lambda x: isinstance(x, list))
    for h in group
  ]
  return flat if len(flat) == n else None


def split_host(
  found: dict[str, Any],
  args_on_host: Sequence[bool],
  outs_on_host: Sequence[bool] | None,
  aliases: dict[int, int],
) -> tuple[list[list[Any]], dict[str, int], tuple[str, ...]]:
  """The compiled figures' inputs with each one's host flag, XLA's memory
  figures without what lives in host memory, and the notes saying so.

  A leaf is on the host by the compiled program's memory kind, or by the
  step's own (``args_on_host``: its arguments' layouts; ``outs_on_host``: its
  out_shardings) where the compiler dropped them; these are not cached, the
  cache's key being the program.
  """
  inputs = [list(leaf) for leaf in found.get('input_bytes', [])]
  if len(inputs) == len(args_on_host):
    for leaf, told in zip(inputs, args_on_host):
      leaf[4:] = [bool(leaf[4]) or told] if len(leaf) > 4 else [told]
  outputs = [list(o) for o in found.get('output_bytes', [])]
  told = outs_on_host if outs_on_host and len(outs_on_host) == len(outputs) else None
  outputs = [[b, bool(h) or bool(told and told[i])] for i, (b, h) in enumerate(outputs)]
  memory, notes = device_memory(found['memory'], inputs, outputs, aliases)
  return inputs, memory, notes


def device_memory(
  memory: dict[str, int],
  inputs: Sequence[Sequence[Any]],
  outputs: Sequence[Sequence[Any]],
  aliases: dict[int, int],
) -> tuple[dict[str, int], tuple[str, ...]]:
  """XLA's memory figures with what is on the host taken out of the device
  ones, and the notes that say what was taken out.

  ``inputs``: ``(path, bytes, is a key, shape, on the host)`` per input leaf
  (``compiled.input_bytes``); ``outputs``: ``[bytes, on the host]`` per
  output leaf; ``aliases``: output position -> entry parameter number.
  """
  host_in = sum(int(leaf[1]) for leaf in inputs if _hosted(leaf))
  host_out = sum(int(b) for b, h in outputs if h)
  if not host_in and not host_out:
    return memory, ()
  if memory.get('host_argument_size_in_bytes', 0) or memory.get(
    'host_output_size_in_bytes', 0
  ):
    # XLA counted them apart: its device figures are the chip's.
    return memory, (
      f'{signed_bytes(host_in)} of arguments are in host memory (their memory '
      "kind): XLA counts them apart, not in the chip's total",
    )
  host_alias = sum(
    int(outputs[o][0]) for o in aliases if o < len(outputs) and outputs[o][1]
  )
  device = dict(memory)
  device['argument_size_in_bytes'] -= host_in
  device['output_size_in_bytes'] -= host_out
  device['alias_size_in_bytes'] -= host_alias
  device['host_argument_size_in_bytes'] = host_in
  device['host_output_size_in_bytes'] = host_out
  device['host_alias_size_in_bytes'] = host_alias
  return device, (
    f'{signed_bytes(host_in)} of arguments are in host memory (their memory kind), '
    "which this compiler counts in its device figures: taken out of the chip's "
    f'total here (and {signed_bytes(host_out)} of outputs)',
  )


def _hosted(leaf: Sequence[Any]) -> bool:
  return len(leaf) > 4 and bool(leaf[4])
