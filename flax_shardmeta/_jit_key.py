"""The logical axis rules in ``jax.jit``'s cache key, and the probe checking it.

A constraint resolves through the rules in force while its function is
traced, so a function jitted with plain ``jax.jit`` and traced under one rule
set must be traced again under another. jax keys its caches by the function
and its arguments, and by the values of "user contexts"
(``jax.make_user_context``): fsm's rules enter the key as the value of one.
fsm.jit needs none of this for its own traces (each holds one rule set and
its own ``jax.jit``), but a plain ``jax.jit`` under ``fsm.logical_axis_rules``
does, and so does a jitted function called inside an fsm.jit.

On a jax that ignored the key (:func:`key_honoured` probes it on the first
trace under context rules), fsm.jit and fsm.sharded_init go on as before,
their traces being a rule set's own, while a plain ``jax.jit`` traced under
context rules is refused with a :class:`RuleContextError` naming fsm.jit. A
``jax.jit`` function called inside fsm.jits of different rules could then
not be told apart by jax: pass ``rules=`` to its constraints, or leave it
unjitted inside the fsm.jit step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from flax_shardmeta._errors import RuleContextError

_KEY = jax.make_user_context(None)
_in_own_jit: contextvars.ContextVar[bool] = contextvars.ContextVar(
  'flax_shardmeta_in_own_jit', default=False
)


def thread_key() -> Any:
  """The rules (normalized, or None) jax's cache key says in this thread."""
  return _KEY.value


def set_thread_key(rules: Any) -> None:
  """Makes jax's cache key say ``rules`` (normalized, or None) in this thread.

  The one place that relies on how jax keys its caches by a user context.
  ``jax.make_user_context`` is public, and entering its context sets the
  value for this thread; the rules context (a context variable per thread
  and asyncio task) has its own nesting, so the value is entered and never
  exited: the next call replaces it. Relied on (jax 0.10.2 to 0.12): that a
  value set so is part of the key of every ``jax.jit`` trace, lowering and
  compilation. :func:`key_honoured` checks that on first use, and
  tests/test_jit_key.py on every jax the tests run.
  """
  if _KEY.value != rules:
    _KEY(rules).__enter__()  # sets the value for this thread; never undone


@functools.cache
def key_honoured() -> bool:
  """Whether jax traces a function again when the key changes (probed once).

  A tiny function is traced (never compiled) under two fresh keys, then the
  first again: jax must trace it twice and reuse the first trace.
  """
  traces: list[int] = []

  def probe(x: Any) -> Any:
    traces.append(1)
    return x + 1

  jitted = jax.jit(probe)
  arg = jax.ShapeDtypeStruct((), jnp.float32)
  first, second = ('flax_shardmeta probe', 1), ('flax_shardmeta probe', 2)
  try:
    for key in (first, second, first):
      with _KEY(key):
        if _KEY.value != key:
          return False
        jitted.trace(arg)
  except Exception:  # noqa: BLE001 - any surprise: not honoured
    return False
  return len(traces) == 2


@contextlib.contextmanager
def own_trace() -> Iterator[None]:
  """Marks the trace of fsm's own ``jax.jit`` (one per rule set), which needs
  no key to keep rule sets apart."""
  token = _in_own_jit.set(True)
  try:
    yield
  finally:
    _in_own_jit.reset(token)


def require_key_honoured(rules_text: str) -> None:
  """Refuses to trace under context rules that jax's cache key ignores.

  Called where a function is traced under the context rules. Inside fsm.jit
  (or fsm.sharded_init) the trace is one of a rule set's own; elsewhere, on a
  jax whose key ignores the rules, the trace would be reused under other
  rules: that is refused, naming the way that works.
  """
  if _in_own_jit.get() or key_honoured():
    return
  raise RuleContextError(
    f'this code is traced under the logical axis rules {rules_text} by a '
    f'jax.jit of its own, but the installed jax ({jax.__version__}) does not '
    'make user contexts (jax.make_user_context) part of its cache key, so '
    'the trace would be reused under other rules. Compile it with '
    'fsm.jit(fn, mesh=mesh, rules=rules), which keeps each rule set in '
    'traces of its own, or pass rules= to the constraints.'
  )
