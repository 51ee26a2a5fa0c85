"""The main job, end to end on a small model: annotate, lay out, init, train, check."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec

from flax_shardmeta.models import MLP, MLP_RULES
from flax_shardmeta.rules import logical_axis_rules
from flax_shardmeta.sharding import get_partition_spec, get_sharding


def run(steps: int = 5) -> int:
  """Runs the demo on a (2, 4) mesh; returns a process exit code."""
  if jax.device_count() < 8:
    print(f'demo needs 8 devices, found {jax.device_count()}', file=sys.stderr)
    return 1
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  model = MLP(num_layers=4, depth=256, use_scan=True)
  tx = optax.adam(1e-3)
  x = jnp.ones((16, 256))

  def init_fn(key, x):
    params = model.init(key, x)['params']
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  with jax.set_mesh(mesh), logical_axis_rules(MLP_RULES):
    abstract = jax.eval_shape(init_fn, jax.random.key(0), x)
    shardings = get_sharding(abstract, mesh)
    names = get_partition_spec(abstract.params)
    print(f'mesh {dict(mesh.shape)}, rules {MLP_RULES}')
    for (path, spec), s in zip(
        jax.tree_util.tree_leaves_with_path(names),
        jax.tree_util.tree_leaves(shardings.params),
    ):
      p = '/'.join(str(getattr(k, 'key', k)) for k in path)
      print(f'  params/{p}: {spec} -> {s.spec}')
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec('data')))
    state = jax.jit(init_fn, out_shardings=shardings)(jax.random.key(0), x)

    @functools.partial(jax.jit, out_shardings=(shardings, None), donate_argnums=0)
    def train_step(state, x):
      def loss_fn(params):
        y = state.apply_fn({'params': params}, x)
        return jnp.mean((y - 1.0) ** 2)
      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss

    for i in range(steps):
      state, loss = train_step(state, x)
      print(f'  step {i}: loss {float(loss):.6f}')
    bad = [
        a for a, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings))
        if not a.sharding.is_equivalent_to(s, a.ndim)
    ]
  if bad:
    print(f'FAILED: {len(bad)} arrays are not laid out as planned')
    return 1
  print('OK: every array carries its planned sharding')
  return 0
