"""``fsm.fit`` on a step written as a client writes it, not through ``fsm.jit``.

MaxText's train step is a plain ``jax.jit`` under ``jax.set_mesh``: its batch
carries a field the step never reads (jax drops that argument), its state
holds PRNG key arrays (NNX ``rngs``, jitted with ``keep_unused=True``), and its
arguments arrive as ``ShapeDtypeStruct``s with their own shardings. Every row
of the report must come from the compiled program, none negative.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._capacity.fit import figure_cache as cache_lib
from flax_shardmeta._capacity.fit.traced_step import Step, prepare

AUTO = (AxisType.Auto,) * 2
KEY = jax.random.key(0).dtype


def cpu_mesh():
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)


def placed(mesh, shape, dtype, spec):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def batch_with_unused_field(mesh, per_device=32):
  """A batch laid out over 'data', with a field the step never reads."""
  rows = 2 * per_device
  return {
    'inputs': placed(mesh, (rows, 512), jnp.float32, P('data', None)),
    'targets_position': placed(mesh, (rows, 128), jnp.int32, P('data', None)),
  }


def check_rows(report):
  """Every row from the compiled program: none negative, adding up."""
  assert all(r.bytes >= 0 for r in report.rows), report.rows
  assert sum(r.bytes for r in report.rows) == report.total_bytes
  m = report.memory_analysis
  assert report.argument_bytes == m['argument_size_in_bytes']
  # The HLO text was read as XLA's own module objects have it.
  assert not any('HLO text reader' in note for note in report.notes)


def test_an_argument_the_step_never_reads_counts_nothing():
  mesh = cpu_mesh()
  params = {'w': placed(mesh, (512, 256), jnp.float32, P(None, 'model'))}
  batch = batch_with_unused_field(mesh)

  def step(params, batch):
    return jnp.tanh(batch['inputs'] @ params['w']).sum()

  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(step), params, batch, cache=False)
  check_rows(report)
  # 'inputs' over 'data'=2 only: the unused field is not in the program.
  assert report.row('batch and other inputs') == 32 * 512 * 4
  assert report.row('argument padding') == 0


def test_unannotated_arguments_count_by_their_own_sharding_when_refused():
  # Without a compiled program (a refusal) the argument rows come from each
  # leaf's own layout, never from a plan that counts it replicated.
  mesh = cpu_mesh()
  batch = batch_with_unused_field(mesh)
  with jax.set_mesh(mesh):
    arguments = prepare(Step.of(jax.jit(lambda b: b['inputs'].sum()), 1), (batch,))
  assert sorted(arguments.layout_bytes) == [32 * 128 * 4, 32 * 512 * 4]


def rng_state(mesh):
  """A state as NNX keeps it: parameters beside RNG streams (key arrays)."""

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (512, 256)))
      self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
      return self.dropout(x @ self.w)

  graphdef, state = nnx.split(
    nnx.eval_shape(lambda: Model(nnx.Rngs(params=0, dropout=1)))
  )
  return graphdef, state


@pytest.mark.parametrize('in_shardings', [False, True], ids=['own', 'in_shardings'])
def test_key_arrays_in_the_state_with_keep_unused(in_shardings):
  mesh = cpu_mesh()
  graphdef, state = rng_state(mesh)
  batch = placed(mesh, (64, 512), jnp.float32, P('data', None))

  def step(state, x):
    model = nnx.merge(graphdef, state)
    return (x @ model.w[...]).sum()

  kwargs = {}
  if in_shardings:
    replicated = NamedSharding(mesh, P())
    kwargs['in_shardings'] = (
      jax.tree.map(lambda _: replicated, state),
      NamedSharding(mesh, P('data', None)),
    )
  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(step, keep_unused=True, **kwargs), state, batch)
  check_rows(report)
  # RNG streams are not parameters: a threefry key is two uint32, a count one.
  assert report.row('parameters') == 512 * 256 * 4
  assert report.row('RNG state') == 8 + 4
  assert report.row('batch and other inputs') == 32 * 512 * 4


def test_key_arrays_in_a_plain_dict_and_in_the_estimate():
  mesh = cpu_mesh()
  state = {
    'params': {'w': placed(mesh, (512, 256), jnp.float32, P(None, 'model'))},
    'rng': placed(mesh, (4,), KEY, P()),
  }

  def step(state, x):
    return (x @ state['params']['w']).sum()

  x = placed(mesh, (64, 512), jnp.float32, P('data', None))
  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(step, keep_unused=True), state, x, cache=False)
  check_rows(report)
  assert report.row('RNG state') == 4 * 8
  assert report.row('parameters') == 512 * 256 * 4 // 4

  abstract = AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
  state = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=NamedSharding(abstract, s.sharding.spec)
    ),
    state,
  )
  x = jax.ShapeDtypeStruct(
    x.shape, x.dtype, sharding=NamedSharding(abstract, x.sharding.spec)
  )
  with jax.sharding.use_abstract_mesh(abstract):
    estimate = fsm.fit(jax.jit(step, keep_unused=True), state, x)
  assert estimate.source == 'estimate'
  assert estimate.row('RNG state') == 4 * 8
  assert all(r.bytes >= 0 for r in estimate.rows)


def test_cache_false_never_reuses_figures():
  mesh = cpu_mesh()
  cache_lib.clear()
  x = placed(mesh, (64, 512), jnp.float32, P('data', None))
  with jax.set_mesh(mesh):
    step = jax.jit(lambda x: jnp.sin(x).sum())
    first = fsm.fit(step, x, cache=False)
    again = fsm.fit(step, x, cache=False)
    kept = fsm.fit(step, x)
    reused = fsm.fit(step, x)
  assert not first.cached and not again.cached and again.compile_seconds > 0
  assert not kept.cached and reused.cached
  assert again.rows == first.rows == reused.rows


@pytest.mark.libtpu
def test_a_client_step_on_a_topology():
  # On a TPU, layouts pad small arrays to tiles: padding is >= 0, and the
  # unused field still counts nothing.
  mesh = fsm.make_mesh((2, 2), ('data', 'model'), topology='v5p:2x2x1', axis_types=AUTO)
  graphdef, state = rng_state(mesh)
  batch = batch_with_unused_field(mesh, per_device=8)

  def step(state, batch):
    model = nnx.merge(graphdef, state)
    return (batch['inputs'] @ model.w[...]).sum()

  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(step, keep_unused=False), state, batch, cache=False)
  check_rows(report)
  assert report.row('batch and other inputs') == 8 * 512 * 4
  assert report.row('parameters') == 512 * 256 * 4


@pytest.mark.libtpu
def test_a_refused_client_step_counts_its_batch_as_laid_out():
  # The compiler refuses (two 48 GB temporaries on a 15.75 GiB chip): no
  # program to ask, so the batch counts by its own sharding, not replicated.
  mesh = fsm.make_mesh((2, 2), ('data', 'model'), topology='v5e:2x2', axis_types=AUTO)
  batch = {'inputs': placed(mesh, (4096, 1024), jnp.float32, P('data', None))}

  def step(batch):
    n = 12_000_000_000
    a = jnp.arange(n, dtype=jnp.float32) * batch['inputs'][0, 0]
    b = jnp.arange(n, dtype=jnp.float32) + batch['inputs'][1, 0]
    a, b = jax.lax.optimization_barrier((a, b))
    return (a * b).sum()

  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(step), batch, cache=False)
  assert report.refusal is not None and report.fits is False
  assert report.row('batch and other inputs') == 2048 * 1024 * 4
  assert all(r.bytes >= 0 for r in report.rows)
