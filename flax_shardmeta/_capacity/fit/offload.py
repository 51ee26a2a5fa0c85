"""What a step asks to offload, read from its traced program, and whether
the compiled program did.

A remat policy offloads values by the names ``checkpoint_name`` gives them
(``jax.checkpoint_policies.save_and_offload_only_these_names``). Each
``checkpoint`` equation of the traced step carries its policy: asked about
each ``name`` equation of the step, it says which values it offloads; the
names it was built with say which of them no ``checkpoint_name`` gives (a
typo offloads nothing, silently). Arguments whose layout asks for host
memory are checked against the compiled program's own memory kinds.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Sequence
from typing import Any

from flax_shardmeta._frames import user_line
from flax_shardmeta._programs.jaxprs import sub_jaxprs


@dataclasses.dataclass(frozen=True)
class OffloadAsks:
  """What the step's remat policies offload.

  Attributes:
    offloaded: ``(name, line)`` of each ``checkpoint_name`` a policy offloads.
    missing: names a policy offloads that no ``checkpoint_name`` gives.
    names: every name the step's ``checkpoint_name`` calls give.

  Example:
    >>> asks = OffloadAsks((('x', 'm.py:3'),), ('y',), ('x',))
    >>> asks.asked
    True
  """

  offloaded: tuple[tuple[str, str], ...] = ()
  missing: tuple[str, ...] = ()
  names: tuple[str, ...] = ()

  @property
  def asked(self) -> bool:
    """Whether any policy offloads anything."""
    return bool(self.offloaded or self.missing)


def offload_asks(jaxpr: Any) -> OffloadAsks:
  """The offloads a traced step's remat policies ask for (``jaxpr``:
  ``traced.jaxpr.jaxpr``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.ad_checkpoint import checkpoint_name
    >>> policy = jax.checkpoint_policies.save_and_offload_only_these_names(
    ...     names_which_can_be_saved=[], names_which_can_be_offloaded=['h', 'hh'],
    ...     offload_src='device', offload_dst='pinned_host')
    >>> g = lambda x: jnp.sin(checkpoint_name(x * 2, 'h'))
    >>> f = jax.checkpoint(g, policy=policy)
    >>> asks = offload_asks(jax.make_jaxpr(f)(1.0).jaxpr)
    >>> [n for n, _ in asks.offloaded], asks.missing
    (['h'], ('hh',))
  """
  names: list[tuple[Any, str, str]] = []  # (equation, name, line)
  policies: list[Any] = []
  _walk(jaxpr, names, policies)
  offloaded: dict[tuple[str, str], None] = {}
  asked_names: dict[str, None] = {}
  for policy in policies:
    for name in _named_offloads(policy):
      asked_names[name] = None
    for eqn, name, line in names:
      if _offloads(policy, eqn):
        offloaded[(name, line)] = None
  given = tuple(dict.fromkeys(n for _, n, _ in names))
  missing = tuple(n for n in asked_names if n not in given)
  return OffloadAsks(tuple(offloaded), missing, given)


def _walk(jaxpr: Any, names: list[tuple[Any, str, str]], policies: list[Any]) -> None:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'name':
      line = user_line(getattr(eqn.source_info, 'traceback', None))
      names.append((eqn, str(eqn.params.get('name', '')), line))
    policy = eqn.params.get('policy')
    if callable(policy):
      policies.append(policy)
    for inner, _ in sub_jaxprs(eqn):
      _walk(inner, names, policies)


def _offloads(policy: Any, eqn: Any) -> bool:
  """Whether ``policy`` offloads the value the ``name`` equation names."""
  try:
    decision = policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
  except Exception:  # noqa: BLE001 - a policy that cannot be asked offloads nothing known
    return False
  return type(decision).__name__ == 'Offloadable'


def _named_offloads(policy: Any, depth: int = 3) -> tuple[str, ...]:
  """The names a policy built by jax's offloading helpers offloads (from the
  helper's own arguments, kept in the policy's closure), also where that
  policy is wrapped in another (a policy combining it with a base one)."""
  try:
    found = inspect.getclosurevars(policy).nonlocals
  except (TypeError, ValueError):
    return ()
  names = set(str(n) for n in found.get('names_which_can_be_offloaded') or ())
  if depth:
    for value in found.values():
      if callable(value) and value is not policy:
        names.update(_named_offloads(value, depth - 1))
  return tuple(sorted(names))


def offload_notes(
  asks: OffloadAsks | None,
  host_temporaries: int,
  asked_on_host: Sequence[tuple[str, bool]] = (),
) -> tuple[str, ...]:
  """What the step asked to offload that the compiled program does not:
  policy names no ``checkpoint_name`` gives, offloads that leave nothing in
  host memory, and arguments laid out on the host that the compiled program
  holds on the chip (``asked_on_host``: ``(path, held on the host)`` of each
  argument whose layout asks for host memory)."""
  notes = []
  if asks is not None:
    for name in asks.missing:
      close = difflib.get_close_matches(name, asks.names, n=1)
      hint = f'; did you mean {close[0]!r}?' if close else ''
      have = ', '.join(repr(n) for n in asks.names) or 'none'
      notes.append(
        f'OFFLOAD DID NOTHING: the remat policy offloads {name!r}, but no '
        f"checkpoint_name in the step gives that name (the step's names: {have})"
        f'{hint}'
      )
    if asks.offloaded and host_temporaries == 0:
      named = ', '.join(
        f'{n!r}' + (f' ({at})' if at else '') for n, at in asks.offloaded
      )
      notes.append(
        f'OFFLOAD DID NOTHING: the remat policy offloads {named}, but the compiled '
        'program keeps no temporaries in host memory: XLA kept those values on the '
        "chip (one known cause: the value is a scan's carry, which the scan keeps "
        'whole; name a value computed inside the layer instead)'
      )
  for path, held in asked_on_host:
    if not held:
      notes.append(
        f'OFFLOAD DID NOTHING: {path} is laid out in host memory, but the compiled '
        'program holds it on the chip'
      )
  return tuple(notes)
