"""fsm's rules in jax.jit's cache key: the probe, and the path without the key.

Run on every jax the package supports: a jax release that stops keying its
caches by user contexts fails here, not silently in a user's layouts.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import _jit_key

DATA = [('batch', 'data')]
MODEL = [('batch', 'model')]


def _constrained(v):
  return fsm.with_logical_constraint(v * 2, ('batch', None))


def _spec(x, mesh):
  for spec in (P('data', None), P('model', None), P(None, None)):
    if x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim):
      return spec
  return x.sharding


class _IgnoredContext:
  """A user context jax does not know of: its value is in no cache key, as
  ``jax.make_user_context``'s would be if jax stopped honouring it."""

  def __init__(self):
    self.value = None

  def __call__(self, value):
    return _Set(self, value)


class _Set:
  def __init__(self, ctx, value):
    self.ctx, self.new = ctx, value

  def __enter__(self):
    self.prev, self.ctx.value = self.ctx.value, self.new

  def __exit__(self, *exc):
    self.ctx.value = self.prev


@pytest.fixture
def probe_again():
  """The probe runs anew in the test, and again after it."""
  _jit_key.key_honoured.cache_clear()
  yield
  _jit_key.key_honoured.cache_clear()


@pytest.fixture
def key_ignored(monkeypatch, probe_again):
  """jax as it would be if it ignored fsm's user context."""
  monkeypatch.setattr(_jit_key, '_KEY', _IgnoredContext())
  assert not _jit_key.key_honoured()


# The hook, on the installed jax
# ------------------------------------------------------------------------------


def test_installed_jax_honours_the_key(probe_again):
  assert _jit_key.key_honoured()


def test_the_probe_runs_once_on_the_first_trace_under_context_rules(probe_again):
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with jax.set_mesh(mesh), fsm.logical_axis_rules(DATA):
    _constrained(jnp.ones((8, 4)))  # eager: nothing is cached by the key
    assert _jit_key.key_honoured.cache_info().currsize == 0
    jax.jit(_constrained)(jnp.ones((8, 4)))
    jax.jit(_constrained)(jnp.ones((8, 4)))
  info = _jit_key.key_honoured.cache_info()
  assert (info.currsize, info.misses) == (1, 1)


def test_plain_jit_is_traced_again_under_other_rules(mesh):
  traces = []

  @jax.jit
  def f(v):
    traces.append(1)
    return _constrained(v)

  x = jnp.ones((8, 4))
  with jax.set_mesh(mesh):
    with fsm.logical_axis_rules(DATA):
      first = f(x)
    with fsm.logical_axis_rules(MODEL):
      second = f(x)
    with fsm.logical_axis_rules(DATA):
      again = f(x)
  assert [_spec(y, mesh) for y in (first, second, again)] == [
    P('data', None),
    P('model', None),
    P('data', None),
  ]
  assert len(traces) == 2  # one per rule set, reused when it comes back


def test_a_jit_inside_fsm_jits_of_other_rules_is_traced_for_each(mesh):
  inner = jax.jit(_constrained)

  def step(v):
    return inner(v) + 1

  x = jnp.ones((8, 4))
  by_data = fsm.jit(step, mesh=mesh, rules=DATA)(x)
  by_model = fsm.jit(step, mesh=mesh, rules=MODEL)(x)
  assert _spec(by_data, mesh) == P('data', None)
  assert _spec(by_model, mesh) == P('model', None)


# Without the key: fsm.jit keeps rule sets apart, a plain jax.jit is refused
# ------------------------------------------------------------------------------


def test_the_probe_notices_a_key_jax_ignores(key_ignored):
  assert not _jit_key.key_honoured()


def test_without_the_key_fsm_jit_still_keeps_rule_sets_apart(mesh, key_ignored):
  x = jnp.ones((8, 4))
  by_data = fsm.jit(_constrained, mesh=mesh, rules=DATA)
  by_model = fsm.jit(_constrained, mesh=mesh, rules=MODEL)
  assert _spec(by_data(x), mesh) == P('data', None)
  assert _spec(by_model(x), mesh) == P('model', None)
  assert _spec(by_data(x), mesh) == P('data', None)


def test_without_the_key_sharded_init_still_traces_under_context_rules(key_ignored):
  mesh = jax.make_mesh((2, 4), ('data', 'model'))

  def init(key):
    return _constrained(jax.random.normal(key, (8, 4)))

  with fsm.logical_axis_rules(MODEL):  # traced by sharded_init: not refused
    out = fsm.sharded_init(init, mesh)(jax.random.key(0))
  assert out.shape == (8, 4)


def test_without_the_key_a_plain_jit_under_context_rules_is_refused(key_ignored):
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  with jax.set_mesh(mesh), fsm.logical_axis_rules(DATA):
    with pytest.raises(fsm.RuleContextError) as info:
      jax.jit(_constrained)(jnp.ones((8, 4)))
    # Rules passed to the constraint need no key: they are part of the trace.
    jax.jit(lambda v: fsm.with_logical_constraint(v, ('batch', None), rules=DATA))(
      jnp.ones((8, 4))
    )
  message = str(info.value)
  assert "traced under the logical axis rules (('batch', 'data'),)" in message
  assert 'jax.make_user_context' in message and jax.__version__ in message
  assert 'fsm.jit(fn, mesh=mesh, rules=rules)' in message
