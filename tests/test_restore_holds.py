"""fsm.restore, fsm.restore_plan and ``restore-plan`` on the inputs a new user
gives them: each answer is right or an fsm error naming what is wrong.

Meshes are ``jax.make_mesh`` over the 8 simulated CPU devices (or the first 3
of them), all with Auto axis types; checkpoints are written by orbax's
``StandardCheckpointer`` or ``CheckpointManager``, as in ``test_restore.py``.
"""

import math
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta import cli

# After a read orbax refuses (damaged data, a bad target), its background threads
# close their event loop while a callback is still queued; Python reports that as an
# unraisable 'Event loop is closed', which is noise: the error the caller sees is fsm's.
pytestmark = pytest.mark.filterwarnings(
  'ignore::pytest.PytestUnraisableExceptionWarning'
)

AUTO = AxisType.Auto


def mesh_of(shape, names=('data', 'model'), devices=None):
  # Auto axes, as a training job's mesh usually has.
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape), devices=devices)


def mesh_of_3(name):
  """A one-axis mesh of 3 devices: sizes of 64 or 8 are not multiples of it."""
  return mesh_of((3,), (name,), devices=jax.devices()[:3])


def struct(shape, mesh, spec, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def save(path, tree):
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)
  return path


@pytest.fixture
def no_reads(monkeypatch):
  """Fails the test if orbax is asked to read any array."""

  def refuse(*args, **kwargs):
    raise AssertionError('orbax was asked to read')

  monkeypatch.setattr(ocp.Checkpointer, 'restore', refuse)


@pytest.fixture(scope='module')
def four(tmp_path_factory):
  """Leaves a, b, c, d of 16x8 counting floats, saved over data=8."""
  saved = mesh_of((8, 1))
  tree = {
    k: jax.device_put(
      jnp.arange(128.0).reshape(16, 8) + i, NamedSharding(saved, P('data'))
    )
    for i, k in enumerate('abcd')
  }
  return save(tmp_path_factory.mktemp('four') / 'ckpt', tree), tree


# -- A step that does not apply ------------------------------------------------


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """A CheckpointManager root with steps 1 and 2, w = step everywhere."""
  root = tmp_path_factory.mktemp('run') / 'run'
  mesh = mesh_of((8, 1))
  with ocp.CheckpointManager(root) as manager:
    for step in (1, 2):
      w = jax.device_put(jnp.full((16, 8), float(step)), NamedSharding(mesh, P('data')))
      manager.save(step, args=ocp.args.StandardSave({'w': w}))
    manager.wait_until_finished()
  return root


def test_step_asked_of_a_step_folder_is_an_error_not_its_values(run, no_reads):
  # The user saw step 1's values for step=2 on the step folder run/1.
  target = {'w': struct((16, 8), mesh_of((2, 4)), P(None, 'model'))}
  for where in (run / '1', run / '1' / 'default'):
    with pytest.raises(fsm.RestoreError) as e:
      fsm.restore(where, target, step=2)
    text = str(e.value)
    assert str(where) in text and 'holds step 1, not step 2' in text
    assert f'root ({run}) with step=2' in text
    with pytest.raises(fsm.RestoreError, match='holds step 1, not step 2'):
      fsm.restore_plan(where, target, step=2)


def test_step_folder_with_its_own_step_and_the_root_restore(run):
  target = {'w': struct((16, 8), mesh_of((2, 4)), P(None, 'model'))}
  assert float(fsm.restore(run / '1', target, step=1)['w'][0, 0]) == 1.0
  assert float(fsm.restore(run, target, step=2)['w'][0, 0]) == 2.0


def test_step_asked_of_a_single_checkpoint_is_an_error(four, no_reads):
  path, _ = four
  target = {k: struct((16, 8), mesh_of((2, 4)), P()) for k in 'abcd'}
  with pytest.raises(fsm.RestoreError, match='single checkpoint.*step=3 was asked'):
    fsm.restore(path, target, step=3)


@pytest.mark.parametrize('step', [-1, True, '2', 2.0])
def test_step_that_is_not_a_step_number_is_an_error(run, step, no_reads):
  target = {'w': struct((16, 8), mesh_of((2, 4)), P(None, 'model'))}
  with pytest.raises(fsm.RestoreError, match=f'step={step!r}: expected an int'):
    fsm.restore(run, target, step=step)


def test_cli_step_on_a_step_folder_exits_2_in_one_line(capsys, run):
  # The target is laid out by a built-in model's shape; the step check comes first.
  code = cli.main(
    ['restore-plan', str(run / '1'), '--model', 'mlp', '--mesh', 'data=2,model=4',
     '--step', '2']
  )  # fmt: skip
  out, err = capsys.readouterr()
  assert code == 2 and out == ''
  assert 'holds step 1, not step 2' in err and 'Traceback' not in err


# -- A cast that can lose values -----------------------------------------------


@pytest.fixture(scope='module')
def floats(tmp_path_factory):
  x = jnp.array([1.5, 2.7, 300.0, -1e9, 0.2], jnp.float32)
  return save(tmp_path_factory.mktemp('floats') / 'ckpt', {'x': x}), x


def test_float_into_int8_is_refused_naming_the_leaf_and_both_dtypes(floats, no_reads):
  # The user got [1 2 44 0 0] back without a word.
  path, _ = floats
  target = {'x': struct((5,), mesh_of((2, 4)), P(), jnp.int8)}
  with pytest.raises(fsm.RestoreError, match='nothing was read') as e:
    fsm.restore(path, target)
  (problem,) = e.value.problems
  assert problem.path == 'x'
  assert 'saved as float32, restored as int8' in problem.reason
  assert 'allow_cast=True' in problem.hint
  plan = fsm.restore_plan(path, target)
  assert plan.blocking == (problem,) and 'problems: 1' in str(plan)


def test_allow_cast_restores_the_cast_asked(floats):
  path, x = floats
  target = {'x': struct((5,), mesh_of((2, 4)), P(), jnp.int8)}
  out = fsm.restore(path, target, allow_cast=True)
  assert out['x'].dtype == jnp.int8
  np.testing.assert_array_equal(out['x'], np.asarray(x).astype(np.int8))
  plan = fsm.restore_plan(path, target, allow_cast=True)
  assert plan.blocking == () and len(plan.problems) == 1
  assert 'notes (restored as the target asks): 1' in str(plan)


@pytest.mark.parametrize(
  'saved, target',
  [(jnp.bfloat16, jnp.float32), (jnp.int8, jnp.int32), (jnp.uint8, jnp.int16)],
)
def test_widening_casts_need_no_leave(tmp_path, saved, target):
  values = (
    jnp.arange(-3, 5) if jnp.issubdtype(saved, jnp.signedinteger) else jnp.arange(8)
  )
  x = values.astype(saved)
  path = save(tmp_path / 'ckpt', {'x': x})
  out = fsm.restore(path, {'x': struct((8,), mesh_of((2, 4)), P('model'), target)})
  assert out['x'].dtype == target
  np.testing.assert_array_equal(out['x'], np.asarray(x).astype(target))


@pytest.mark.parametrize(
  'saved, target',
  [
    (jnp.float32, jnp.bfloat16),  # narrower
    (jnp.int32, jnp.float32),  # 2**24 + 1 is not a float32
    (jnp.int8, jnp.uint8),  # -1 has no uint8
    (jnp.complex64, jnp.float32),  # the imaginary part is dropped
  ],
)
def test_every_cast_that_can_lose_values_is_refused(tmp_path, saved, target, no_reads):
  path = save(tmp_path / 'ckpt', {'x': jnp.zeros((8,), saved)})
  with pytest.raises(fsm.RestoreError, match='a cast that can lose values'):
    fsm.restore(path, {'x': struct((8,), mesh_of((2, 4)), P(), target)})


# -- A sharding that cannot split its leaf ---------------------------------------


def test_indivisible_struct_target_is_a_problem_before_reading(tmp_path, no_reads):
  # The user saw orbax crash with jax's IndivisibleError, "Event loop is closed".
  path = save(tmp_path / 'ckpt', {'w': jnp.ones((64, 32))})
  target = {'w': struct((64, 32), mesh_of_3('data'), P('data'))}
  plan = fsm.restore_plan(path, target)
  (problem,) = plan.problems
  assert problem.path == 'w' and problem.shape == (64, 32)
  assert problem.spec == P('data')
  assert "dimension 0 of size 64 is not divisible by 'data'=3" in problem.reason
  assert 'divide 64' in problem.hint
  with pytest.raises(fsm.RestoreError, match='w: shape \\(64, 32\\)'):
    fsm.restore(path, target)


def test_indivisible_boxes_laid_out_by_rules_are_named_once(tmp_path, no_reads):
  path = save(tmp_path / 'ckpt', {'e': jnp.ones((16, 8))})
  boxes = {
    'e': fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((16, 8), jnp.float32), ('vocab', 'embed')
    )
  }
  mesh = mesh_of_3('model')
  with pytest.raises(fsm.RestoreError) as e:
    fsm.restore(path, boxes, mesh=mesh, rules=[('embed', 'model')])
  (problem,) = e.value.problems  # not also "the target has no sharding"
  assert problem.path == 'e' and problem.names == ('vocab', 'embed')
  assert "dimension 1 of size 8 is not divisible by 'model'=3" in problem.reason


# -- Leaves on another mesh -------------------------------------------------------


def test_the_odd_leaf_out_is_named_not_the_others(four, no_reads):
  # The first leaf on another mesh used to make every other leaf "wrong".
  path, _ = four
  odd, usual = mesh_of((4, 2)), mesh_of((2, 4))
  target = {'a': struct((16, 8), odd, P())}
  target |= {k: struct((16, 8), usual, P()) for k in 'bcd'}
  plan = fsm.restore_plan(path, target)
  (problem,) = plan.problems
  assert problem.path == 'a'
  assert (
    'on data=4 x model=2, not data=2 x model=4, the mesh of 3 other' in problem.reason
  )
  assert plan.mesh is not None and plan.mesh.shape == dict(data=2, model=4)


def test_as_many_leaves_on_each_mesh_lists_the_meshes(four):
  path, _ = four
  m1, m2 = mesh_of((4, 2)), mesh_of((2, 4))
  target = {k: struct((16, 8), m1 if k in 'ab' else m2, P()) for k in 'abcd'}
  problems = fsm.restore_plan(path, target).problems
  assert len(problems) == 2
  for p in problems:
    assert 'data=4 x model=2: a, b; data=2 x model=4: c, d' in p.reason


def test_a_mesh_given_that_no_leaf_is_on_says_to_pass_the_right_one(four):
  path, _ = four
  target = {k: struct((16, 8), mesh_of((2, 4)), P()) for k in 'abcd'}
  problems = fsm.restore_plan(path, target, mesh=mesh_of((4, 2))).problems
  assert {p.path for p in problems} == set('abcd')
  assert 'not the mesh given (data=4 x model=2)' in problems[0].reason
  assert 'mesh=' in problems[0].hint


# -- host_budget -------------------------------------------------------------------


@pytest.mark.parametrize(
  'budget, why',
  [
    (float('nan'), 'it is not a finite number'),
    (float('inf'), 'it is not a finite number'),
    (-1, 'it is not positive'),
    (0, 'it is not positive'),
    (0.5, 'it is less than one byte'),
    (True, 'a bool is not a size'),
    ('0.1B', 'it is 0 bytes'),
    ('lots', "'lots' is not a size"),
  ],
)
def test_budget_that_is_not_positive_bytes_is_a_budget_error(
  four, budget, why, no_reads
):
  path, _ = four
  target = {k: struct((16, 8), mesh_of((2, 4)), P()) for k in 'abcd'}
  for call in (fsm.restore, fsm.restore_plan):
    with pytest.raises(fsm.HostBudgetError) as e:
      call(path, target, host_budget=budget)
    assert not isinstance(e.value, fsm.FitError)
    assert f'host_budget={budget!r}: {why}' in str(e.value)
    assert 'positive number of bytes' in str(e.value)


@pytest.mark.parametrize('budget', [np.int64(2**20), 2**20, '1MiB', float(2**20)])
def test_budget_as_int_numpy_int_size_or_whole_float(four, budget):
  path, _ = four
  target = {k: struct((16, 8), mesh_of((2, 4)), P()) for k in 'abcd'}
  assert fsm.restore_plan(path, target, host_budget=budget).host_budget == 2**20


def test_cli_budget_of_zero_exits_2_in_one_line(capsys, four):
  path, _ = four
  code = cli.main(
    ['restore-plan', str(path), '--model', 'mlp', '--mesh', 'data=8',
     '--host-budget', '0']
  )  # fmt: skip
  out, err = capsys.readouterr()
  assert code == 2 and out == ''
  assert err.startswith('flax-shardmeta: error: --host-budget 0: ')
  assert err.count('\n') == 1


# -- restore-plan --module: the factory's state as it is ---------------------------

FACTORIES = textwrap.dedent(
  """
  import jax, jax.numpy as jnp, optax
  import flax.linen as nn
  from flax.training import train_state
  import flax_shardmeta as fsm

  init = fsm.with_logical_partitioning(nn.initializers.lecun_normal(), ('embed', 'mlp'))


  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(64, kernel_init=init)(x)


  def build():
    model = Net()
    params = model.init(jax.random.key(0), jnp.ones((2, 16)))['params']
    return train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-3)
    )


  def builder():
    return build


  def tree():
    return jax.eval_shape(build)


  def step_and_state():
    return (lambda state, batch: state), jax.eval_shape(build), jnp.ones((2, 16))
  """
)
RULES = '[["embed", "data"], ["mlp", "model"]]'


@pytest.fixture(scope='module')
def train_state_ckpt(tmp_path_factory):
  """A flax TrainState (params and adam state), saved on data=8, and the
  module of factories building it."""
  folder = tmp_path_factory.mktemp('factories')
  (folder / 'holds_state.py').write_text(FACTORIES)
  with pytest.MonkeyPatch.context() as m:
    m.syspath_prepend(str(folder))
    import holds_state  # type: ignore[import-not-found]

    mesh = mesh_of((8,), ('data',))
    with fsm.logical_axis_rules([('embed', 'data'), ('mlp', None)]):
      abstract = jax.eval_shape(holds_state.build)
      state = jax.jit(
        holds_state.build, out_shardings=fsm.plan(abstract, mesh).shardings()
      )()
    path = save(folder / 'ckpt', state)
  return str(path), folder


@pytest.mark.parametrize('factory', ['builder', 'tree', 'step_and_state'])
def test_cli_module_train_state_is_the_target_as_it_is(
  capsys, monkeypatch, train_state_ckpt, factory
):
  # The user saw params/params/... and 43 problems.
  path, folder = train_state_ckpt
  monkeypatch.syspath_prepend(str(folder))
  code = cli.main(
    ['restore-plan', path, '--module', f'holds_state:{factory}', '--mesh',
     'data=2,model=4', '--rules', RULES, '--format', 'json']
  )  # fmt: skip
  out, err = capsys.readouterr()
  assert code == 0, err
  import json

  data = json.loads(out)
  specs = {e['path']: e['spec'] for e in data['entries']}
  assert specs['params/Dense_0/kernel'] == ['data', 'model']
  assert specs['opt_state/0/mu/Dense_0/kernel'] == ['data', 'model']
  assert specs['step'] == []
  assert not any(p.startswith('params/params') for p in specs)
  assert data['problems'] == []


# -- Exit codes, --partial and --allow-cast -----------------------------------------


@pytest.fixture(scope='module')
def dtypes_ckpt(tmp_path_factory):
  """w (bfloat16) and x (float32), and a factory module for targets of them."""
  folder = tmp_path_factory.mktemp('dtypes')
  path = save(
    folder / 'ckpt',
    {'w': jnp.ones((8, 8), jnp.bfloat16), 'x': jnp.ones((8,), jnp.float32)},
  )
  (folder / 'dtypes_target.py').write_text(
    textwrap.dedent(
      """
      import jax, jax.numpy as jnp
      import flax_shardmeta as fsm

      def box(shape, dtype):
        names = ('embed',) + (None,) * (len(shape) - 1)
        return fsm.LogicalPartitioned(jax.ShapeDtypeStruct(shape, dtype), names)

      def widening():
        return {'w': box((8, 8), jnp.float32), 'x': box((8,), jnp.float32)}

      def lossy():
        return {'w': box((8, 8), jnp.bfloat16), 'x': box((8,), jnp.int8)}

      def w_only():
        return {'w': box((8, 8), jnp.bfloat16)}
      """
    )
  )
  return str(path), folder


@pytest.mark.parametrize(
  'factory, flags, code',
  [
    ('widening', [], 0),  # a cast note only
    ('lossy', [], 1),
    ('lossy', ['--allow-cast'], 0),
    ('w_only', [], 1),  # x is saved but not in the target
    ('w_only', ['--partial'], 0),
  ],
)
def test_cli_exit_codes_notes_0_problems_1(
  capsys, monkeypatch, dtypes_ckpt, factory, flags, code
):
  path, folder = dtypes_ckpt
  monkeypatch.syspath_prepend(str(folder))
  got = cli.main(
    ['restore-plan', path, '--module', f'dtypes_target:{factory}', '--mesh',
     'data=2,model=4', '--rules', '[["embed", "model"]]', *flags]
  )  # fmt: skip
  out, err = capsys.readouterr()
  assert got == code, out + err
  if code == 0:
    assert 'problems: none' in out
  if factory == 'lossy' and code == 1:
    assert 'restore-plan --allow-cast' in out
  if factory == 'w_only' and code == 1:
    assert 'restore-plan --partial' in out


# -- Unmapped logical names ---------------------------------------------------------


def test_unmapped_names_are_reported_as_fsm_plan_reports_them(four):
  path, _ = four
  mesh = mesh_of((2, 4))
  rules = [('mlp', 'model'), ('embed', 'data')]
  boxes = {
    k: fsm.LogicalPartitioned(
      jax.ShapeDtypeStruct((16, 8), jnp.float32), ('embed', 'mpl')
    )
    for k in 'abcd'
  }
  with warnings.catch_warnings(record=True) as planned:
    warnings.simplefilter('always')
    fsm.plan(boxes, mesh, rules)
  with warnings.catch_warnings(record=True) as restored:
    warnings.simplefilter('always')
    plan = fsm.restore_plan(path, boxes, mesh=mesh, rules=rules)
  assert [str(w.message) for w in restored] == [str(w.message) for w in planned]
  (w,) = restored
  assert issubclass(w.category, fsm.UnmappedNameWarning)
  assert "'mpl'" in str(w.message) and "did you mean 'mlp'" in str(w.message)
  assert w.filename == __file__  # the user's line
  assert plan.entry('a').spec == P('data', None)


# -- Misuse ---------------------------------------------------------------------------


@pytest.mark.parametrize('devices_per_host', [0, -1, True, 2.5, '2', 3, 16])
def test_devices_per_host_that_does_not_make_hosts_is_an_error(four, devices_per_host):
  path, _ = four
  target = {k: struct((16, 8), mesh_of((2, 4)), P()) for k in 'abcd'}
  with pytest.raises(fsm.RestoreError, match=f'devices_per_host={devices_per_host!r}'):
    fsm.restore_plan(path, target, devices_per_host=devices_per_host)


def test_devices_per_host_dividing_the_mesh_makes_hosts(four):
  path, _ = four
  target = {k: struct((16, 8), mesh_of((2, 4)), P()) for k in 'abcd'}
  for n in (1, 2, 4, 8):
    assert fsm.restore_plan(path, target, devices_per_host=n).num_hosts == 8 // n


@pytest.mark.parametrize('target', [None, {}, {'step': 3}])
def test_target_without_arrays_is_an_error(four, target):
  path, _ = four
  with pytest.raises(fsm.RestoreError, match='the target holds no arrays'):
    fsm.restore(path, target)


@pytest.mark.parametrize('path', [None, 5])
def test_path_that_is_not_a_path_is_an_error(four, path):
  _, tree = four
  with pytest.raises(fsm.RestoreError, match=f'path={path!r}: expected the directory'):
    fsm.restore(path, {'a': struct((16, 8), mesh_of((2, 4)), P())})


def test_concrete_array_on_one_device_names_its_sharding(four, no_reads):
  path, _ = four
  target = {k: jnp.zeros((16, 8)) for k in 'abcd'}
  with pytest.raises(fsm.RestoreError) as e:
    fsm.restore(path, target)
  assert len(e.value.problems) == 4
  assert 'a SingleDeviceSharding, no NamedSharding' in e.value.problems[0].reason


@pytest.mark.parametrize('flag', ['partial', 'allow_cast'])
def test_flags_must_be_bools(four, flag):
  path, _ = four
  target = {k: struct((16, 8), mesh_of((2, 4)), P()) for k in 'abcd'}
  with pytest.raises(fsm.RestoreError, match=f"{flag}='no': expected True or False"):
    fsm.restore(path, target, **{flag: 'no'})  # type: ignore[arg-type]


def test_mesh_that_is_not_a_mesh_is_an_error(four):
  path, _ = four
  target = {k: struct((16, 8), mesh_of((2, 4)), P()) for k in 'abcd'}
  with pytest.raises(fsm.NoMeshError, match='got str'):
    fsm.restore_plan(path, target, mesh='data')  # type: ignore[arg-type]


def test_partial_with_nothing_left_out_restores_everything(four):
  path, tree = four
  target = {k: struct((16, 8), mesh_of((2, 4)), P('model')) for k in 'abcd'}
  out = fsm.restore(path, target, partial=True)
  for k in 'abcd':
    np.testing.assert_array_equal(out[k], tree[k])
  assert math.prod(out['a'].sharding.mesh.axis_sizes) == 8
