"""GPU truth: fsm.fit's compile-only figures against a real GPU's.

fsm.fit judges a GPU program by compiling it for the project's description of
the GPU (``flax_shardmeta/_capacity/gpu_targets``) through jax's CUDA plugin,
compile-only. This check runs the same training step on a machine with one
NVIDIA GPU (an H100 or an H200) and compares, at three sizes of a small
decoder-only transformer (about 25%, 55% and 72% of the card's memory):

* the compile-only total (``report.total_bytes``), verdict and roofline step
  time, from ``fsm.fit`` on ``<gpu>:1x1`` in a subprocess with
  ``JAX_PLATFORMS=cpu`` (the plugin cannot start compile-only beside a real
  GPU backend);
* the real GPU compile's ``memory_analysis()``, added up as fit adds it
  (argument + output - alias + temporaries + generated code);
* ``peak_bytes_in_use`` of the device's allocator after 5 donated steps on
  random data, the median step time, and the memory the process holds outside
  the allocator's pool (nvidia-smi's used memory minus ``bytes_limit``).

At the largest size the measurement is repeated with autotuning off
(``--xla_gpu_autotune_level=0``) and with command buffers off
(``--xla_gpu_enable_command_buffer=``). Each measurement runs in its own
process (the allocator's peak is per process, and ``XLA_FLAGS`` is read when
the backend starts); an out-of-memory error is recorded as such, each process
has a timeout, and results are written as they come. Output:
``DIR/gpu_truth.json`` and ``DIR/gpu_truth.md`` (the table for BENCHMARKS.md).

The sizes (batch per GPU) were chosen by ``--sweep``: compile-only on
h100:1x1 and h200:1x1, the batch whose compiled total is closest below each
target share. ``--dry-run`` checks them again without a GPU.

Usage (needs jax, flax, optax, numpy and this repository on ``PYTHONPATH``)::

  PYTHONPATH=. python benchmarks/gpu_truth.py --out DIR   # one NVIDIA GPU
  PYTHONPATH=. python benchmarks/gpu_truth.py --dry-run --out DIR   # no GPU
  PYTHONPATH=. python benchmarks/gpu_truth.py --sweep   # choose the sizes
  PYTHONPATH=. python benchmarks/gpu_truth.py --offload --out DIR  # host offload
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from _common import machine, machine_line

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
TITLE = '## GPU truth: compile-only figures against a real GPU'


@dataclasses.dataclass(frozen=True)
class Model:
  """A decoder-only transformer: its layers stacked and scanned."""

  vocab: int = 32768
  d_model: int = 1024
  heads: int = 8
  d_ff: int = 4096
  layers: int = 4
  seq: int = 1024


MODEL = Model()
TARGETS = (0.25, 0.55, 0.72)
NAMES = ('small', 'medium', 'large')
# Sequences per step for each target share of the card's memory, from
# `--sweep`: the batch whose compile-only total (fsm.fit's total_bytes) is
# closest below the target on the project's description of the GPU.
SIZES = {
  'h100': ((0.25, 24), (0.55, 56), (0.72, 74)),  # 24.5%, 54.7%, 71.4%
  'h200': ((0.25, 44), (0.55, 101), (0.72, 133)),  # 24.5%, 55.0%, 71.8%
}
STEPS = 5
CONTROLS = (
  ('autotune off', '--xla_gpu_autotune_level=0'),
  ('command buffers off', '--xla_gpu_enable_command_buffer='),
)
# Seconds: the most one process may take, and the least worth starting one.
PROBE_TIMEOUT = 90
COMPILE_ONLY_TIMEOUT = 240
MEASURE_TIMEOUT = 150
MIN_START = 40
ENV_NAMES = (
  'XLA_FLAGS',
  'XLA_CLIENT_MEM_FRACTION',
  'XLA_PYTHON_CLIENT_MEM_FRACTION',
  'XLA_PYTHON_CLIENT_PREALLOCATE',
  'XLA_PYTHON_CLIENT_ALLOCATOR',
  'JAX_PLATFORMS',
  'CUDA_VISIBLE_DEVICES',
  'TF_GPU_ALLOCATOR',
)
PACKAGES = (
  'jax',
  'jaxlib',
  'jax-cuda13-plugin',
  'jax-cuda13-pjrt',
  'jax-cuda12-plugin',
  'jax-cuda12-pjrt',
  'flax',
  'optax',
  'numpy',
)


# The training step
# ------------------------------------------------------------------------------


def init_params(key: Any, m: Model) -> dict[str, Any]:
  """f32 parameters; the layers' stacked along a leading axis for the scan."""
  import jax
  import jax.numpy as jnp

  k = jax.random.split(key, 6)
  d, f, n = m.d_model, m.d_ff, m.layers

  def normal(key: Any, shape: tuple[int, ...], scale: float) -> Any:
    return jax.random.normal(key, shape, jnp.float32) * scale

  return {
    'embed': normal(k[0], (m.vocab, d), 0.02),
    'layers': {
      'ln1': jnp.ones((n, d), jnp.float32),
      'wqkv': normal(k[1], (n, d, 3 * d), d**-0.5),
      'wo': normal(k[2], (n, d, d), d**-0.5),
      'ln2': jnp.ones((n, d), jnp.float32),
      'w1': normal(k[3], (n, d, f), d**-0.5),
      'w2': normal(k[4], (n, f, d), f**-0.5),
    },
    'ln_f': jnp.ones((d,), jnp.float32),
    'unembed': normal(k[5], (d, m.vocab), d**-0.5),
  }


def loss_fn(params: dict[str, Any], tokens: Any, m: Model) -> Any:
  """Next-token cross-entropy; bf16 matmuls, f32 norms, softmax and loss."""
  import jax
  import jax.numpy as jnp

  bf16 = jnp.bfloat16
  head = m.d_model // m.heads

  def norm(x: Any, w: Any) -> Any:
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return (x * w).astype(bf16)

  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  b, s = inputs.shape
  causal = jnp.tril(jnp.ones((s, s), bool))

  def layer(x: Any, p: dict[str, Any]) -> tuple[Any, None]:
    qkv = (norm(x, p['ln1']) @ p['wqkv'].astype(bf16)).reshape(b, s, 3, m.heads, head)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k).astype(jnp.float32) * head**-0.5
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(bf16)
    attended = jnp.einsum('bhqk,bkhd->bqhd', probs, v).reshape(b, s, m.d_model)
    x = x + attended @ p['wo'].astype(bf16)
    hidden = jax.nn.gelu(norm(x, p['ln2']) @ p['w1'].astype(bf16))
    return x + hidden @ p['w2'].astype(bf16), None

  x = params['embed'][inputs].astype(bf16)
  x, _ = jax.lax.scan(layer, x, params['layers'])
  logits = (norm(x, params['ln_f']) @ params['unembed'].astype(bf16)).astype(
    jnp.float32
  )
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def optimizer() -> Any:
  import optax

  return optax.adamw(1e-4, weight_decay=0.1)


def train_step(m: Model) -> Any:
  """The jitted step: loss, gradients, adamw; parameters and optimizer state
  donated."""
  import jax
  import optax

  tx = optimizer()

  def step(params: Any, opt_state: Any, tokens: Any) -> tuple[Any, Any, Any]:
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, m)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def abstract_args(m: Model, batch: int, mesh: Any) -> tuple[Any, Any, Any]:
  """Parameters, optimizer state and batch as ``ShapeDtypeStruct`` on ``mesh``:
  the state replicated, the batch split over 'data'."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  replicated = NamedSharding(mesh, P())

  def placed(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)

  params = jax.eval_shape(lambda k: init_params(k, m), jax.random.key(0))
  opt_state = jax.eval_shape(optimizer().init, params)
  tokens = jax.ShapeDtypeStruct(
    (batch, m.seq + 1), jnp.int32, sharding=NamedSharding(mesh, P('data'))
  )
  return jax.tree.map(placed, params), jax.tree.map(placed, opt_state), tokens


def real_args(m: Model, batch: int, mesh: Any) -> tuple[Any, Any, Any]:
  """Random parameters, their optimizer state and random tokens, on the GPU."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  replicated = NamedSharding(mesh, P())
  key = jax.random.key(0)
  params = jax.jit(lambda k: init_params(k, m), out_shardings=replicated)(key)
  opt_state = jax.jit(optimizer().init, out_shardings=replicated)(params)
  tokens = jax.jit(
    lambda k: jax.random.randint(k, (batch, m.seq + 1), 0, m.vocab, jnp.int32),
    out_shardings=NamedSharding(mesh, P('data')),
  )(jax.random.key(1))
  return jax.block_until_ready((params, opt_state, tokens))


# Compile-only: fsm.fit on the project's description
# ------------------------------------------------------------------------------


def compile_only(
  gpu: str, batch: int, m: Model = MODEL, mem_fraction: float | None = None
) -> dict[str, Any]:
  """fsm.fit of the step on ``<gpu>:1x1``, compile-only (needs the CUDA plugin,
  started with ``JAX_PLATFORMS=cpu``), at the run's allocator fraction or
  ``mem_fraction``."""
  import jax

  import flax_shardmeta as fsm

  mesh = fsm.make_mesh((1,), ('data',), topology=f'{gpu}:1x1')
  args = abstract_args(m, batch, mesh)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    report = fsm.fit(train_step(m), *args, cache=False, mem_fraction=mem_fraction)
  seconds = time.perf_counter() - start
  usable = report.usable
  device = usable.device_bytes if usable else report.chip.hbm_bytes
  roof = report.roofline
  return {
    'gpu': gpu,
    'batch': batch,
    'seconds': round(seconds, 2),
    'total_bytes': int(report.total_bytes),
    'device_bytes': int(device),
    'share': report.total_bytes / device,
    'memory_analysis': report.memory_analysis,
    'usable': usable.to_dict() if usable else None,
    'fits': report.fits,
    'verdict': report.verdict_kind,
    'needed_fraction': report.needed_fraction,
    'plan': report.plan.to_dict() if report.plan else None,
    'flops': report.flops,
    'bytes_accessed': report.bytes_accessed,
    'notes': list(report.notes),
    'cublas_matmuls': bool(report.plan and report.plan.cublas_matmuls),
    'roofline': None
    if roof is None
    else {
      'step_s': roof.step_s,
      'compute_s': roof.compute_s,
      'memory_s': roof.memory_s,
      'collective_s': roof.collective_s,
    },
  }


def compile_only_sizes(gpu: str, out: Path | None = None) -> list[dict[str, Any]]:
  """The compile-only figures of each size of ``gpu``'s table, in order, then
  of the smallest at the two fractions around its need (:func:`boundary`,
  each with its ``mem_fraction``); written to ``out`` after each one."""
  rows: list[dict[str, Any]] = []

  def add(target: float, batch: int, fraction: float | None = None) -> None:
    try:
      row = compile_only(gpu, batch, mem_fraction=fraction)
    except Exception as e:  # recorded; the next size may still compile
      row = {'gpu': gpu, 'batch': batch, 'error': _error(e)}
    row['target'] = target
    if fraction is not None:
      row['mem_fraction'] = fraction
    rows.append(row)
    at = '' if fraction is None else f' at fraction {fraction:.2f}'
    print(
      f'{gpu} batch {batch:4d}{at}: target {target:.0%}, compile-only '
      + (f'{row["share"]:.1%} of the card' if 'share' in row else 'failed')
      + (f', {row["verdict"]}' if 'verdict' in row else ''),
      file=sys.stderr,
      flush=True,
    )
    if out is not None:
      _write_json(out, rows)

  for target, batch in SIZES[gpu]:
    add(target, batch)
  smallest = rows[0]
  if 'share' in smallest:
    for fraction in boundary(smallest['share']):
      add(smallest['target'], smallest['batch'], fraction)
  return rows


def boundary(share: float) -> tuple[float, float]:
  """Two allocator fractions around a step that needs ``share`` of the card:
  the largest hundredth at least 0.2% short of it, and the smallest at least
  0.2% above it; fit must say the first does not fit and the second does,
  and a run at each must agree.

  Example:
    >>> boundary(0.2345)
    (0.23, 0.24)
  """
  below = math.floor((share - 0.002) * 100) / 100
  above = math.ceil((share + 0.002) * 100) / 100
  return below, above


def sweep(gpu: str, m: Model = MODEL) -> list[tuple[float, int, float]]:
  """``(target, batch, share)``: for each target share, the batch whose
  compile-only total is closest below it.

  The total grows linearly with the batch (one scanned layer's activations
  per sequence), so two compiles give the slope; candidates around the
  predicted batch are then compiled to pick the largest below the target."""
  seen: dict[int, float] = {}

  def share(batch: int) -> float:
    if batch not in seen:
      seen[batch] = compile_only(gpu, batch, m)['share']
      print(f'  {gpu} batch {batch}: {seen[batch]:.2%}', file=sys.stderr, flush=True)
    return seen[batch]

  low, high = 8, 64
  slope = (share(high) - share(low)) / (high - low)
  base = share(low) - slope * low
  chosen = []
  for target in TARGETS:
    batch = max(int((target - base) / slope), 1)
    while share(batch) > target and batch > 1:
      batch -= 1
    while share(batch + 1) <= target:
      batch += 1
    chosen.append((target, batch, share(batch)))
  return chosen


# A real GPU: one measurement per process
# ------------------------------------------------------------------------------


def nvidia_smi() -> dict[str, Any] | None:
  """The GPU's used and total memory and each process's, as nvidia-smi says."""
  exe = shutil.which('nvidia-smi')
  if exe is None:
    return None

  def query(*flags: str) -> list[list[str]]:
    done = subprocess.run(
      [exe, *flags, '--format=csv,noheader,nounits'],
      capture_output=True,
      text=True,
      timeout=30,
    )
    if done.returncode:
      raise RuntimeError(done.stderr.strip() or done.stdout.strip())
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return [[cell.strip() for cell in line.split(',')] for line in lines]

  out: dict[str, Any] = {}
  try:
    gpus = query('--query-gpu=memory.used,memory.total,name,driver_version')
    used, total, name, driver = gpus[0]
    out.update(
      used_bytes=int(float(used)) << 20,
      total_bytes=int(float(total)) << 20,
      name=name,
      driver=driver,
      gpus=len(gpus),
    )
  except Exception as e:
    return {'error': _error(e)}
  with contextlib.suppress(Exception):  # the driver's own, where it says
    out['reserved_bytes'] = int(float(query('--query-gpu=memory.reserved')[0][0])) << 20
  with contextlib.suppress(Exception):
    apps = query('--query-compute-apps=pid,used_memory')
    out['processes'] = [
      {'pid': int(pid), 'used_bytes': int(float(used)) << 20}
      for pid, used in apps
      if pid.isdigit() and used.replace('.', '', 1).isdigit()
    ]
  return out


def outside_pool(smi: dict[str, Any] | None, stats: dict[str, int] | None) -> Any:
  """Bytes the process holds on the GPU outside the allocator's pool:
  nvidia-smi's used memory (the process's own where nvidia-smi lists it)
  minus ``bytes_limit``."""
  if not smi or 'used_bytes' not in smi or not stats or 'bytes_limit' not in stats:
    return None
  own = [p for p in smi.get('processes', ()) if p['pid'] == os.getpid()]
  used = own[0]['used_bytes'] if own else smi['used_bytes']
  return {
    'bytes': used - stats['bytes_limit'],
    'from': 'the process' if own else 'the whole GPU',
  }


def is_oom(e: BaseException) -> bool:
  text = str(e)
  return any(
    word in text
    for word in ('RESOURCE_EXHAUSTED', 'Out of memory', 'out of memory', 'OOM')
  )


def measure(spec: dict[str, Any], out: Path) -> int:
  """One measurement on the real GPU, written to ``out`` as it goes: a probe
  (what the GPU is, what an idle process holds), or a size's compile, steps
  and memory."""
  result: dict[str, Any] = {'spec': spec, 'stage': 'start', 'pid': os.getpid()}

  def stage(name: str) -> None:
    result['stage'] = name
    _write_json(out, result)

  try:
    _measure(spec, result, stage)
  except Exception as e:
    result['error'] = _error(e)
    result['traceback'] = traceback.format_exc()[-4000:]
    _write_json(out, result)
    return 1
  return 0


def _measure(spec: dict[str, Any], result: dict[str, Any], stage: Any) -> None:
  stage('backend')
  import jax
  from jax.sharding import AxisType

  device = jax.devices()[0]
  result.update(
    jax=jax.__version__,
    platform=device.platform,
    device_kind=device.device_kind,
    devices=len(jax.devices()),
    xla_flags=os.environ.get('XLA_FLAGS', ''),
  )
  result['stats_at_start'] = _stats(device)
  if device.platform != 'gpu':
    result['error'] = f'no GPU: jax runs on {device.platform}'
    stage('done')
    return
  if spec['kind'] == 'probe':
    from flax_shardmeta._devices.chips import chip_named

    chip = chip_named(device.device_kind)
    result['gpu'] = chip.name if chip is not None else None
    # The allocator takes its pool at the first allocation, not at start-up.
    jax.device_put(jax.numpy.zeros(256), device).block_until_ready()
    result['stats_after_one_array'] = _stats(device)
    smi = nvidia_smi()
    result['nvidia_smi'] = smi
    result['outside_pool'] = outside_pool(smi, result['stats_after_one_array'])
    stage('done')
    return
  m, batch = MODEL, spec['batch']
  mesh = jax.make_mesh((1,), ('data',), axis_types=(AxisType.Auto,))
  jitted = train_step(m)
  stage('compile')
  try:
    start = time.perf_counter()
    with jax.set_mesh(mesh):
      compiled = jitted.lower(*abstract_args(m, batch, mesh)).compile()
    result['compile_seconds'] = round(time.perf_counter() - start, 2)
    # Compiled before anything is allocated: autotuning's scratch buffers
    # stay below the step's peak.
    result['stats_after_compile'] = _stats(device)
    from flax_shardmeta._programs.memory import memory_fields, step_total

    memory = memory_fields(compiled)  # as fsm.fit reads and adds it up
    if memory is not None:
      result['real_compile'] = dict(memory, total_bytes=step_total(memory))
  except Exception as e:
    _failed(result, 'compile', e)
    _finish(result, device, stage)
    return
  stage('init')
  try:
    params, opt_state, tokens = real_args(m, batch, mesh)
    result['stats_after_init'] = _stats(device)
    stage('steps')
    times, losses = [], []
    for _ in range(STEPS):
      start = time.perf_counter()
      params, opt_state, loss = compiled(params, opt_state, tokens)
      jax.block_until_ready((params, opt_state, loss))
      times.append(time.perf_counter() - start)
      losses.append(float(loss))
      result['step_seconds'] = times
      result['losses'] = losses
      stage('steps')
    result['step_s'] = statistics.median(times)
    result['outcome'] = 'ran'
  except Exception as e:
    _failed(result, result['stage'], e)
    params = opt_state = tokens = None
  _finish(result, device, stage)


def _failed(result: dict[str, Any], where: str, e: BaseException) -> None:
  result['outcome'] = 'oom' if is_oom(e) else 'failed'
  result['failed_at'] = where
  result['error'] = _error(e)


def _finish(result: dict[str, Any], device: Any, stage: Any) -> None:
  stats = _stats(device)
  result['stats'] = stats
  result['peak_bytes_in_use'] = (stats or {}).get('peak_bytes_in_use')
  smi = nvidia_smi()
  result['nvidia_smi'] = smi
  result['outside_pool'] = outside_pool(smi, stats)
  stage('done')


def _stats(device: Any) -> dict[str, int] | None:
  try:
    stats = device.memory_stats()
  except Exception:
    return None
  return {k: int(v) for k, v in stats.items()} if stats else None


# Running the measurements
# ------------------------------------------------------------------------------


class Budget:
  """The seconds left of ``--time-budget``."""

  def __init__(self, seconds: float) -> None:
    self.end = time.monotonic() + seconds

  def left(self) -> float:
    return self.end - time.monotonic()


def _subprocess(
  argv: list[str], env: dict[str, str], timeout: float, result: Path
) -> dict[str, Any]:
  """Runs this script with ``argv``; what it wrote to ``result`` (partial when
  it was cut short), with its exit status and the end of its stderr."""
  start = time.perf_counter()
  try:
    done = subprocess.run(
      [sys.executable, str(Path(__file__).resolve()), *argv, '--_result', str(result)],
      env=env,
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=timeout,
    )
    status: dict[str, Any] = {'returncode': done.returncode, 'stderr': done.stderr}
  except subprocess.TimeoutExpired as e:
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or '')
    status = {'returncode': None, 'timed_out': timeout, 'stderr': err}
  status['stderr'] = status['stderr'][-3000:]
  status['seconds'] = round(time.perf_counter() - start, 2)
  found: Any = None
  with contextlib.suppress(OSError, ValueError):
    found = json.loads(result.read_text())
  return {'process': status, 'result': found}


def _env(**changes: str | None) -> dict[str, str]:
  env = dict(os.environ)
  path = [str(ROOT), *filter(None, env.get('PYTHONPATH', '').split(os.pathsep))]
  env['PYTHONPATH'] = os.pathsep.join(dict.fromkeys(path))
  for name, value in changes.items():
    if value is None:
      env.pop(name, None)
    else:
      env[name] = value
  return env


def _gpu_env(extra_flags: str = '', fraction: float | None = None) -> dict[str, str]:
  """A real GPU run: jax picks its platform; ``extra_flags`` added to
  ``XLA_FLAGS``; ``fraction``, the allocator's (under the variable name every
  jaxlib reads; both names at once are refused)."""
  flags = ' '.join(filter(None, [os.environ.get('XLA_FLAGS', ''), extra_flags]))
  env = _env(JAX_PLATFORMS=None, XLA_FLAGS=flags or None)
  if fraction is not None:
    env.pop('XLA_CLIENT_MEM_FRACTION', None)
    env['XLA_PYTHON_CLIENT_MEM_FRACTION'] = f'{fraction:.2f}'
  return env


def run_on_gpu(out: Path, budget_s: float) -> int:
  """The whole check on a machine with one NVIDIA GPU."""
  budget = Budget(budget_s)
  record = _header(dry_run=False)
  record['time_budget_s'] = budget_s
  scratch = Path(tempfile.mkdtemp(prefix='gpu-truth-'))

  def save() -> None:
    record['elapsed_s'] = round(budget_s - budget.left(), 1)
    _write_json(out / 'gpu_truth.json', record)
    (out / 'gpu_truth.md').write_text('\n'.join(markdown(record)) + '\n')

  def worker(
    name: str, spec: dict[str, Any], flags: str = '', fraction: float | None = None
  ) -> dict[str, Any]:
    timeout = min(
      PROBE_TIMEOUT if spec['kind'] == 'probe' else MEASURE_TIMEOUT,
      max(budget.left(), 1),
    )
    argv = ['--_measure', json.dumps(spec)]
    env = _gpu_env(flags, fraction)
    return _subprocess(argv, env, timeout, scratch / f'{name}.json')

  save()
  probe = worker('probe', {'kind': 'probe'})
  record['probe'] = probe
  found = probe['result'] or {}
  record['device_kind'] = found.get('device_kind')
  record['gpu_present'] = found.get('platform') == 'gpu'
  gpu = found.get('gpu') if found.get('gpu') in SIZES else None
  record['gpu'] = gpu
  if gpu is None:
    if found.get('error'):
      record['error'] = found['error']
    elif record['gpu_present']:
      kind = record['device_kind']
      record['error'] = f'no sizes for {kind!r}: only for {", ".join(SIZES)}'
    else:
      record['error'] = f'the probe failed: {probe["process"]["stderr"][-1000:]}'
    save()
    print(f'{record["error"]} (without a GPU: --dry-run)', file=sys.stderr)
    return 1
  entry: dict[str, Any] = {
    'sizes': [_row(n, t, b) for n, (t, b) in zip(NAMES, SIZES[gpu])],
    'controls': [],
  }
  record['gpus'] = {gpu: entry}
  largest = SIZES[gpu][-1]
  for label, flag in CONTROLS:
    row = _row(f'{NAMES[-1]}, {label}', *largest)
    entry['controls'].append(dict(row, xla_flags=flag))
  save()

  # Compile-only first: its process starts no GPU backend, and is done before
  # any measurement holds the GPU.
  compiled = _subprocess(
    ['--_compile-only', gpu],
    _env(JAX_PLATFORMS='cpu'),
    min(COMPILE_ONLY_TIMEOUT, max(budget.left() - MIN_START, 1)),
    scratch / 'compile_only.json',
  )
  record['compile_only_process'] = compiled['process']
  found_rows = compiled['result'] or []
  for row, found_row in zip(entry['sizes'], found_rows):
    row['compile_only'] = found_row
  for row in entry['controls']:
    row['compile_only'] = entry['sizes'][-1]['compile_only']
  entry['controls'] += _boundary_rows(found_rows)
  save()

  for i, row in enumerate([*entry['sizes'], *entry['controls']]):
    if budget.left() < MIN_START:
      row['status'] = 'skipped'
      row['why'] = f'the time budget ({budget_s:.0f} s) ran out'
      continue
    spec = {'kind': 'size', 'batch': row['batch'], 'label': row['label']}
    got = worker(f'run{i}', spec, row.get('xla_flags', ''), row.get('mem_fraction'))
    row['gpu'] = got['result']
    row['process'] = got['process']
    row['status'] = _status(got)
    save()
    print(f'{row["label"]}: {row["status"]}', file=sys.stderr, flush=True)
  save()
  shutil.rmtree(scratch, ignore_errors=True)
  print('\n'.join(markdown(record)))
  return 0


def _boundary_rows(found_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The control rows of the smallest size at the fractions around its need
  (the compile-only rows that carry a ``mem_fraction``)."""
  rows = []
  for found in found_rows:
    fraction = found.get('mem_fraction')
    if fraction is None:
      continue
    row = _row(f'{NAMES[0]}, fraction {fraction:.2f}', found['target'], found['batch'])
    rows.append(dict(row, mem_fraction=fraction, compile_only=found))
  return rows


def _status(got: dict[str, Any]) -> str:
  found = got['result'] or {}
  if found.get('outcome'):
    return found['outcome']
  if got['process'].get('timed_out'):
    return 'timed out'
  if is_oom(got['process']['stderr']) or is_oom(found.get('error', '')):
    return 'oom'
  return 'failed'


def _row(label: str, target: float, batch: int) -> dict[str, Any]:
  return {
    'label': label,
    'target': target,
    'batch': batch,
    'status': 'pending',
    'compile_only': None,
    'gpu': None,
  }


def run_dry(out: Path, gpus: list[str]) -> int:
  """The compile-only part, without a GPU."""
  record = _header(dry_run=True)
  record['gpu_present'] = False
  record['gpus'] = {}
  for gpu in gpus:
    rows = compile_only_sizes(gpu)
    entry = {
      'sizes': [
        dict(_row(n, t, b), compile_only=r, status='dry run')
        for n, (t, b), r in zip(NAMES, SIZES[gpu], rows)
      ],
      'controls': [dict(r, status='dry run') for r in _boundary_rows(rows)],
    }
    record['gpus'][gpu] = entry
  _write_json(out / 'gpu_truth.json', record)
  text = '\n'.join(markdown(record)) + '\n'
  (out / 'gpu_truth.md').write_text(text)
  print(text, end='')
  failed = [
    r
    for e in record['gpus'].values()
    for r in [*e['sizes'], *e['controls']]
    if 'error' in r['compile_only']
  ]
  return 1 if failed else 0


def run_sweep() -> int:
  lines = []
  for gpu in SIZES:
    chosen = sweep(gpu)
    pairs = ', '.join(f'({t}, {b})' for t, b, _ in chosen)
    shares = ', '.join(f'{s:.1%}' for *_, s in chosen)
    lines.append(f"  '{gpu}': ({pairs}),  # {shares}")
  print('SIZES = {\n' + '\n'.join(lines) + '\n}')
  return 0


# The record and its table
# ------------------------------------------------------------------------------


def _header(dry_run: bool) -> dict[str, Any]:
  versions = {}
  for name in PACKAGES:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      versions[name] = importlib.metadata.version(name)
  return {
    'title': TITLE,
    'dry_run': dry_run,
    'date': time.strftime('%Y-%m-%d %H:%M:%S %z'),
    'python': platform.python_version(),
    'jax': versions.get('jax'),
    'versions': versions,
    'env': {k: os.environ[k] for k in ENV_NAMES if k in os.environ},
    'cpus': os.cpu_count(),
    'machine': machine(),
    'model': dataclasses.asdict(MODEL),
    'steps': STEPS,
    'targets': list(TARGETS),
    'sizes_table': {k: [list(p) for p in v] for k, v in SIZES.items()},
  }


HEADER = (
  '| run | target share | batch | compile-only total | real compile total '
  '| measured peak | real compile vs compile-only | peak vs compile-only '
  '| peak vs real compile | fsm verdict | run on the GPU '
  '| outside the pool | step time measured | roofline |'
)


def markdown(record: dict[str, Any]) -> list[str]:
  """The table(s) for BENCHMARKS.md, one per GPU."""
  command = 'python benchmarks/gpu_truth.py' + ' --dry-run' * record['dry_run']
  lines = [
    TITLE,
    '',
    f'Command: `{command}` (on a machine with one NVIDIA GPU; `--dry-run`: '
    "compile-only, with jax's CUDA plugin and no GPU).",
    '',
  ]
  for gpu, entry in (record.get('gpus') or {}).items():
    lines += [f'{gpu.upper()} ({_kind(record, gpu)}):', '', HEADER]
    lines.append('|' + ' --- |' * HEADER.count(' | ') + ' --- |')
    for row in [*entry['sizes'], *entry['controls']]:
      lines.append(_table_row(row))
    lines.append('')
  lines += _notes(record)
  return lines


def _kind(record: dict[str, Any], gpu: str) -> str:
  if record.get('device_kind'):
    return record['device_kind']
  from flax_shardmeta._devices.chips import chip_named

  chip = chip_named(gpu)
  return f'compile-only, {chip.device_kind}' if chip else 'compile-only'


def _table_row(row: dict[str, Any]) -> str:
  co = row.get('compile_only') or {}
  gpu = row.get('gpu') or {}
  device = co.get('device_bytes')
  co_total = co.get('total_bytes')
  real = (gpu.get('real_compile') or {}).get('total_bytes')
  peak = gpu.get('peak_bytes_in_use') if gpu.get('stage') == 'done' else None
  outside = (gpu.get('outside_pool') or {}).get('bytes')
  roof = (co.get('roofline') or {}).get('step_s')
  verdict = co.get('verdict', 'failed' if 'error' in co else None)
  if verdict and co.get('usable'):
    verdict += f' at {co["usable"]["fraction"]:.2f}'
  if verdict and co.get('needed_fraction'):
    verdict += f' (needs {co["needed_fraction"]:.2f})'
  status = row.get('status')
  if status in ('pending', 'dry run'):
    status = None
  cells = [
    row['label'],
    f'{row["target"]:.0%}',
    str(row['batch']),
    _bytes(co_total, device),
    _bytes(real, device),
    _bytes(peak, device),
    _diff(real, co_total),
    _diff(peak, co_total),
    _diff(peak, real),
    verdict or '-',
    status or '-',
    '-' if outside is None else f'{outside / GIB:.2f} GiB',
    _seconds(gpu.get('step_s')),
    _seconds(roof),
  ]
  return '| ' + ' | '.join(cells) + ' |'


def _notes(record: dict[str, Any]) -> list[str]:
  lines = [
    f'Model: decoder-only transformer, {MODEL.layers} scanned layers, d_model '
    f'{MODEL.d_model}, {MODEL.heads} heads, d_ff {MODEL.d_ff}, vocabulary '
    f'{MODEL.vocab}, sequence {MODEL.seq}; f32 parameters, bf16 matmuls, adamw; '
    'parameters and optimizer state donated. Shares are of the memory CUDA '
    'reports (the description\'s device_memory_size). "compile-only": fsm.fit '
    'on `<gpu>:1x1` (matmuls as cuBLAS calls, the most memory autotuning can '
    'pick); "real compile": the GPU compile\'s memory_analysis() '
    'added up as fit adds it (argument + output - alias + temporaries + '
    'generated code); "measured peak": the allocator\'s peak_bytes_in_use '
    f'after {STEPS} donated steps on random data; "fsm verdict": fit\'s at the '
    "run's allocator fraction (jax's default 0.75 unless "
    'XLA_CLIENT_MEM_FRACTION is set); "outside the pool": nvidia-smi\'s used '
    "memory minus the allocator's bytes_limit; step time: the median of "
    f"{STEPS} steps, against fsm's roofline (report.roofline.step_s). The "
    'controls repeat the largest size with one XLA flag (their compile-only '
    "figures are the largest size's: a compile-only program is never "
    'autotuned), and the smallest at the two allocator fractions around its '
    'need (`XLA_PYTHON_CLIENT_MEM_FRACTION`), where fit must say "does not '
    'fit" at the lower and "fits" at the higher, and the run agree.',
  ]
  if record['dry_run']:
    lines += [
      '',
      'No GPU was present: compile-only figures only (`--dry-run`); "-" marks '
      'what needs a machine with one NVIDIA GPU.',
    ]
  probe = ((record.get('probe') or {}).get('result')) or {}
  limit = (probe.get('stats_at_start') or {}).get('bytes_limit')
  if limit:
    pools = [
      r['compile_only']['usable']['pool_bytes']
      for e in (record.get('gpus') or {}).values()
      for r in e['sizes']
      if (r.get('compile_only') or {}).get('usable')
    ]
    pool = f"; fsm's pool {pools[0] / GIB:.2f} GiB" if pools else ''
    idle = (probe.get('outside_pool') or {}).get('bytes')
    held = '' if idle is None else f'; outside the pool {idle / GIB:.2f} GiB'
    lines += [
      '',
      "An idle process (jax started, one small array): the allocator's "
      f'bytes_limit {limit / GIB:.2f} GiB{pool}{held}.',
    ]
  skipped = [
    r['label']
    for e in (record.get('gpus') or {}).values()
    for r in [*e['sizes'], *e['controls']]
    if r.get('status') == 'skipped'
  ]
  if skipped:
    lines += ['', f'Skipped (time budget): {"; ".join(skipped)}.']
  if record.get('error'):
    lines += ['', f'Error: {record["error"]}']
  lines += [
    '',
    f'{machine_line(record["machine"])} {record["date"]}.',
  ]
  return lines


def _bytes(value: int | None, device: int | None) -> str:
  if value is None:
    return '-'
  share = f' ({value / device:.1%})' if device else ''
  return f'{value / GIB:.2f} GiB{share}'


def _diff(value: int | None, reference: int | None) -> str:
  if value is None or not reference:
    return '-'
  return f'{(value - reference) / reference:+.1%}'


def _seconds(value: float | None) -> str:
  if value is None or not math.isfinite(value):
    return '-'
  return f'{value * 1e3:.0f} ms'


def _error(e: BaseException) -> str:
  text = ''.join(traceback.format_exception_only(type(e), e)).strip()
  return text[:2000]


def _write_json(path: Path, value: Any) -> None:
  """Written whole or not at all: a reader never sees half a file."""
  tmp = path.with_suffix(path.suffix + '.tmp')
  tmp.write_text(json.dumps(value, indent=1, default=str))
  os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', type=Path, default=Path('gpu_truth_out'))
  parser.add_argument(
    '--dry-run', action='store_true', help='compile-only, no GPU needed'
  )
  parser.add_argument(
    '--sweep', action='store_true', help='choose the sizes (compile-only)'
  )
  parser.add_argument(
    '--gpu',
    action='append',
    choices=sorted(SIZES),
    help='with --dry-run: the descriptions to check (default: all)',
  )
  parser.add_argument('--time-budget', type=float, default=420.0, metavar='SECONDS')
  parser.add_argument(
    '--offload',
    action='store_true',
    help='the host-offload check instead (gpu_offload_truth.py: optimizer state '
    'in pinned_host; with --dry-run, compile-only)',
  )
  parser.add_argument('--_measure', help=argparse.SUPPRESS)
  parser.add_argument('--_compile-only', dest='compile_only', help=argparse.SUPPRESS)
  parser.add_argument('--_result', type=Path, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.offload:
    import gpu_offload_truth

    return gpu_offload_truth.main(
      ['--out', str(args.out), *(['--dry-run'] if args.dry_run else [])]
    )
  if args._measure:
    return measure(json.loads(args._measure), args._result)
  if args.dry_run or args.sweep or args.compile_only:
    # The CUDA plugin gives compile-only devices only when jax's platform is
    # the CPU; set before jax is first imported.
    os.environ['JAX_PLATFORMS'] = 'cpu'
  if args.compile_only:
    compile_only_sizes(args.compile_only, args._result)
    return 0
  if args.sweep:
    return run_sweep()
  args.out.mkdir(parents=True, exist_ok=True)
  if args.dry_run:
    return run_dry(args.out, args.gpu or sorted(SIZES))
  return run_on_gpu(args.out, args.time_budget)


if __name__ == '__main__':
  sys.exit(main())
