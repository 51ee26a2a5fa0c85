"""The rule context is per thread: concurrent contexts never leak."""

import threading

from jax.sharding import PartitionSpec as P

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
