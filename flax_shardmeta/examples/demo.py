"""The main job, end to end on a small model: annotate, lay out, init, train, check."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec

from flax_shardmeta._plan import plan, verify
from flax_shardmeta._rules import logical_axis_rules
from flax_shardmeta.examples.linen import MLP, MLP_RULES


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
    layout = plan(abstract, mesh)
    print(layout)
    shardings = layout.shardings()
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec('data')))
    state = jax.jit(init_fn, out_shardings=shardings)(jax.random.key(0), x)

    @functools.partial(jax.jit, out_shardings=(shardings, None), donate_argnums=0)
    def train_step(state, x):
      def loss_fn(params):
        y = state.apply_fn({'params': params}, x)
        return jnp.mean((y - 1.0) ** 2)
      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss

    losses = []
    for i in range(steps):
      state, loss = train_step(state, x)
      losses.append(float(loss))
      print(f'step {i}: loss {losses[-1]:.6f}')
    mismatches = verify(state, layout)
  for m in mismatches:
    print(f'  not as planned: {m}')
  if mismatches:
    print(f'FAILED: {len(mismatches)} arrays are not laid out as planned')
    return 1
  if steps > 1 and not losses[-1] < losses[0]:
    print(f'FAILED: the loss did not fall ({losses[0]:.6f} -> {losses[-1]:.6f})')
    return 1
  print(f'OK: all {len(layout.entries)} arrays carry their planned sharding; '
        f'loss {losses[0]:.6f} -> {losses[-1]:.6f}')
  return 0
