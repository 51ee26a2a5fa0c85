"""Which lines of a traced step route tokens to experts and back.

A mixture-of-experts layer picks experts with ``top_k`` (or ``argmax``), makes
masks or indices from that choice alone (one-hot, cumsum: the *routing*
values), then moves tokens with them: a contraction, gather or scatter of a
routing value with the tokens is the *dispatch* (its result holds tokens
grouped by expert), the experts compute on those (*experts*), and a second
such operation with a routing value brings them back (*combine*). The walk
follows values through calls and loops (``nn.scan`` layers, remat, ``jit``),
in the forward pass: the backward pass moves the same tokens' gradients at
the same lines, where its collectives are found by line.

A collective XLA places at one of these lines moves tokens, whatever it picks
(all-to-all, all-gather, permute): ``why()`` calls it ``routing``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def layer(x, router, w):
  ...   _, expert = jax.lax.top_k(x @ router, 1)
  ...   mask = jax.nn.one_hot(expert[:, 0], 2)               # (tokens, experts)
  ...   grouped = jnp.einsum('te,td->etd', mask, x)          # dispatch
  ...   out = jnp.einsum('etd,edf->etf', grouped, w)         # experts
  ...   return jnp.einsum('etf,te->tf', out, mask)           # combine
  >>> x, r, w = jnp.ones((4, 3)), jnp.ones((3, 2)), jnp.ones((2, 3, 3))
  >>> roles = routing_roles(jax.make_jaxpr(layer)(x, r, w).jaxpr)
  >>> sorted(set(roles.values()))
  ['combine', 'dispatch', 'experts']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend import core as jex_core

from flax_shardmeta._frames import user_line
from flax_shardmeta._programs.jaxprs import operand_offset, sub_jaxprs

CHOOSERS = frozenset({'top_k', 'approx_top_k', 'argmax', 'argmin'})
"""The primitives whose results choose experts."""

MOVERS = frozenset({
  'dot_general', 'gather', 'scatter', 'scatter-add', 'scatter_add', 'scatter_sum',
  'dynamic_slice', 'dynamic_update_slice',
})  # fmt: skip
"""The primitives that move tokens by a routing value (a mask, an index)."""

EXCHANGES = frozenset({'all_to_all', 'ragged_all_to_all'})
"""The collectives a ``shard_map`` routing calls to send tokens to experts."""

ROUTING_KINDS = frozenset(
  {'all-to-all', 'ragged-all-to-all', 'all-gather', 'collective-permute'}
)
"""The compiled collectives that move tokens, whichever of them XLA picks."""

ROLES = ('dispatch', 'combine', 'experts')
"""What a routing line does, the first two before the third where a line does
several."""

_ROUTING, _TOKENS, _CONSTANT = 'routing', 'tokens', 'constant'
_HELPERS = frozenset({'pjit', 'jit', 'closed_call', 'custom_jvp_call'})
_KERNELS = frozenset({'pallas_call', 'triton_kernel_call', 'mosaic_gpu_call'})
# Kernels write their results to output refs: their bodies return nothing.
_DISPATCHED = 'dispatched'  # tokens grouped by expert, not yet computed on
_COMBINED = 'combined'  # the experts' outputs back at their tokens' places
_RELAYS = frozenset({
  'sharding_constraint', 'reshard', 'convert_element_type', 'reshape', 'transpose',
  'copy', 'copy_p', 'squeeze', 'expand_dims', 'broadcast_in_dim',
  'optimization_barrier', 'device_put',
})  # fmt: skip
# What passes dispatched tokens on as they are, but for layout, type or shape:
# the dispatch buffer still (a constraint on it is where XLA moves it).


def routing_roles(
  jaxpr: Any, masks: set[str] | None = None, exchanges: set[str] | None = None
) -> dict[str, str]:
  """The user's lines that dispatch, compute experts on and combine tokens,
  each with its role (:data:`ROLES`); ``{}`` for a step with no experts.

  With ``masks``, the lines that make routing values (the choice, the masks
  and slots made from it alone, which ``peak()`` calls routing masks) are
  added to it; with ``exchanges``, the lines of :data:`EXCHANGES` calls."""
  roles: dict[str, str] = {}
  made: set[str] = set()
  sent: set[str] = set()
  _walk(jaxpr, {}, roles, 0, (made, sent))
  if masks is not None:
    masks.update(line for line in made if line and line not in roles)
  if exchanges is not None:
    exchanges.update(line for line in sent if line)
  return roles


def _note(roles: dict[str, str], line: str, role: str) -> None:
  """A line's role: a dispatch or combine outranks experts, the first stays."""
  if line and (line not in roles or roles[line] == 'experts'):
    roles[line] = role


def _walk(
  jaxpr: Any,
  kinds: dict[Any, str],
  roles: dict[str, str],
  depth: int,
  found: tuple[set[str], set[str]],
) -> list[str | None]:
  """Marks each value routing or tokens (``kinds``: var -> kind) and notes
  the lines' roles, and in ``found`` the lines making routing values and
  those exchanging tokens; returns the kinds of the jaxpr's outputs."""
  masks, sent = found
  for eqn in jaxpr.eqns:
    if 'transpose(' in str(getattr(eqn.source_info, 'name_stack', '') or ''):
      # The backward pass moves the same tokens' gradients at the same lines
      # (its collectives are found by line); following gradients would take
      # every value the loss depends on for a token.
      continue
    ins = [
      kinds.get(v) if isinstance(v, jex_core.Var) else 'literal' for v in eqn.invars
    ]
    name = eqn.primitive.name
    subs = sub_jaxprs(eqn)
    if subs and name not in MOVERS:
      if depth >= 16:
        continue  # routing starts inside a body too: every body is read
      skip = operand_offset(eqn)
      outs: list[str | None] = []
      for inner, _ in subs:
        inner_kinds: dict[Any, str] = {}
        for i, v in enumerate(inner.invars):
          kind = ins[i + skip] if i + skip < len(ins) else None
          if kind in (_ROUTING, _TOKENS, _DISPATCHED, _COMBINED, _CONSTANT):
            inner_kinds[v] = kind
        got = _walk(inner, inner_kinds, roles, depth + 1, found)
        outs = got if len(got) == len(eqn.outvars) else outs
      if name in _KERNELS and any(k in (_TOKENS, _DISPATCHED) for k in ins):
        # A kernel whose body does not return its results (a Pallas grouped
        # matmul writes them to its outputs): tokens in, the experts' out.
        _note(roles, user_line(getattr(eqn.source_info, 'traceback', None)), 'experts')
        outs = [_TOKENS] * len(eqn.outvars)
      for out, kind in zip(eqn.outvars, outs):
        if kind is not None:
          kinds[out] = kind
      if name in _HELPERS and outs and all(k == _ROUTING for k in outs):
        # A jitted helper making routing values (one_hot): the caller's line.
        masks.add(user_line(getattr(eqn.source_info, 'traceback', None)))
      continue
    kind = _kind(name, ins, eqn, roles, sent)
    if kind == _ROUTING:
      masks.add(user_line(getattr(eqn.source_info, 'traceback', None)))
    if kind is not None:
      for out in eqn.outvars:
        kinds[out] = kind
  return [kinds.get(v) if isinstance(v, jex_core.Var) else None for v in jaxpr.outvars]


def _kind(
  name: str,
  ins: Sequence[str | None],
  eqn: Any,
  roles: dict[str, str],
  sent: set[str],
) -> str | None:
  """What ``eqn``'s results are, from what its operands are; notes its line
  (and an exchange's in ``sent``)."""
  if name in CHOOSERS:
    return _ROUTING
  # Constants (literals, iota, what is made of them) take no side: a
  # one-hot compares the choice with an iota and stays routing.
  variables = [k for k in ins if k not in (_CONSTANT, 'literal')]
  if not variables:
    return _CONSTANT
  routing = any(k == _ROUTING for k in variables)
  dispatched = any(k == _DISPATCHED for k in variables)
  tokens = dispatched or any(k == _TOKENS for k in variables)
  combined = any(k == _COMBINED for k in variables)
  if all(k == _ROUTING for k in variables):
    return _ROUTING
  line = user_line(getattr(eqn.source_info, 'traceback', None))
  if name in EXCHANGES and tokens:
    # Tokens sent to their experts' devices (shard_map routing), and back
    # once the experts have run on them.
    _note(roles, line, 'dispatch' if dispatched else 'combine')
    sent.add(line)
    return _DISPATCHED if dispatched else _TOKENS
  single = len(variables) == 1
  if routing:
    if name not in MOVERS:
      return None  # a routing value compared or mixed otherwise: not a move
    if combined and not tokens:
      # The combined outputs weighed by the gates: the combine still.
      _note(roles, line, 'combine')
      return _COMBINED
    if not tokens or dispatched:
      # Tokens grouped by expert, or grouped again once they arrived (the
      # local sort of an expert-parallel layer): the dispatch still.
      _note(roles, line, 'dispatch')
      return _DISPATCHED
    # With the tokens the experts computed on, a routing value brings them back.
    _note(roles, line, 'combine')
    return _COMBINED
  if dispatched and name in _RELAYS and single:
    _note(roles, line, 'dispatch')
    return _DISPATCHED
  if combined and name in _RELAYS and single:
    return _COMBINED  # reshaped or cast on the way to the residual
  if tokens:
    _note(roles, line, 'experts')
    return _TOKENS
  return None


def batched_axes(
  leaves: Sequence[tuple[str, str] | None],
  batched: Sequence[tuple[int, ...]],
  specs: Sequence[tuple[tuple[str, ...], ...] | None],
) -> dict[str, dict[int, tuple[str, ...]]]:
  """Per parameter path, the mesh axes of each laid-out dimension its use
  batches over (``TracedLines.batched`` against the layouts' specs).

  Example:
    >>> batched_axes([('params/w1', 'parameters')], [(1,)], [((), ('expert',), ())])
    {'params/w1': {1: ('expert',)}}
  """
  out: dict[str, dict[int, tuple[str, ...]]] = {}
  if not len(batched) == len(leaves) == len(specs):
    return out
  for leaf, dims, spec in zip(leaves, batched, specs):
    if leaf is not None and spec is not None:
      on = {d: spec[d] for d in dims if d < len(spec) and spec[d]}
      if on:
        out[leaf[0]] = on
  return out


def batched_gather(
  on: dict[int, tuple[str, ...]], kind: str, axes: Sequence[str]
) -> str:
  """How a parameter's collective undoes the layout of a dimension its use
  batches over (``''`` when it does not: another kind, other axes).

  Example:
    >>> batched_gather({1: ('expert',)}, 'all-gather', ('expert',))
    'batched dim 1 over expert -> whole'
  """
  if kind != 'all-gather':
    return ''
  for d, named in on.items():
    if set(named) & set(axes):
      return f'batched dim {d} over {"+".join(named)} -> whole'
  return ''
