"""The main job, end to end on a small model: annotate, lay out, init, train, check.

The same code runs in one process with 8 devices or in several processes
(``flax-shardmeta demo --processes 2``): the mesh's data axis spans the
processes, each loads only its own rows of the batch, and the result is
compared with the single-process run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import flax_shardmeta as fsm
from flax_shardmeta.examples.linen import MLP, MLP_RULES

WIDTH, BATCH = 256, 16
# Several processes sum gradients in another order than one process. Adam
# turns any near-zero gradient into a step of +-lr, so that float noise would
# flip whole steps; a larger eps keeps such steps as small as their gradients
# and the runs comparable to 1e-5.
OPTIMIZER = optax.adamw(1e-3, eps=1e-3)


def run(steps: int = 5, out: Path | None = None) -> int:
  """Runs the demo on a (2, 4) mesh over every process; returns an exit code.

  Process 0 prints; with ``out`` it also writes the trained parameters there
  (``params.npz``) for comparison with another run.
  """
  if jax.device_count() != 8:
    print(f'demo needs 8 devices, found {jax.device_count()}', file=sys.stderr)
    return 1
  say = print if jax.process_index() == 0 else (lambda *a, **k: None)
  mesh = fsm.make_mesh(
    (2, 4), ('data', 'model'), dcn_axis_sizes=(jax.process_count(), 1)
  )
  model = MLP(num_layers=4, depth=WIDTH, use_scan=True)

  def init_fn(key: jax.Array) -> train_state.TrainState:
    params = model.init(key, jnp.ones((2, WIDTH)))['params']
    return train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=OPTIMIZER
    )

  def train_step(state: Any, x: jax.Array) -> tuple[Any, jax.Array]:
    def loss_fn(params: Any) -> jax.Array:
      y = state.apply_fn({'params': params}, x)
      return jnp.mean((y - jnp.tanh(x)) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  with fsm.logical_axis_rules(MLP_RULES):
    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    layout = fsm.plan(abstract, mesh)
    state = fsm.sharded_init(init_fn, mesh)(jax.random.key(0))
  say(layout)

  # Each process loads only the batch rows its devices hold.
  data = fsm.data_layout(mesh, BATCH, rules=MLP_RULES)
  rows = np.random.default_rng(0).normal(size=(BATCH, WIDTH)).astype(np.float32)
  mine = rows[data.shard_id * data.batch_size : (data.shard_id + 1) * data.batch_size]
  x = fsm.host_local_to_global(mine, mesh, ('batch', None), MLP_RULES)
  say(
    f'{jax.process_count()} process(es) x {jax.local_device_count()} devices; '
    f'each loads {data.batch_size} of {BATCH} rows'
  )

  step = fsm.jit(
    train_step,
    mesh=mesh,
    rules=MLP_RULES,
    in_shardings=(abstract, ('batch', None)),
    out_shardings=(layout.shardings(), None),
    donate_argnums=0,
  )
  losses = []
  for i in range(steps):
    state, loss = step(state, x)
    losses.append(float(loss))
    say(f'step {i}: loss {losses[-1]:.6f}')
  mismatches = fsm.verify(state, layout)
  params = fsm.gather_tree(fsm.unbox(state.params))  # every process takes part
  if out is not None and jax.process_index() == 0:
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / 'params.npz', **_flat(params))  # pyright: ignore[reportArgumentType]
  for m in mismatches:
    say(f'  not as planned: {m}')
  if mismatches:
    say(f'FAILED: {len(mismatches)} arrays are not laid out as planned')
    return 1
  if steps > 1 and not losses[-1] < losses[0]:
    say(f'FAILED: the loss did not fall ({losses[0]:.6f} -> {losses[-1]:.6f})')
    return 1
  say(
    f'OK: all {len(layout.entries)} arrays carry their planned sharding; '
    f'loss {losses[0]:.6f} -> {losses[-1]:.6f}'
  )
  return 0


def _flat(tree: Any) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def compare(single: Path, multi: Path, rtol: float = 1e-5) -> str:
  """'' when both runs' parameters agree to ``rtol``, else what differs."""
  with np.load(single / 'params.npz') as a, np.load(multi / 'params.npz') as b:
    if set(a) != set(b):
      return f'different arrays: {sorted(set(a) ^ set(b))}'
    for k in a:
      if not np.allclose(b[k], a[k], rtol=rtol, atol=1e-7):
        worst = float(np.max(np.abs(b[k] - a[k])))
        return f'{k} differs by up to {worst:.3g}'
    return ''
