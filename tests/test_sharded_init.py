"""sharded_init and window-by-window generation (flax_shardmeta._init)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._generate import fill, loops, windowed
from flax_shardmeta._init import sharded_init as sharded_init_lib

RULES = (('embed', 'data'), ('mlp', 'model'), ('layers', None))
LECUN = nn.initializers.lecun_normal()


def _dot(a, b):
  # Explicit axes need the output layout of a sharded contraction spelled out.
  mesh = jax.sharding.get_abstract_mesh()
  explicit = not mesh.empty and mesh.are_all_axes_explicit
  return jnp.dot(a, b, out_sharding=P() if explicit else None)


class Block(nn.Module):
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(
      64,
      kernel_init=fsm.with_logical_partitioning(self.kernel_init, ('embed', 'mlp')),
      bias_init=fsm.with_logical_partitioning(nn.initializers.zeros, ('mlp',)),
    )(x)
    h = nn.relu(h)
    w = self.param(
      'w_out',
      fsm.with_logical_partitioning(nn.initializers.normal(0.02), ('mlp', 'embed')),
      (64, x.shape[-1]),
    )
    return _dot(h, w), None


class Stack(nn.Module):
  scan: bool
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x):
    if self.scan:
      x, _ = nn.scan(
        Block,
        length=3,
        variable_axes={'params': 0},
        split_rngs={'params': True},
        metadata_params={fsm.PARTITION_NAME: 'layers'},
      )(self.kernel_init)(x, None)
    else:
      for _ in range(3):
        x, _ = Block(self.kernel_init)(x, None)
    emb = self.param(
      'embedding',
      fsm.with_logical_partitioning(
        nn.initializers.variance_scaling(1.0, 'fan_in', 'uniform'), ('embed', 'mlp')
      ),
      (x.shape[-1], 256),
    )
    return _dot(x, emb)


def _check_same(got, want, shardings):
  """``got`` holds ``want``'s values bit for bit, laid out as ``shardings``.

  ``want`` is the unsharded init as one program (``jax.jit``), as sharded_init
  is: with jax 0.10, XLA rounds ``normal(stddev)`` differently in one program
  than run eagerly, unsharded or not.
  """
  for g, w, s in zip(
    jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(shardings)
  ):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert g.sharding.is_equivalent_to(s, g.ndim), (g.sharding, s)


# The whole grid runs in CI (-m slow); by default one Auto and one Explicit case.
_FAST = {('auto', 'lecun', 'scan'), ('explicit', 'orthogonal', 'unrolled')}
_GRID = [
  pytest.param(
    axis, init, scan, id='-'.join(ids), marks=() if ids in _FAST else pytest.mark.slow
  )
  for axis_id, axis in (('auto', AxisType.Auto), ('explicit', AxisType.Explicit))
  for init_id, init in (('lecun', LECUN), ('orthogonal', nn.initializers.orthogonal()))
  for scan_id, scan in (('unrolled', False), ('scan', True))
  for ids in [(axis_id, init_id, scan_id)]
]


@pytest.mark.parametrize('axis_type, init, scan', _GRID)  # axis_type: the mesh's
def test_values_and_layout_match_plain_jitted_init(mesh, scan, init):
  model = Stack(scan, init)
  x = jnp.ones((4, 32))
  key = jax.random.key(0)
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    abstract = jax.eval_shape(model.init, key, x)
    shardings = fsm.get_sharding(abstract, mesh)
    want = jax.jit(model.init, out_shardings=shardings)(key, x)
  # A tiny chunk size forces chunked generation on these small arrays.
  got = fsm.sharded_init(model.init, mesh, RULES, chunk_bytes=512)(key, x)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  # Bit for bit the unsharded init's values; an orthogonal init, generated
  # as XLA partitions it, the partitioned program's.
  unsharded = jax.jit(model.init)(key, x)
  _check_same(got, unsharded if init is LECUN else want, shardings)
  assert got['params']['embedding'].names == ('embed', 'mlp')


def test_train_state_with_optimizer(mesh):
  model = Stack(True)
  tx = optax.adam(1e-3)

  def init_fn(key, x):
    params = model.init(key, x)['params']
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  x = jnp.ones((4, 32))
  got = fsm.sharded_init(init_fn, mesh, RULES, chunk_bytes=512)(jax.random.key(1), x)
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    shardings = fsm.get_sharding(jax.eval_shape(init_fn, jax.random.key(1), x), mesh)
  # Unsharded and jitted: `step` is an array there too.
  _check_same(got, jax.jit(init_fn)(jax.random.key(1), x), shardings)


def test_chunked_program_keeps_temporaries_small(mesh):
  # Structure, not speed: the chunked program's temporaries are a few chunks,
  # the plain one's are three times the largest shard.
  model = nn.Dense(
    1024,
    use_bias=False,
    kernel_init=fsm.with_logical_partitioning(
      nn.initializers.lecun_normal(), ('embed', 'mlp')
    ),
  )
  x = jnp.ones((2, 1024))
  key = jax.random.key(0)
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    shardings = fsm.get_sharding(jax.eval_shape(model.init, key, x), mesh)
    plain = jax.jit(model.init, out_shardings=shardings).lower(key, x).compile()
  chunk = 32 * 1024
  chunked = fsm.sharded_init(model.init, mesh, RULES, chunk_bytes=chunk)
  compiled = chunked.lower(key, x).compile().memory_analysis()
  shard = 1024 * 1024 * 4 // 8
  assert compiled.output_size_in_bytes == shard
  plain_temps = plain.memory_analysis().temp_size_in_bytes
  assert plain_temps >= 2 * shard
  assert compiled.temp_size_in_bytes <= 6 * chunk < plain_temps / 4


class Wide(nn.Module):
  """``count`` independent (rows, cols) parameters, each sharded over all 8 devices."""

  count: int
  rows: int
  cols: int

  @nn.compact
  def __call__(self, x):
    for i in range(self.count):
      self.param(
        f'w{i}',
        fsm.with_logical_partitioning(nn.initializers.lecun_normal(), ('embed', 'mlp')),
        (self.rows, self.cols),
      )
    return x


@pytest.mark.parametrize('shard_per_chunk', [0.25, 1, 4])
def test_temporaries_stay_a_few_chunks_for_every_shard_size(
  mesh, monkeypatch, shard_per_chunk
):
  # XLA runs the generators of independent parameters side by side, so many
  # shards no larger than a chunk held as much as one large one.
  chunk = 16 * 1024
  rows = 64
  cols = int(chunk * shard_per_chunk * 8 // (rows * 4))
  model = Wide(16, rows, cols)
  key, x = jax.random.key(0), jnp.ones((1,))
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    shardings = fsm.get_sharding(jax.eval_shape(model.init, key, x), mesh)
    plain = jax.jit(model.init, out_shardings=shardings).lower(key, x).compile()
  measured = []
  real = sharded_init_lib.program_memory
  monkeypatch.setattr(
    sharded_init_lib, 'program_memory', lambda c: measured.append(1) or real(c)
  )
  chunked = fsm.sharded_init(model.init, mesh, RULES, chunk_bytes=chunk)
  got = chunked.lower(key, x).compile().memory_analysis()
  assert len(measured) == 1, 'more than the chunked program was compiled'
  budget = sharded_init_lib.FEW_CHUNKS * chunk
  assert plain.memory_analysis().temp_size_in_bytes > budget
  assert got.temp_size_in_bytes <= budget
  assert got.output_size_in_bytes >= 16 * rows * cols * 4 // 8
  _check_same(chunked(key, x), jax.jit(model.init)(key, x), shardings)


def test_a_small_model_keeps_plain_generation(mesh, windowed_generations):
  # Within a few chunks of temporaries, the plain program is the one run: no
  # chunk loops. Its 3 kernels, 3 output weights and embedding are sharded
  # and no larger than a chunk, so each device computes them whole, in the
  # unsharded init's loops, and keeps its shard; the biases (zeros) are
  # generated as XLA partitions them.
  calls = windowed_generations
  model = Stack(False)
  key, x = jax.random.key(0), jnp.ones((4, 32))
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    shardings = fsm.get_sharding(jax.eval_shape(model.init, key, x), mesh)
  got = fsm.sharded_init(model.init, mesh, RULES)(key, x)
  assert calls == ['whole'] * 7
  _check_same(got, jax.jit(model.init)(key, x), shardings)


@pytest.mark.parametrize(
  'layer',
  [
    nn.Dense(
      16,
      kernel_init=fsm.with_partitioning(nn.initializers.orthogonal(), (None, 'model')),
    ),
    # DenseGeneral initializes a (16, 16) kernel and reshapes it.
    nn.DenseGeneral(
      (4, 4),
      kernel_init=fsm.with_partitioning(LECUN, (None, 'model', None)),
    ),
  ],
  ids=['orthogonal', 'reshaped'],
)
def test_small_parameters_are_exact_whatever_their_initializer(mesh, layer):
  # Computed whole on every device by the init's own operations, elementwise
  # or not (orthogonal's QR, a reshape), each device keeping its shard.
  key, x = jax.random.key(0), jnp.ones((1, 16))
  with jax.set_mesh(mesh):
    shardings = fsm.get_sharding(jax.eval_shape(layer.init, key, x), mesh)
  got = fsm.sharded_init(layer.init, mesh)(key, x)
  _check_same(got, jax.jit(layer.init)(key, x), shardings)


def test_larger_ones_that_cannot_be_windowed_are_partitioned_by_xla(mesh):
  # A (64, 64) orthogonal kernel is more than this chunk, and its shards cut
  # the last dimension; the small model's program (no dry run per output)
  # finds out while tracing that it is not elementwise, and lets XLA
  # partition it, as jit(init, out_shardings) does.
  init = fsm.with_partitioning(nn.initializers.orthogonal(), (None, 'model'))
  model = nn.Dense(64, use_bias=False, kernel_init=init)
  key, x = jax.random.key(0), jnp.ones((1, 64))
  with jax.set_mesh(mesh):
    shardings = fsm.get_sharding(jax.eval_shape(model.init, key, x), mesh)
    want = jax.jit(model.init, out_shardings=shardings)(key, x)
  got = fsm.sharded_init(model.init, mesh, chunk_bytes=4096)(key, x)
  _check_same(got, want, shardings)


@pytest.mark.parametrize('chunk_bytes, chunked', [(512, True), (None, False)])
def test_without_a_memory_analysis_the_worst_case_decides(
  mesh, monkeypatch, chunk_bytes, chunked, windowed_generations
):
  # A backend that reports nothing: plain generation only when every generator
  # running at once would still hold a few chunks (here 2 x 64x64 float32).
  monkeypatch.setattr(sharded_init_lib, 'program_memory', lambda compiled: None)
  calls = windowed_generations
  model = Wide(2, 64, 64)
  key, x = jax.random.key(0), jnp.ones((1,))
  kwargs = {} if chunk_bytes is None else {'chunk_bytes': chunk_bytes}
  out = fsm.sharded_init(model.init, mesh, RULES, **kwargs)(key, x)
  # Both parameters from their windows: chunk by chunk, or (small and
  # sharded) each computed whole on every device.
  assert calls == (['chunks'] if chunked else ['whole']) * 2
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    shardings = fsm.get_sharding(jax.eval_shape(model.init, key, x), mesh)
  _check_same(out, jax.jit(model.init)(key, x), shardings)


def test_problems_raise_before_anything_runs(mesh):
  model = nn.Dense(
    6,
    kernel_init=fsm.with_logical_partitioning(
      nn.initializers.lecun_normal(), ('embed', 'mlp')
    ),
  )
  with pytest.raises(fsm.ShardingError, match='params/kernel'):
    fsm.sharded_init(model.init, mesh, RULES)(jax.random.key(0), jnp.ones((1, 6)))


@pytest.mark.parametrize(
  'offsets,window',
  [((0, 0, 0), (6, 10, 4)), ((2, 3, 1), (3, 5, 2)), ((5, 9, 3), (1, 1, 1))],
)
@pytest.mark.parametrize('limit', [0, 10**6], ids=['own-shape', 'rows'])
def test_window_bits_are_jax_bits(offsets, window, limit):
  # In the window's own shape, or in rows of the parameter's last dimension.
  key = jax.random.key(3)
  shape = (6, 10, 4)
  full = jax.random.bits(key, shape, jnp.uint32)
  loop = loops.Loop(shape, [jnp.uint32(o) for o in offsets], window, limit)
  got = loop.unpack(windowed._window_bits(key, 32, loop.flat_index()))
  sl = tuple(slice(o, o + w) for o, w in zip(offsets, window))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(full[sl]))


def test_unsupported_initializers_are_detected():
  key = jax.random.key(0)
  ortho = jax.make_jaxpr(lambda k: [nn.initializers.orthogonal()(k, (8, 8))])(key)
  normal = jax.make_jaxpr(lambda k: [nn.initializers.normal()(k, (8, 8))])(key)
  assert windowed.analyse(ortho, None, 0) is None
  assert windowed.analyse(normal, None, 0) is not None
  rbg = jax.random.key(0, impl='rbg')
  rbg_jaxpr = jax.make_jaxpr(lambda k: [nn.initializers.normal()(k, (8, 8))])(rbg)
  assert windowed.analyse(rbg_jaxpr, None, 0) is None


def test_output_on_explicit_mesh_keeps_explicit_axes():
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  model = nn.Dense(
    64,
    kernel_init=fsm.with_partitioning(
      nn.initializers.lecun_normal(), ('data', 'model')
    ),
  )
  out = fsm.sharded_init(model.init, mesh, chunk_bytes=512)(
    jax.random.key(0), jnp.ones((2, 32))
  )
  kernel = out['params']['kernel'].value
  assert kernel.sharding == NamedSharding(mesh, P('data', 'model'))
  # Explicit-axis arrays compute as usual afterwards.
  with jax.set_mesh(mesh):
    assert jax.jit(lambda k: k * 2)(kernel).sharding.spec == P('data', 'model')


def test_eager_nnx_construction_fills_large_parameters_by_chunks(mesh, monkeypatch):
  from flax import nnx

  # Make this small kernel count as large so the chunked generator is used.
  monkeypatch.setattr(windowed, 'CHUNK_BYTES', 256)
  calls = []
  real = fill.generate_sharded
  monkeypatch.setattr(
    fill, 'generate_sharded', lambda *a, **k: calls.append(1) or real(*a, **k)
  )
  base = nnx.initializers.truncated_normal(0.5)
  init = fsm.nnx.with_logical_partitioning(base, ('embed', 'mlp'))
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    layer = nnx.Linear(72, 136, use_bias=False, kernel_init=init, rngs=nnx.Rngs(3))
  kernel = layer.kernel.get_value()
  assert calls, 'the chunked generator was not used'
  assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P('data', 'model')), 2)
  want = nnx.Linear(72, 136, use_bias=False, kernel_init=base, rngs=nnx.Rngs(3))
  np.testing.assert_array_equal(np.asarray(kernel), np.asarray(want.kernel.get_value()))


def test_an_abstract_mesh_is_refused_with_a_named_error():
  mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
  with pytest.raises(
    fsm.NoMeshError, match=r'needs a concrete jax.sharding.Mesh.*fsm.plan'
  ):
    fsm.sharded_init(lambda key: {}, mesh)
