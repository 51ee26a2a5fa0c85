"""The Flax scale-up notebook, end to end, on flax_shardmeta.

Mesh-axis and logical annotations, unrolled and with ``nn.scan``, on Auto and
Explicit meshes: abstract init, shardings, sharded init and a train step,
checking every array's layout along the way.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta.examples.linen import MLP, MLP_RULES

BATCH, LAYERS, DEPTH = 8, 2, 64
RULES = MLP_RULES


def model_of(num_layers, use_scan, logical):
  """The notebook's model, annotated with logical names or with mesh axes."""
  return MLP(num_layers, DEPTH, use_scan, mesh_axes=not logical)


def init_fn(key, x, model, tx):
  variables = model.init(key, x)
  return train_state.TrainState.create(
    apply_fn=model.apply, params=variables['params'], tx=tx
  )


def expected_specs(use_scan):
  lead = (None,) if use_scan else ()
  return P(*lead, None, 'model'), P(*lead, 'model', None)


def first_layer(params, use_scan):
  return params['ScanDotReluDot_0'] if use_scan else params['DotReluDot_0']


# The whole grid runs in CI (-m slow); by default one Auto and one Explicit case.
_FAST = {('auto', 'scan', 'logical'), ('explicit', 'unrolled', 'mesh-axes')}
_GRID = [
  pytest.param(
    axis,
    use_scan,
    logical,
    id='-'.join(ids),
    marks=() if ids in _FAST else pytest.mark.slow,
  )
  for axis_id, axis in (('auto', AxisType.Auto), ('explicit', AxisType.Explicit))
  for scan_id, use_scan in (('unrolled', False), ('scan', True))
  for logical_id, logical in (('mesh-axes', False), ('logical', True))
  for ids in [(axis_id, scan_id, logical_id)]
]


@pytest.mark.parametrize('axis_type, use_scan, logical', _GRID)  # axis_type: the mesh's
def test_notebook_flow(mesh, use_scan, logical):
  model = model_of(LAYERS, use_scan, logical)
  tx = optax.adam(1e-3)
  init = functools.partial(init_fn, model=model, tx=tx)
  key = jax.random.key(0)
  rules = RULES if logical else ()
  x_sharding = NamedSharding(mesh, P('data', None))

  with fsm.logical_axis_rules(rules), jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((BATCH, DEPTH)), x_sharding)
    abstract = jax.eval_shape(init, key, x)

    # Annotations stay as written; they survive nn.scan with the layer axis.
    specs = fsm.get_partition_spec(abstract)
    layer = first_layer(specs.params, use_scan)
    lead = (('layers',) if logical else (None,)) if use_scan else ()
    written = (
      (('embed', 'hidden'), ('hidden', 'embed'))
      if logical
      else ((None, 'model'), ('model', None))
    )
    assert layer['Dense_0']['kernel'] == P(*lead, *written[0])
    assert layer['W2'] == P(*lead, *written[1])

    shardings = fsm.get_sharding(abstract, mesh)
    kernel_spec, w2_spec = expected_specs(use_scan)
    layer = first_layer(shardings.params, use_scan)
    assert layer['Dense_0']['kernel'] == NamedSharding(mesh, kernel_spec)
    assert layer['W2'] == NamedSharding(mesh, w2_spec)
    assert shardings.step == NamedSharding(mesh, P())
    # Adam's moments mirror their parameters.
    mu = first_layer(shardings.opt_state[0].mu, use_scan)
    assert mu['W2'] == NamedSharding(mesh, w2_spec)

    # The notebook's logical path agrees with get_sharding.
    if logical:
      via_specs = fsm.logical_to_mesh_sharding(specs, mesh)
      assert fsm.unbox(via_specs.params) == fsm.unbox(shardings.params)

    state = jax.jit(init, out_shardings=shardings)(key, x)
    planned = jax.tree_util.tree_leaves(shardings)
    arrays = jax.tree_util.tree_leaves(state)
    assert len(planned) == len(arrays) > 0
    for s, a in zip(planned, arrays):
      assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)
    kernel = first_layer(state.params, use_scan)['Dense_0']['kernel']
    assert isinstance(kernel, fsm.LogicalPartitioned if logical else fsm.Partitioned)
    assert kernel.value.shape == ((LAYERS,) if use_scan else ()) + (DEPTH, DEPTH)

    @functools.partial(jax.jit, out_shardings=shardings)
    def train_step(state, x):
      def loss(params):
        return state.apply_fn({'params': params}, x).sum()

      return state.apply_gradients(grads=jax.grad(loss)(state.params))

    new_state = train_step(state, x)
    assert int(new_state.step) == 1
    for s, a in zip(planned, jax.tree_util.tree_leaves(new_state)):
      assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)
    moved = jax.tree_util.tree_map(
      lambda a, b: float(jnp.abs(a - b).max()),
      fsm.unbox(state.params),
      fsm.unbox(new_state.params),
    )
    assert all(d > 0 for d in jax.tree_util.tree_leaves(moved))

  # unbox / replace_boxed keep the annotations, as in the notebook.
  raw = fsm.unbox(new_state.params)
  zeros = fsm.replace_boxed(
    new_state.params, jax.tree_util.tree_map(jnp.zeros_like, raw)
  )
  zero_kernel = first_layer(zeros, use_scan)['Dense_0']['kernel']
  assert zero_kernel.names == kernel.names
  np.testing.assert_array_equal(zero_kernel.value, 0)


def test_unrolled_and_logical_plans_agree(mesh):
  # The notebook's point: logical rules reproduce the hand-written layout.
  x = jnp.ones((BATCH, DEPTH))
  tx = optax.adam(1e-3)
  out = {}
  for logical in (False, True):
    init = functools.partial(init_fn, model=model_of(2, False, logical), tx=tx)
    with jax.set_mesh(mesh):
      abstract = jax.eval_shape(init, jax.random.key(0), x)
    out[logical] = fsm.unbox(fsm.get_sharding(abstract, mesh, RULES).params)
  assert out[False] == out[True]
