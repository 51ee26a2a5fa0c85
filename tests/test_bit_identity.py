"""Sharded generation gives the unsharded init's values, bit for bit.

``fsm.sharded_init`` (Linen) and fsm.nnx's eager construction on a mesh make
each parameter on its shards; a run must be reproducible on another mesh, so
the values are those of the same init run unsharded. The reference is the
unsharded init as one program (``jax.jit``), as sharded generation is: with
jax 0.10, XLA rounds ``normal(stddev)`` differently in one program than run
eagerly, sharded or not.

The last bit of an element can depend on the shape of the XLA loop computing
it. So a sharded parameter of at most a chunk is computed whole on every
device, in the unsharded program's own loops, each device keeping its shard;
a larger one window by window, in loops whose minor dimension is the
parameter's (``_loops.Loop``). The last tests check that XLA still computes
elements that way.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn, nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._generate import loops, windowed

INITS = {
  'lecun_normal': nn.initializers.lecun_normal(),
  'normal': nn.initializers.normal(0.02),
  'truncated_normal': nn.initializers.truncated_normal(0.5),
  'uniform': nn.initializers.uniform(0.3),
  'variance_scaling': nn.initializers.variance_scaling(2.0, 'fan_avg', 'normal'),
}
# The last dimension sharded, with and without the first; and not sharded.
SPECS = {
  'cols': (None, 'model'),
  'both': ('data', 'model'),
  'rows': ('model', None),
}
# (kernel shape, chunk_bytes): small kernels generated as one program; larger
# ones with a small chunk, chunk by chunk.
SIZES = {'small': ((8, 16), None), 'chunked': ((128, 16), 256)}


def _grid(*axes_and_values, fast):
  """Parameters for ``axis_type`` (which makes conftest's ``mesh``) and the
  given values; all but the ``fast`` ones (indices) run only with -m slow."""
  out = []
  for i, (axis_type, *values) in enumerate(axes_and_values):
    name = '-'.join(
      [axis_type.name.lower(), *(getattr(v, '__name__', v) for v in values)]
    )
    marks = () if i in fast else (pytest.mark.slow,)
    out.append(pytest.param(axis_type, *values, id=name, marks=marks))
  return out


AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit


def _cases():
  for init_name, init in INITS.items():
    for spec_name, spec in SPECS.items():
      yield f'{init_name}__{spec_name}', init, spec


def _assert_bit_identical(got, want, mesh=None):
  """Every leaf of ``got`` equals ``want``'s exactly, and lives on ``mesh``."""
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for (path, g), w in zip(got_leaves, want_leaves):
    name = jax.tree_util.keystr(path)
    assert g.shape == w.shape and g.dtype == w.dtype, name
    differ = int((np.asarray(g) != np.asarray(w)).sum())
    assert differ == 0, f'{name}: {differ} of {g.size} elements differ'
    if mesh is not None:
      assert g.sharding.mesh.shape == mesh.shape, name


# Linen: fsm.sharded_init, and eager init on a mesh
# ------------------------------------------------------------------------------


class Kernels(nn.Module):
  """One kernel per (initializer, layout) of ``_cases``."""

  shape: tuple[int, int]

  @nn.compact
  def __call__(self, x):
    for name, init, spec in _cases():
      self.param(name, fsm.with_partitioning(init, spec), self.shape)
    return x


class Layer(nn.Module):
  shape: tuple[int, int]

  @nn.compact
  def __call__(self, x, _):
    Kernels(self.shape, name='kernels')(x)
    self.param(
      'bias', fsm.with_partitioning(nn.initializers.normal(), ('model',)), (16,)
    )
    return x, None


class Stacked(nn.Module):
  """``Layer`` stacked 3 times by ``nn.scan``: kernels of (3, *shape)."""

  shape: tuple[int, int]

  @nn.compact
  def __call__(self, x):
    x, _ = nn.scan(
      Layer, length=3, variable_axes={'params': 0}, split_rngs={'params': True}
    )(self.shape)(x, None)
    return x


@pytest.mark.parametrize(
  'axis_type, module, size',
  _grid(
    (AUTO, Kernels, 'small'),
    (EXPLICIT, Kernels, 'chunked'),
    (AUTO, Stacked, 'chunked'),
    (EXPLICIT, Stacked, 'small'),
    (EXPLICIT, Kernels, 'small'),
    (AUTO, Kernels, 'chunked'),
    (EXPLICIT, Stacked, 'chunked'),
    (AUTO, Stacked, 'small'),
    fast={0, 1, 2},
  ),
)
def test_linen_sharded_init_is_bit_identical(mesh, module, size, windowed_generations):
  shape, chunk_bytes = SIZES[size]
  model = module(shape)
  key, x = jax.random.key(0), jnp.ones((1,))
  want = jax.jit(model.init)(key, x)
  calls = windowed_generations
  kwargs = {} if chunk_bytes is None else {'chunk_bytes': chunk_bytes}
  got = fsm.sharded_init(model.init, mesh, **kwargs)(key, x)
  _assert_bit_identical(got, want, mesh)
  kernels = len(INITS) * len(SPECS) + (module is Stacked)  # and stacked biases
  if chunk_bytes is None:
    # One program: each device computes every parameter whole (none is
    # larger than a chunk), in the unsharded init's loops, keeping its shard.
    assert calls == ['whole'] * kernels
  else:
    # Chunk by chunk (the plain program may be compiled too, to compare).
    assert calls[:kernels] == ['chunks'] * kernels
  if module is Kernels:
    assert got['params']['uniform__cols'].value.sharding.spec == P(None, 'model')
  else:
    kernel = got['params']['ScanLayer_0']['kernels']['uniform__cols'].value
    assert kernel.sharding.spec == P(None, None, 'model')


@pytest.mark.parametrize(
  'axis_type, size',
  _grid(
    (EXPLICIT, 'small'),
    (AUTO, 'chunked'),
    (AUTO, 'small'),
    (EXPLICIT, 'chunked'),
    fast={0},  # the generators are NNX's, tested below
  ),
)
def test_linen_eager_init_on_a_mesh_is_bit_identical(mesh, monkeypatch, size):
  # Each initializer runs on its shards as the value is created (`generate`).
  shape, chunk_bytes = SIZES[size]
  if chunk_bytes is not None:
    monkeypatch.setattr(windowed, 'CHUNK_BYTES', chunk_bytes)
  fsm.clear_caches()  # generators built for another chunk size
  model = Kernels(shape)
  key, x = jax.random.key(0), jnp.ones((1,))
  want = jax.jit(model.init)(key, x)
  try:
    with jax.set_mesh(mesh):
      got = model.init(key, x)
  finally:
    fsm.clear_caches()
  _assert_bit_identical(got, want, mesh)
  assert got['params']['uniform__cols'].value.sharding.spec == P(None, 'model')


class Larger(nn.Module):
  """One (256, 16) kernel per initializer, sharded over all 8 devices."""

  @nn.compact
  def __call__(self, x):
    for name, init in INITS.items():
      self.param(name, fsm.with_partitioning(init, ('data', 'model')), (256, 16))
    return x


def test_larger_parameters_in_one_program_are_made_from_their_shards(
  mesh, windowed_generations
):
  # A 12 KiB chunk: the whole model's generators fit a few chunks (one
  # program, no chunk loops), but each 16 KiB kernel is more than a chunk, so
  # each device computes its (128, 4) shard alone, in rows of 16.
  model = Larger()
  key, x = jax.random.key(0), jnp.ones((1,))
  want = jax.jit(model.init)(key, x)
  calls = windowed_generations
  got = fsm.sharded_init(model.init, mesh, chunk_bytes=12 * 1024)(key, x)
  _assert_bit_identical(got, want, mesh)
  assert calls == ['shard'] * len(INITS)


def test_the_readme_dense_matches_its_eager_unsharded_init():
  # The eager init, not only the jitted one: lecun_normal rounds alike both
  # ways on every supported jax.
  mesh = fsm.make_mesh((2, 4), ('data', 'model'))
  init = fsm.with_partitioning(nn.initializers.lecun_normal(), (None, 'model'))
  model = nn.Dense(16, kernel_init=init)
  key, x = jax.random.key(0), jnp.ones((2, 8))
  want = model.init(key, x)
  _assert_bit_identical(fsm.sharded_init(model.init, mesh)(key, x), want, mesh)


# NNX: eager construction on a mesh
# ------------------------------------------------------------------------------


class NnxKernels(nnx.Module):
  """One fsm.nnx-annotated kernel per (initializer, layout) of ``_cases``."""

  def __init__(self, shape: tuple[int, int], rngs: nnx.Rngs):
    for name, init, spec in _cases():
      value = fsm.nnx.with_partitioning(init, spec)(rngs.params(), shape, jnp.float32)
      setattr(self, name, nnx.Param(value))


@pytest.mark.parametrize(
  'axis_type, size',
  _grid(
    (AUTO, 'small'),
    (EXPLICIT, 'chunked'),
    (EXPLICIT, 'small'),
    (AUTO, 'chunked'),
    fast={0, 1},
  ),
)
def test_nnx_eager_construction_is_bit_identical(
  mesh, monkeypatch, size, windowed_generations
):
  shape, chunk_bytes = SIZES[size]
  want = nnx.state(nnx.jit(lambda: NnxKernels(shape, nnx.Rngs(0)))())
  if chunk_bytes is not None:
    # Kernels of more than chunk_bytes per device count as large.
    monkeypatch.setattr(windowed, 'CHUNK_BYTES', chunk_bytes)
  calls = windowed_generations
  fsm.clear_caches()  # generators built for another chunk size
  try:
    with jax.set_mesh(mesh):
      module = NnxKernels(shape, nnx.Rngs(0))
  finally:
    fsm.clear_caches()
  _assert_bit_identical(nnx.state(module), want, mesh)
  # Whole on every device when small; chunk by chunk when large.
  assert calls == ['whole' if chunk_bytes is None else 'chunks'] * len(calls)
  assert len(calls) == len(INITS) * len(SPECS)
  kernel = module.uniform__cols.get_value()
  assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(None, 'model')), 2)


# What the above rests on
# ------------------------------------------------------------------------------

# Windows of a (rows, width) parameter, as (offsets, shape): whole rows (the
# window's loop is its own shape), and cuts of the last dimension (computed
# in rows of the parameter's width), a few of them padded.
_WINDOWS = [
  ((0, 0), (1, None)),
  ((5, 0), (3, None)),
  ((16, 0), (17, None)),
  ((0, 0), (48, 2)),
  ((8, 1), (8, 3)),
  ((7, 4), (13, 4)),
]


@pytest.mark.parametrize('init_name', ['normal', 'truncated_normal'])
def test_xla_computes_an_element_by_its_loops_minor_dimension(init_name):
  # On XLA:CPU the last bit of erf_inv-based values can depend on the loop
  # computing them: its minor dimension decides the vector code. fsm's
  # windows are therefore computed in loops whose minor dimension is the
  # parameter's, and that is all they share with the unsharded loop: not its
  # number of rows, not where an element sits in a row. Should XLA let those
  # matter too, sharded values would no longer be the unsharded ones.
  init = INITS[init_name]
  key = jax.random.key(1)
  broken = []
  for width in (8, 16, 100, 128):
    shape = (48, width)
    full = np.asarray(jax.jit(lambda k, s=shape: init(k, s, jnp.float32))(key))
    closed = jax.make_jaxpr(lambda k, s=shape: [init(k, s, jnp.float32)])(key)
    w = windowed.analyse(closed, None, 0)
    assert w is not None
    windows = [
      (offsets, (rows, width if cols is None else min(cols, width - offsets[1])))
      for offsets, (rows, cols) in _WINDOWS
    ]

    def evaluate(k, windows=windows, w=w):
      return [
        w.evaluate([k], [jnp.uint32(o) for o in offsets], window, limit=10**6)
        for offsets, window in windows
      ]

    for (offsets, window), got in zip(windows, jax.jit(evaluate)(key)):
      want = full[tuple(slice(o, o + n) for o, n in zip(offsets, window))]
      differ = int((np.asarray(got) != want).sum())
      if differ:
        broken.append(f'{shape} at {offsets}, window {window}: {differ} differ')
  assert not broken, (
    f"XLA now computes {init_name} values by more than their loop's minor "
    'dimension, so sharded inits (flax_shardmeta._generate.loops.Loop) are no '
    'longer bit-identical to unsharded ones:\n' + '\n'.join(broken)
  )


@pytest.mark.parametrize(
  'shape, window, limit, loop',
  [
    ((8, 16), (8, 4), 0, (2, 16)),  # a shard of the last dimension: rows
    ((8, 16), (2, 16), 0, (2, 16)),  # whole rows: its own shape
    ((8, 16), (3, 5), 0, (1, 16)),  # padded to a row: at most doubles it
    ((8, 16), (1, 4), 0, (1, 4)),  # a row would be 4 times it...
    ((8, 16), (1, 4), 16, (1, 16)),  # ...unless the row fits in the limit
    ((4, 6, 10), (2, 3, 5), 0, (3, 10)),
    ((64,), (16,), 0, (16,)),  # 1-D: its own shape
  ],
)
def test_windows_are_computed_in_rows_of_the_parameters_last_dimension(
  shape, window, limit, loop
):
  offsets = [jnp.uint32(0)] * len(shape)
  assert loops.Loop(shape, offsets, window, limit).loop == loop


@pytest.mark.parametrize(
  'local, minor, target, plan',
  [
    ((512, 256), 1024, 32 * 1024, (0, 32)),  # 32 rows of the shard: 8 of 1024
    ((64, 32), 128, 1024, (0, 8)),  # 8 x 32 = 2 rows of 128, 1 KiB
    ((3, 64, 32), 32, 4096, (1, 32)),  # a layer is 8 KiB: within a layer
    ((2, 4), 16, 1024, None),  # less than one row of 16 in all
    ((4, 2, 8), 64, 64, None),  # a row of 64 exceeds the target
  ],
)
def test_chunks_of_whole_rows_are_planned(local, minor, target, plan):
  assert loops.rows_plan(local, minor, 4, target) == plan
