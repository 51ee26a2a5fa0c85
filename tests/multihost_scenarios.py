"""Training runs that behave the same in 1 process x 8 devices and N x 8/N.

Run as ``python tests/multihost_scenarios.py SCENARIO OUTDIR`` by each process
of a launch (``flax_shardmeta._hosts.launch``), or called in-process by the tests
with 8 devices. Process 0 writes what the tests compare to ``OUTDIR``:
``params.npz`` (gathered, full values) and ``report.json``. Every process
checks what it can itself (layouts, checkpoint round trip, shard/gather
round trip) and raises on a mismatch, which fails the launch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == '__main__':
  # Join the launch before jax starts its backends.
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  from flax_shardmeta._hosts import launch as _launch

  _launch.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import (  # noqa: E402
  AxisType,
  NamedSharding,
  PartitionSpec as P,  # noqa: E402
)

import flax_shardmeta as fsm  # noqa: E402
from flax_shardmeta.examples import (
  linen as linen_models,  # noqa: E402
  nnx as nnx_models,  # noqa: E402
)

RULES = linen_models.MLP_RULES
# Processes sum gradients in another order than one process does. Adam turns a
# near-zero gradient into a +-lr step whatever its size, so that float noise
# would flip whole steps; a larger eps keeps such steps as small as the
# gradients, and the runs agree to 1e-5.
OPTIMIZER = optax.adamw(1e-2, eps=1e-3)
WIDTH, DEPTH, LAYERS, BATCH, STEPS = 32, 64, 2, 16, 3


def _batch() -> np.ndarray:
  return np.random.default_rng(0).normal(size=(BATCH, WIDTH)).astype(np.float32)


def _local_rows(mesh: jax.sharding.Mesh) -> tuple[fsm.DataLayout, np.ndarray]:
  layout = fsm.data_layout(mesh, BATCH)
  start = layout.shard_id * layout.batch_size
  return layout, _batch()[start : start + layout.batch_size]


def _flat(tree) -> dict[str, np.ndarray]:
  leaves = jax.tree_util.tree_flatten_with_path(fsm.gather_tree(fsm.unbox(tree)))[0]
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def _same(a, b, what: str) -> None:
  fa, fb = _flat(a), _flat(b)
  if fa.keys() != fb.keys():
    raise AssertionError(f'{what}: different leaves {fa.keys() ^ fb.keys()}')
  for k in fa:
    if not np.array_equal(fa[k], fb[k]):
      raise AssertionError(f'{what}: {k} differs')


class _Recorder:
  """A host array that records which slices are read from it."""

  def __init__(self, array: np.ndarray):
    self.array, self.shape, self.dtype = array, array.shape, array.dtype
    self.size = array.size
    self.read = []

  def __getitem__(self, index):
    self.read.append(index)
    return self.array[index]


def _key(index, shape):
  return tuple(i.indices(n)[:2] for i, n in zip(index, shape))


def _round_trips(state, abstract, mesh, ckpt_dir: Path) -> float:
  """Checkpoint and shard/gather round trips, bit for bit.

  Returns the fraction of the host values ``shard_tree`` read in this process.
  """
  target = fsm.as_abstract(abstract, mesh)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(ckpt_dir.resolve(), state)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(ckpt_dir.resolve(), target)
  _same(state, restored, 'orbax restore')
  for a, b in zip(
    jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)
  ):
    # Auto axes: jit's outputs carry XLA's spec (trailing Nones dropped), the
    # restore target fsm's full-length one; the layout is what must agree.
    if not a.sharding.is_equivalent_to(b.sharding, a.ndim):
      raise AssertionError(f'restored with {b.sharding}, saved with {a.sharding}')
  host = jax.tree_util.tree_map(_Recorder, fsm.gather_tree(state))
  again = fsm.shard_tree(host, target)
  _same(state, again, 'shard_tree(gather_tree(state))')
  # Each process read exactly the slices its own devices hold (with the model
  # axis across processes, that is part of each parameter).
  elements = [0, 0]  # read, in all
  for rec, arr in zip(
    jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(again)
  ):
    held = {_key(shard.index, arr.shape) for shard in arr.addressable_shards}
    read = {_key(index, arr.shape) for index in rec.read}
    if read != held:
      raise AssertionError(f'read slices {read}, local devices hold {held}')
    elements[0] += sum(int(np.prod([b - a for a, b in k])) for k in read)
    elements[1] += rec.size
  if fsm.verify(again, fsm.plan(abstract, mesh)):
    raise AssertionError('shard_tree did not give the planned layout')
  return elements[0] / elements[1]


def linen(outdir: Path, dcn: str = 'data') -> dict:
  """The notebook MLP (nn.scan layers, logical names), 3 adamw steps."""
  n = jax.process_count()
  mesh = fsm.make_mesh(
    (2, 4), ('data', 'model'), dcn_axis_sizes=(n, 1) if dcn == 'data' else (1, n)
  )
  model = linen_models.MLP(num_layers=LAYERS, depth=DEPTH)
  tx = OPTIMIZER

  def init_fn(key):
    params = model.init(key, jnp.ones((2, WIDTH)))['params']
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def train_step(state, x):
    def loss_fn(params):
      return jnp.mean((state.apply_fn({'params': params}, x) - 1.0) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  with fsm.logical_axis_rules(RULES):
    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    shardings = fsm.get_sharding(abstract, mesh)
    state = fsm.sharded_init(init_fn, mesh)(jax.random.key(0))
  layout, local = _local_rows(mesh)
  x = fsm.host_local_to_global(local, mesh, ('batch', None), RULES)
  if not np.array_equal(fsm.global_to_host_local(x), local):
    raise AssertionError('global_to_host_local did not give back the local rows')
  # The rules travel with the function: no context at the call site.
  step = fsm.jit(
    train_step,
    mesh=mesh,
    rules=RULES,
    in_shardings=(abstract, ('batch', None)),
    out_shardings=(shardings, None),
    donate_argnums=0,
  )
  losses = []
  for _ in range(STEPS):
    state, loss = step(state, x)
    losses.append(float(loss))
  mismatches = fsm.verify(state, fsm.plan(abstract, mesh, RULES))
  if mismatches:
    raise AssertionError(f'not as planned: {mismatches}')
  with fsm.logical_axis_rules(RULES):
    read = _round_trips(state, abstract, mesh, outdir / f'ckpt-{dcn}')
  return _report(outdir, state.params, layout, losses, mesh, read)


def nnx_eager(outdir: Path) -> dict:
  """The NNX MLP built eagerly on its shards, trained with nnx.Optimizer."""
  mesh = fsm.make_mesh(
    (2, 4), ('data', 'model'), dcn_axis_sizes=(jax.process_count(), 1)
  )

  def create():
    return nnx_models.MLP(LAYERS, DEPTH, WIDTH, rngs=nnx.Rngs(0))

  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    model = fsm.nnx.shard_module(create())
    optimizer = nnx.Optimizer(model, OPTIMIZER, wrt=nnx.Param)
    abstract = nnx.state(nnx.eval_shape(create), nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def train_step(state, x):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(m):
      return jnp.mean((m(x) - 1.0) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  layout, local = _local_rows(mesh)
  x = fsm.host_local_to_global(local, mesh, ('batch', None), RULES)
  step = fsm.jit(train_step, mesh=mesh, rules=RULES, donate_argnums=0)
  losses = []
  for _ in range(STEPS):
    state, loss = step(state, x)
    losses.append(float(loss))
  model, _ = nnx.merge(graphdef, state)
  params = nnx.state(model, nnx.Param)
  with fsm.logical_axis_rules(RULES):
    mismatches = fsm.verify(params, fsm.plan(abstract, mesh))
    if mismatches:
      raise AssertionError(f'not as planned: {mismatches}')
    read = _round_trips(params, abstract, mesh, outdir / 'ckpt-nnx')
  return _report(outdir, params, layout, losses, mesh, read)


def _report(
  outdir: Path,
  params,
  layout: fsm.DataLayout,
  losses: list[float],
  mesh: jax.sharding.Mesh,
  read: float,
) -> dict:
  flat = _flat(params)  # a collective: every process takes part
  report = {
    'process_count': jax.process_count(),
    'layout': {
      'batch_size': layout.batch_size,
      'shard_id': layout.shard_id,
      'num_shards': layout.num_shards,
      'first': layout.is_first_host_in_replica_set,
    },
    'losses': losses,
    'fraction_read_by_shard_tree': read,
    'mesh_processes': [[d.process_index for d in row] for row in mesh.devices],
  }
  # Each process records its own layout; process 0 also writes the values.
  (outdir / f'layout-{jax.process_index()}.json').write_text(json.dumps(report))
  if jax.process_index() == 0:
    np.savez(outdir / 'params.npz', **flat)
    (outdir / 'report.json').write_text(json.dumps(report))
  return report


def disagreeing_batch(outdir: Path) -> dict:
  """Process 0 passes 8 rows, the others 6: every process must get the error."""
  mesh = fsm.make_mesh(
    (2, 4), ('data', 'model'), dcn_axis_sizes=(jax.process_count(), 1)
  )
  rows = 8 if jax.process_index() == 0 else 6
  local = {'x': np.ones((rows, WIDTH), np.float32), 'y': np.zeros(rows, np.int32)}
  try:
    names = {'x': ('batch', None), 'y': ('batch',)}
    batch = fsm.host_local_to_global(local, mesh, names, RULES)
  except fsm.BatchLayoutError as e:
    (outdir / f'error-{jax.process_index()}.txt').write_text(str(e))
  else:
    shapes = {k: v.shape for k, v in batch.items()}
    raise AssertionError(f'no error; this process built global arrays {shapes}')
  # Rows one process cannot split (its devices hold 2 of the 4 'data' shards):
  # it raises why, every other process is told so.
  wide = fsm.make_mesh(
    (4, 2), ('data', 'model'), dcn_axis_sizes=(jax.process_count(), 1)
  )
  try:
    fsm.host_local_to_global(
      np.ones((7 if jax.process_index() == 1 else 8, WIDTH), np.float32),
      wide,
      ('batch', None),
      RULES,
    )
  except (fsm.ShardingError, fsm.BatchLayoutError) as e:
    name = f'split-error-{jax.process_index()}.txt'
    (outdir / name).write_text(f'{type(e).__name__}: {e}')
  else:
    raise AssertionError('no error for 7 rows on 1 device')
  # Agreeing processes still get their global batch, after the failed calls.
  layout, same = _local_rows(mesh)
  good = fsm.host_local_to_global(same, mesh, ('batch', None), RULES)
  if good.shape != (BATCH, WIDTH) or layout.batch_size != BATCH // 2:
    raise AssertionError(f'global batch {good.shape}, local {layout.batch_size}')
  return {}


# A tree saved on 'data'=8 and restored across processes. Random values (not
# a ramp): they barely compress, so the bytes each process reads stay close
# to the leaves' size and a few KiB of metadata reads are a small fraction.
RESTORED = {
  'dense': ((2048, 512), np.float32),  # 4 MiB
  'embed': ((1024, 512), jnp.bfloat16),  # 1 MiB
  'codes': ((65536,), np.int8),  # 64 KiB
  'step': ((), np.int32),
}


def _restore_values() -> dict[str, np.ndarray]:
  """The saved values, identical in every process (one seeded generator)."""
  rng = np.random.default_rng(0)
  out = {}
  for name, (shape, dtype) in RESTORED.items():
    if np.issubdtype(dtype, np.integer):
      info = np.iinfo(dtype)
      out[name] = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    else:
      out[name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
  return out


def _bytes_read() -> int:
  """Bytes this process has read so far (its read/pread calls, all threads)."""
  for line in Path('/proc/self/io').read_text().splitlines():
    if line.startswith('rchar:'):
      return int(line.split()[1])
  raise RuntimeError('/proc/self/io has no rchar line')


def _restored_as_planned(ckpt: Path, target: dict, values: dict) -> tuple[dict, dict]:
  """Restores ``ckpt`` as ``target`` lays it out; what this process read,
  what the plan said it would, and whether every local shard is as saved."""
  # The smallest budget the reads can run under: here it lets one read of
  # 'embed' run at a time (see ``reads_alone``).
  budget = fsm.restore_plan(ckpt, target).min_budget_bytes
  plan = fsm.restore_plan(ckpt, target, host_budget=budget)
  if plan.problems or not plan.fits_budget:
    raise AssertionError(f'unexpected plan: {plan.problems} {plan.fits_budget}')
  me = jax.process_index()
  # A leaf's reads whose footprints orbax admits only one at a time. Reads of
  # one leaf meeting one saved chunk each fetch it when they run in turn (as
  # the plan counts); running together, they may share a fetch.
  alone = {
    path: group.limit is not None and group.limit < 2 * int(cost.footprint[me])
    for group in plan.groups
    for path, cost in group.items
  }
  before = _bytes_read()
  out = fsm.restore(ckpt, target, host_budget=budget)
  read = _bytes_read() - before
  same_sharding, same_values = {}, {}
  for name, want in target.items():
    got = out[name]
    same_sharding[name] = got.sharding == want.sharding
    same_values[name] = bool(got.addressable_shards) and all(
      _bit_identical(np.asarray(shard.data), values[name][shard.index])
      for shard in got.addressable_shards
    )
  return {
    'num_hosts': plan.num_hosts,
    'planned_read': plan.read_per_host[me],
    'measured_read': read,
    'read_per_host': list(plan.read_per_host),
    'needed_per_host': list(plan.needed_per_host),
    'staging_peak_per_host': list(plan.staging_peak_per_host),
    'host_budget': budget,
    'groups': [list(g) for g in plan.schedule],
    'reads_alone': alone,
    'same_sharding': same_sharding,
    'same_values': same_values,
  }, out


def _saved(tree: dict, where: Path) -> Path:
  """``tree`` saved with orbax at ``where`` by every process; its path."""
  where = where.resolve()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(where, tree)
    checkpointer.wait_until_finished()
  # Every process sees the finished checkpoint before any reads it.
  multihost_utils.sync_global_devices(f'saved {where.name}')
  return where


def _bit_identical(a: np.ndarray, b: np.ndarray) -> bool:
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def restore_round_trip(outdir: Path) -> dict:
  """Saved on 'data'=8, restored onto ('data' 2, 'model' 4) and back.

  Each process writes ``restore-<process index>.json``: per direction the
  bytes the plan says it reads, the bytes it read (``rchar``), and whether
  each leaf landed with the target's sharding and the saved values.
  """
  # Auto axes throughout: the shardings are placements, not sharding-in-types.
  flat = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  mesh = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Auto, AxisType.Auto)
  )
  values = _restore_values()

  def placed(spec_of) -> dict:
    return {name: NamedSharding(*spec_of(name)) for name in RESTORED}

  saved_on = placed(lambda name: (flat, P() if name == 'step' else P('data')))
  state = {
    name: jax.make_array_from_callback(
      v.shape, saved_on[name], lambda index, v=v: np.asarray(v[index])
    )
    for name, v in values.items()
  }
  ckpt = _saved(state, outdir / 'ckpt-restore')

  def structs(shardings: dict) -> dict:
    return {
      name: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[name])
      for name, v in values.items()
    }

  specs = {
    # Each process reads its half, one saved chunk per shard.
    'dense': P(('data', 'model'), None),
    # Each process reads its half, whole: its 4 shards meet the same saved
    # chunks (rows, all columns), each read fetches them.
    'embed': P('data', 'model'),
    # 'model' is within a process: each reads it all.
    'codes': P('model'),
    'step': P(),
  }
  onto_mesh = structs(placed(lambda name: (mesh, specs[name])))
  whole = fsm.restore_plan(ckpt, structs(placed(lambda name: (mesh, P()))))
  report = {
    'process_index': jax.process_index(),
    'process_count': jax.process_count(),
    'mesh_processes': [[d.process_index for d in row] for row in mesh.devices],
    # What one host reads to hold every leaf whole: the checkpoint as stored.
    'checkpoint_bytes': whole.read_per_host[0],
  }
  report['onto_mesh'], restored = _restored_as_planned(ckpt, onto_mesh, values)
  # The restored tree saved with its (2, 4) layouts, restored onto 'data'=8.
  again = _saved(restored, outdir / 'ckpt-restore-again')
  report['back'], _ = _restored_as_planned(again, structs(saved_on), values)
  name = f'restore-{jax.process_index()}.json'
  (outdir / name).write_text(json.dumps(report, indent=1))
  return report


def restore_checked(outdir: Path) -> dict:
  """Saved by ``fsm.save`` on 'data'=8 across the processes, restored onto
  ('data' 2, 'model' 4); then one process's data file damaged, and restored
  again: every process must raise, naming the leaf.

  Each process writes ``checked-<process index>.json``.
  """
  flat = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
  values = _restore_values()
  state = {
    name: jax.make_array_from_callback(
      v.shape,
      NamedSharding(flat, P() if name == 'step' else P('data')),
      lambda index, v=v: np.asarray(v[index]),
    )
    for name, v in values.items()
  }
  ckpt = Path(fsm.save(outdir / 'ckpt-checked', state))
  specs = {'dense': P(('data', 'model')), 'embed': P('data', 'model'),
           'codes': P('model'), 'step': P()}  # fmt: skip
  target = {
    name: jax.ShapeDtypeStruct(
      v.shape, v.dtype, sharding=NamedSharding(mesh, specs[name])
    )
    for name, v in values.items()
  }
  plan = fsm.restore_plan(ckpt, target)
  out = fsm.restore(ckpt, target)
  report = {
    'process_index': jax.process_index(),
    'checksums': json.loads((ckpt / '_FSM_CHECKSUMS.json').read_text()),
    'checked': list(plan.content_check.checked),
    'same_values': {
      name: all(
        _bit_identical(np.asarray(s.data), values[name][s.index])
        for s in out[name].addressable_shards
      )
      for name in values
    },
  }
  if jax.process_index() == 0:
    # Process 1's data file: its rows of 'dense' are held by process 1 alone
    # on the target mesh, so process 0 learns of them only through the sum.
    files = sorted(
      (ckpt / 'ocdbt.process_1' / 'd').iterdir(), key=lambda f: f.stat().st_size
    )
    data = bytearray(files[-1].read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
      data[i] ^= 0xFF
    files[-1].write_bytes(bytes(data))
  multihost_utils.sync_global_devices('damaged')
  try:
    fsm.restore(ckpt, target)
    report['damaged'] = None
  except fsm.CheckpointDamagedError as e:
    report['damaged'] = {'message': str(e), 'paths': [p.path for p in e.problems]}
  (outdir / f'checked-{jax.process_index()}.json').write_text(
    json.dumps(report, indent=1)
  )
  return report


SCENARIOS = {
  'restore-checked': restore_checked,
  'linen': linen,
  'linen-model-across-hosts': lambda out: linen(out, dcn='model'),
  'nnx': nnx_eager,
  'disagreeing-batch': disagreeing_batch,
  'restore': restore_round_trip,
}


if __name__ == '__main__':
  name, out = sys.argv[1], Path(sys.argv[2])
  out.mkdir(parents=True, exist_ok=True)
  SCENARIOS[name](out)
  print(f'process {jax.process_index()}: {name} done', flush=True)
