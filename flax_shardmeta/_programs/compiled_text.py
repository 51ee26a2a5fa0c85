"""A compiled program's text as XLA gives it, checked against XLA's own
module objects, and the counts read off program text that the audit and fit
report: rematerialised instructions, transposes, sharding annotations.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax_shardmeta._programs.hlo_text import parse
  >>> compiled = jax.jit(lambda x: x.T @ x).lower(jnp.ones((4, 4))).compile()
  >>> text = program_text(compiled)
  >>> disagreements(parse(text), compiled), rematerialized(text)
  ([], 0)
"""

from __future__ import annotations

import re
from typing import Any

from flax_shardmeta._programs.hlo_text import Computation

# Opcodes the capacity layer reads; their names print the same in the text
# and (as CamelCase) in jaxlib's HloOpcode enum.
_CHECKED_OPCODES = frozenset(
  'while call conditional fusion parameter constant tuple get-tuple-element '
  'compare add copy bitcast dot convolution dynamic-slice dynamic-update-slice '
  'all-gather all-gather-start reduce-scatter all-reduce all-reduce-start '
  'all-to-all ragged-all-to-all collective-permute collective-permute-start'.split()
)


def program_text(compiled: Any) -> str:
  """The optimised HLO text of a compiled program (``jax.stages.Compiled``)."""
  return compiled.as_text()


def _modules(compiled: Any) -> list[Any] | None:
  """jaxlib's ``HloModule`` objects of a compiled program, where it has them."""
  try:
    return list(compiled.runtime_executable().hlo_modules())
  except Exception:  # no runtime executable or no modules on this backend
    return None


def _opcode_text(opcode: Any) -> str:
  """``HloOpcode.kAllReduceStart`` -> ``'all-reduce-start'``."""
  name = str(getattr(opcode, 'name', opcode)).split('.')[-1].removeprefix('k')
  return re.sub(r'(?<!^)(?=[A-Z])', '-', name).lower()


def _printed_opcode(inst: Any, opcode: str) -> str:
  """How the text prints an XLA async op: by the op it wraps (an
  ``async-start`` around an all-reduce prints as ``all-reduce-start``, as
  GPU programs of jax 0.12 hold them; one around a call as ``call-start``)."""
  if opcode not in ('async-start', 'async-update', 'async-done'):
    return opcode
  try:
    wrapped = _opcode_text(inst.async_wrapped_root().opcode)
  except Exception:  # an older jaxlib, or nothing wrapped
    return opcode
  return f'{wrapped}-{opcode.removeprefix("async-")}'


def disagreements(computations: dict[str, Computation], compiled: Any) -> list[str]:
  """Where :func:`parse` read ``compiled``'s text differently from XLA's own
  module objects: computations, instruction names, the opcodes this layer
  reads, operands. Empty when they agree, or when the backend has no module
  objects to compare with (then nothing can be said).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax_shardmeta._programs.hlo_text import parse
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    >>> disagreements(parse(program_text(compiled)), compiled)
    []
  """
  modules = _modules(compiled)
  if not modules:
    return []
  found: list[str] = []
  structured = {c.name: c for c in modules[0].computations()}
  called = {
    callee
    for c in computations.values()
    for i in c.instructions
    for _, callee in i.called()
  }
  # XLA's modules hold a computation for each async op that the text prints
  # as the op itself (a GPU's all-gather-start(...), a TPU's SparseCore
  # call-start(...)); nothing read calls it, so nothing read is missing it.
  missing = sorted(
    n
    for n in set(structured) ^ set(computations)
    if n in computations or n in called or not n.startswith('async_computation')
  )
  if missing:
    found.append(f'computations read differently: {", ".join(missing[:5])}')
  for name in sorted(set(structured) & set(computations)):
    theirs = {i.name: i for i in structured[name].instructions()}
    ours = {i.name: i for i in computations[name].instructions}
    if set(theirs) != set(ours):
      found.append(f'{name}: instructions read differently')
      continue
    for inst_name, inst in ours.items():
      other = theirs[inst_name]
      opcode = _opcode_text(other.opcode)
      printed = _printed_opcode(other, opcode)
      if (inst.opcode in _CHECKED_OPCODES or printed in _CHECKED_OPCODES) and (
        inst.opcode not in (opcode, printed)
      ):
        found.append(f'{name}/{inst_name}: opcode {inst.opcode!r}, XLA {opcode!r}')
      elif [o.name for o in other.operands()] != inst.operands:
        found.append(f'{name}/{inst_name}: operands read differently')
    if len(found) > 5:
      break
  return found[:5]


# XLA's rematerialization names each recomputed instruction after the one it
# copies with a ".remat" suffix (hlo_rematerialization.cc).
_REMATERIALIZED = re.compile(r'^\s*(?:ROOT\s+)?%?[\w.\-]*\.remat\d*[\w.\-]*\s*=', re.M)
_TRANSPOSE = re.compile(r'=\s*\S+\s+transpose\(')
# GSPMD's ``Sharding`` custom calls and Shardy's ``sharding_constraint`` /
# ``reshard`` ops in a lowered (StableHLO) program.
_SHARDING_OPS = re.compile(
  r'custom_call @Sharding\b|custom_call_target="Sharding"'
  r'|sdy\.sharding_constraint|sdy\.reshard'
)


def rematerialized(text: str) -> int:
  """Instructions XLA's rematerialization recomputed in optimised HLO text."""
  return len(_REMATERIALIZED.findall(text))


def transposes(text: str) -> int:
  """Transposes left in optimised HLO text."""
  return len(_TRANSPOSE.findall(text))


def sharding_annotations(lowered_text: str) -> int:
  """Sharding annotations in a lowered program's text (StableHLO): GSPMD's
  ``Sharding`` custom calls and Shardy's constraints and reshards."""
  return len(_SHARDING_OPS.findall(lowered_text))
