"""The rule context is per thread and per asyncio task: contexts never leak."""

import asyncio
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm


def test_threads_do_not_see_each_others_rules():
  barrier = threading.Barrier(2, timeout=10)
  seen: dict[str, list] = {}
  errors: list[BaseException] = []

  def work(tag, rules):
    try:
      with fsm.logical_axis_rules(rules):
        # Both threads are inside their contexts before either reads.
        barrier.wait()
        first = (fsm.get_logical_axis_rules(), fsm.logical_to_mesh_axes(('x',)))
        barrier.wait()
        second = (fsm.get_logical_axis_rules(), fsm.logical_to_mesh_axes(('x',)))
      barrier.wait()
      after = fsm.get_logical_axis_rules()
      seen[tag] = [first, second, after]
    except BaseException as e:  # surfaced in the main thread below
      errors.append(e)
      barrier.abort()

  threads = [
    threading.Thread(target=work, args=('a', [('x', 'data')])),
    threading.Thread(target=work, args=('b', [('x', 'model')])),
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  for tag, axis in (('a', 'data'), ('b', 'model')):
    first, second, after = seen[tag]
    assert first == second == ((('x', axis),), P(axis))
    assert after == ()


def test_new_thread_starts_without_rules():
  fsm.set_logical_axis_rules([('x', 'data')])
  result = []
  t = threading.Thread(target=lambda: result.append(fsm.get_logical_axis_rules()))
  t.start()
  t.join()
  assert result == [()]
  assert fsm.get_logical_axis_rules() == (('x', 'data'),)


def test_asyncio_tasks_do_not_see_each_others_rules():
  # Item 2: with a thread-local context, interleaved tasks read each other's
  # rules ((P('model'), P(None)) instead of (P('data'), P('model'))).
  async def task(rules, first, second):
    with fsm.logical_axis_rules(rules):
      first.set()
      await second.wait()  # the other task has entered its own rules meanwhile
      return fsm.logical_to_mesh_axes(('x',))

  async def main():
    a_in, b_in = asyncio.Event(), asyncio.Event()
    return await asyncio.gather(
      task([('x', 'data')], a_in, b_in),
      task([('x', 'model'), ('y', 'data')], b_in, a_in),
    )

  assert asyncio.run(main()) == [P('data'), P('model')]
  assert fsm.get_logical_axis_rules() == ()


def test_rules_set_inside_asyncio_run_end_with_it():
  async def main():
    fsm.set_logical_axis_rules([('x', 'data')])
    with fsm.logical_axis_rules([('y', 'model')]):
      await asyncio.sleep(0)
    return fsm.get_logical_axis_rules()

  assert asyncio.run(main()) == (('x', 'data'),)
  assert fsm.get_logical_axis_rules() == ()


def test_nesting_and_exceptions_restore_the_rules():
  outer, inner = [('x', 'data')], [('x', 'model')]
  with fsm.logical_axis_rules(outer):
    with pytest.raises(RuntimeError, match='boom'):
      with fsm.logical_axis_rules(inner):
        assert fsm.get_logical_axis_rules() == (('x', 'model'),)
        raise RuntimeError('boom')
    assert fsm.get_logical_axis_rules() == (('x', 'data'),)
    # The same object entered twice, and as a decorator.
    ctx = fsm.logical_axis_rules(inner)
    with ctx, ctx:
      assert fsm.get_logical_axis_rules() == (('x', 'model'),)
    assert fsm.get_logical_axis_rules() == (('x', 'data'),)

    @fsm.logical_axis_rules(inner)
    def read():
      return fsm.get_logical_axis_rules()

    assert read() == (('x', 'model'),)
  assert fsm.get_logical_axis_rules() == ()


def test_exiting_a_context_in_another_thread_is_refused():
  # Item 3: it used to wipe the other thread's rules and leave these set.
  ctx = fsm.logical_axis_rules([('x', 'data')])
  ctx.__enter__()
  seen: dict[str, object] = {}

  def other():
    with fsm.logical_axis_rules([('x', 'model')]):
      try:
        ctx.__exit__(None, None, None)
      except fsm.RuleContextError as e:
        seen['error'] = str(e)
      seen['rules'] = fsm.get_logical_axis_rules()

  t = threading.Thread(target=other, name='worker')
  t.start()
  t.join()
  assert "was entered in thread 'MainThread' and exited in thread 'worker'" in str(
    seen['error']
  )
  assert seen['rules'] == (('x', 'model'),)  # the other thread's rules intact
  assert fsm.get_logical_axis_rules() == (('x', 'data'),)  # and these too
  ctx.__exit__(None, None, None)  # exited where entered: fine
  assert fsm.get_logical_axis_rules() == ()
  with pytest.raises(fsm.RuleContextError, match='exited but never entered'):
    ctx.__exit__(None, None, None)


def test_flax_rule_context_is_honoured_where_fsm_has_none(mesh):
  # Item 1: every Linen code base already sets flax's rules.
  box = fsm.LogicalPartitioned(
    jax.ShapeDtypeStruct((8, 8), jnp.float32), ('embed', 'mlp')
  )
  x = jnp.ones((8, 8))
  with nn.logical_axis_rules([('embed', 'data'), ('mlp', 'model')]):
    assert fsm.get_sharding(box, mesh).spec == P('data', 'model')
    out = fsm.with_logical_constraint(x, ('embed', 'mlp'), mesh=mesh)
    assert out.sharding.spec == P('data', 'model')
    (embed, _) = fsm.explain_resolution(('embed', 'mlp'))
    assert "rule #0 ('embed', 'data') of flax's nn.logical_axis_rules gave" in str(
      embed
    )
    # fsm's own context, where set, wins; and explain says whose rule it was.
    with fsm.logical_axis_rules([('mlp', 'data')]):
      assert fsm.get_sharding(box, mesh).spec == P(None, 'data')
      (_, mlp) = fsm.explain_resolution(('embed', 'mlp'))
      assert "('mlp', 'data') of fsm.logical_axis_rules gave" in str(mlp)
    plan = fsm.plan({'w': box}, mesh)
    assert "of flax's nn.logical_axis_rules" in str(plan.entries[0].explain[0])


def test_a_task_tracing_under_another_tasks_jit_key_is_refused(mesh):
  # jax's cache key is per thread, the rules per task: a task that traces
  # after another task of the thread entered other rules would store its trace
  # under the other task's key. That is refused; fsm.jit is the way.
  @jax.jit
  def f(v):
    return fsm.with_logical_constraint(v + 1, ('x', None))

  x = jnp.ones((8, 4))

  async def task(rules, entered, other_entered):
    with fsm.logical_axis_rules(rules):
      entered.set()
      await other_entered.wait()
      return f(x).sharding

  async def main():
    a_in, b_in = asyncio.Event(), asyncio.Event()
    return await asyncio.gather(
      task([('x', 'data')], a_in, b_in),
      task([('x', 'model')], b_in, a_in),
      return_exceptions=True,
    )

  with jax.set_mesh(mesh):
    first, second = asyncio.run(main())
  assert isinstance(first, fsm.RuleContextError)
  assert "traced under the logical axis rules (('x', 'data'),)" in str(first)
  assert 'cache key names (no rules): another task of the same thread' in str(first)
  assert second.is_equivalent_to(NamedSharding(mesh, P('model', None)), 2)

  # fsm.jit enters its rules right where it traces and runs: both right.
  def h(v):
    return fsm.with_logical_constraint(v + 1, ('x', None))

  async def fsm_task(rules, entered, other_entered):
    g = fsm.jit(h, mesh=mesh, rules=rules)
    entered.set()
    await other_entered.wait()
    return g(x).sharding

  async def both():
    a_in, b_in = asyncio.Event(), asyncio.Event()
    return await asyncio.gather(
      fsm_task([('x', 'data')], a_in, b_in), fsm_task([('x', 'model')], b_in, a_in)
    )

  got = asyncio.run(both())
  for sharding, axis in zip(got, ('data', 'model')):
    assert sharding.is_equivalent_to(NamedSharding(mesh, P(axis, None)), 2)
