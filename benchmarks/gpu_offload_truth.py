"""GPU truth for host offload: fit's device and host figures against a real
GPU's, with the optimizer state in ``pinned_host``.

The training step of ``gpu_truth.py`` (its small decoder-only transformer,
adamw) with the optimizer state kept in pinned host memory between steps:
moved to the GPU once the gradients are made, updated, moved back. Laid out
with ``fsm.in_host_memory`` (a compile-only topology keeps its memory kind).

* compile-only, in a subprocess with ``JAX_PLATFORMS=cpu``: ``fsm.fit`` on
  ``<gpu>:1x1``: its device total, its host figure per chip and its notes;
* on the GPU: the real compile's ``memory_analysis()`` (device and host
  fields), the allocator's ``peak_bytes_in_use`` after 3 donated steps, and
  the process's resident memory (``VmRSS``) before the state goes to the host
  and after the steps.

Output: ``DIR/gpu_offload_truth.json`` and ``DIR/gpu_offload_truth.md``.
Usage (this repository on ``PYTHONPATH``)::

  PYTHONPATH=. python benchmarks/gpu_offload_truth.py --out DIR   # one NVIDIA GPU
  PYTHONPATH=. python benchmarks/gpu_offload_truth.py --dry-run --out DIR  # no GPU

``python benchmarks/gpu_truth.py --offload --out DIR`` runs the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import gpu_truth as truth
from _common import xla_totals

BATCH = {'h100': 24, 'h200': 44}  # gpu_truth's smallest size of each card
STEPS = 3


def offload_step(m: truth.Model, mesh: Any) -> tuple[Any, Any, Any]:
  """The jitted step with the optimizer state in host memory, and the
  shardings of its state on the chip and on the host."""
  import jax
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import flax_shardmeta as fsm

  tx = truth.optimizer()
  rep = NamedSharding(mesh, P())
  params = jax.eval_shape(lambda k: truth.init_params(k, m), jax.random.key(0))
  opt = jax.eval_shape(tx.init, params)
  on_host = jax.tree.map(lambda _: fsm.in_host_memory(rep), opt)
  on_chip = fsm.in_device_memory(on_host)

  def step(params: Any, opt_state: Any, tokens: Any) -> tuple[Any, Any, Any]:
    loss, grads = jax.value_and_grad(truth.loss_fn)(params, tokens, m)
    opt_state = jax.device_put(opt_state, on_chip)  # for the update only
    updates, opt_state = tx.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    return new, jax.device_put(opt_state, on_host), loss

  jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=(rep, on_host, rep))
  return jitted, on_host, (params, opt)


def compile_only(gpu: str) -> dict[str, Any]:
  """fsm.fit of the offloading step on ``<gpu>:1x1``, compile-only."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import flax_shardmeta as fsm

  m = truth.MODEL
  mesh = fsm.make_mesh((1,), ('data',), topology=f'{gpu}:1x1')
  step, on_host, (params, opt) = offload_step(m, mesh)
  rep = NamedSharding(mesh, P())
  params = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), params
  )
  opt = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt, on_host
  )
  tokens = jax.ShapeDtypeStruct((BATCH[gpu], m.seq + 1), jnp.int32, sharding=rep)
  with jax.set_mesh(mesh):
    r = fsm.fit(step, params, opt, tokens, cache=False)
  return {
    'gpu': gpu,
    'batch': BATCH[gpu],
    'total_bytes': int(r.total_bytes),
    'host_bytes': int(r.host_bytes),
    'host_method': r.host.method if r.host else None,
    'memory_analysis': r.memory_analysis,
    'notes': [n for n in r.notes if 'host' in n or 'OFFLOAD' in n],
  }


def measure(gpu: str) -> dict[str, Any]:
  """The same step on this machine's GPU."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  m = truth.MODEL
  device = jax.devices()[0]
  mesh = jax.make_mesh((1,), ('data',), devices=[device])
  step, on_host, _ = offload_step(m, mesh)
  rep = NamedSharding(mesh, P())
  params = jax.jit(lambda k: truth.init_params(k, m), out_shardings=rep)(
    jax.random.key(0)
  )
  opt = jax.jit(truth.optimizer().init, out_shardings=rep)(params)
  tokens = jax.jit(
    lambda k: jax.random.randint(k, (BATCH[gpu], m.seq + 1), 0, m.vocab, jnp.int32),
    out_shardings=rep,
  )(jax.random.key(1))
  rss_before = _rss()
  opt = jax.block_until_ready(jax.device_put(opt, on_host))
  compiled = step.lower(params, opt, tokens).compile()
  analysis = compiled.memory_analysis()
  fields = {
    k: int(getattr(analysis, k)) for k in dir(analysis) if k.endswith('in_bytes')
  }
  for _ in range(STEPS):
    params, opt, loss = compiled(params, opt, tokens)
  jax.block_until_ready((params, opt, loss))
  stats = device.memory_stats() or {}
  kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(opt)}
  return {
    'device': device.device_kind,
    'memory_analysis': fields,
    'peak_bytes_in_use': int(stats.get('peak_bytes_in_use', 0)) or None,
    'rss_growth_bytes': _rss() - rss_before,
    'state_memory_kinds': sorted(str(k) for k in kinds),
    'loss': float(loss),
  }


def _rss() -> int:
  """This process's resident memory (``VmRSS``), in bytes."""
  for line in Path('/proc/self/status').read_text().splitlines():
    if line.startswith('VmRSS:'):
      return int(line.split()[1]) * 1024
  return 0


def markdown(record: dict[str, Any]) -> list[str]:
  """The result as lines for BENCHMARKS.md."""
  lines = [truth.machine_line(truth.machine()), '']
  for c in record.get('compile_only', []):
    lines.append(
      f'- {c["gpu"]}:1x1 compile-only, batch {c["batch"]}: fit device '
      f'{c["total_bytes"]:,} B, host {c["host_bytes"]:,} B per chip '
      f'({c["host_method"]})'
    )
    lines += [f'  - note: {n}' for n in c['notes']]
  real = record.get('gpu')
  if real and 'memory_analysis' in real:
    device, host = xla_totals(real['memory_analysis'])
    lines.append(
      f'- {real["device"]}: XLA device {device:,} B, host {host:,} B; '
      f'peak_bytes_in_use {real["peak_bytes_in_use"]}; RSS grew '
      f'{real["rss_growth_bytes"]:,} B; state in {real["state_memory_kinds"]}'
    )
  elif real:
    lines.append(f'- GPU run failed: {real.get("error")}')
  return lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', type=Path, default=Path('gpu_offload_truth_out'))
  parser.add_argument('--dry-run', action='store_true', help='compile-only, no GPU')
  parser.add_argument('--_compile-only', dest='compile_only', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.compile_only:
    os.environ['JAX_PLATFORMS'] = 'cpu'
    print(json.dumps(compile_only(args.compile_only)))
    return 0
  args.out.mkdir(parents=True, exist_ok=True)
  record: dict[str, Any] = {'compile_only': []}
  gpus = sorted(BATCH) if args.dry_run else [_this_gpu()]
  for gpu in gpus:  # each in its own process: the plugin needs JAX_PLATFORMS=cpu
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(truth.ROOT), *sys.path]))
    done = subprocess.run(
      [sys.executable, __file__, '--_compile-only', gpu],
      env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode:
      record['compile_only'].append({'gpu': gpu, 'error': done.stderr[-2000:]})
      continue
    record['compile_only'].append(json.loads(done.stdout.strip().splitlines()[-1]))
  if not args.dry_run:
    try:
      record['gpu'] = measure(gpus[0])
    except Exception as e:  # recorded: an out-of-memory is a result too
      record['gpu'] = {'error': f'{type(e).__name__}: {e}'[:2000]}
      record['traceback'] = traceback.format_exc()[-4000:]
  (args.out / 'gpu_offload_truth.json').write_text(json.dumps(record, indent=1))
  text = '\n'.join(markdown(record)) + '\n'
  (args.out / 'gpu_offload_truth.md').write_text(text)
  print(text)
  return 0


def _this_gpu() -> str:
  """``'h100'`` or ``'h200'``, from nvidia-smi's name of the GPU."""
  smi = truth.nvidia_smi() or {}
  name = str(smi.get('name', '')).lower()
  return 'h200' if 'h200' in name else 'h100'


if __name__ == '__main__':
  sys.exit(main())
