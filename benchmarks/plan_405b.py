"""Wall time and peak memory of planning llama3-405b for 4096 devices.

Runs ``python -m flax_shardmeta plan --model llama3-405b --mesh data=512,model=8
--format json`` in fresh processes (so Python and jax start-up count), takes
the median wall time of the runs and the largest peak RSS, and records them
with the machine in BENCHMARKS.md.

Where the time goes is measured too: a fresh process runs the command's steps
one by one (imports, building the abstract state, the plan, its JSON) and
times each.

Usage: ``python benchmarks/plan_405b.py [--runs 3] [--no-write]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import ROOT, machine, write_section

COMMAND = [
  sys.executable,
  '-m',
  'flax_shardmeta',
  'plan',
  '--model',
  'llama3-405b',
  '--mesh',
  'data=512,model=8',
  '--format',
  'json',
]
TARGET_SECONDS = 5.0
TARGET_RSS_GIB = 1.5
SECTION = '## Plan: llama3-405b on 4096 devices'


def run_once() -> tuple[float, float, int]:
  """One run: wall seconds, CPU seconds and peak RSS bytes of the child."""
  start = time.perf_counter()
  proc = subprocess.Popen(COMMAND, stdout=subprocess.DEVNULL, cwd=ROOT)
  # wait4 gives this child's own resource usage, not a running maximum.
  _, status, usage = os.wait4(proc.pid, 0)
  wall = time.perf_counter() - start
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode != 0:
    raise SystemExit(f'{" ".join(COMMAND)} exited with {proc.returncode}')
  cpu = usage.ru_utime + usage.ru_stime
  return wall, cpu, usage.ru_maxrss * 1024  # Linux reports KiB


PHASES_SCRIPT = """
import json, os, sys, time
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
t = [time.perf_counter()]
import jax, jax.numpy as jnp, flax.linen, optax
import flax_shardmeta.cli
from flax_shardmeta.examples import state as example_state
from flax_shardmeta._planning.sharding_plan import plan
t.append(time.perf_counter())
state = example_state.abstract_state('llama3-405b', 'linen', 'adam', jnp.float32)
t.append(time.perf_counter())
mesh = jax.sharding.AbstractMesh((512, 8), ('data', 'model'),
    axis_types=(jax.sharding.AxisType.Auto,) * 2)
result = plan(state, mesh, example_state.model_rules('llama3-405b'))
t.append(time.perf_counter())
text = json.dumps(result.to_dict(), indent=1)
t.append(time.perf_counter())
print(json.dumps([b - a for a, b in zip(t, t[1:])]))
"""
PHASES = (
  'imports (jax, flax, optax, the command line)',
  "building the abstract state (tracing the model's init and adam's under "
  '`jax.eval_shape`)',
  '`fsm.plan` (layouts, problems)',
  'the plan as JSON (entries, paths, bytes)',
)


def phases(runs: int) -> list[float]:
  """Median seconds of each step of the command, each run in a fresh process."""
  per_run = []
  for _ in range(runs):
    out = subprocess.run(
      [sys.executable, '-c', PHASES_SCRIPT],
      capture_output=True,
      text=True,
      check=True,
      cwd=ROOT,
    )
    per_run.append(json.loads(out.stdout.strip().splitlines()[-1]))
  return [statistics.median(col) for col in zip(*per_run)]


def python_startup() -> float:
  """Seconds a bare ``python -c pass`` takes here."""
  start = time.perf_counter()
  subprocess.run([sys.executable, '-c', 'pass'], check=True)
  return time.perf_counter() - start


def report(
  walls: list[float],
  cpus: list[float],
  rss: list[int],
  info: dict[str, str],
  steps: list[float],
) -> str:
  """The BENCHMARKS.md section."""
  median = statistics.median(walls)
  peak = max(rss) / 2**30
  ok = median < TARGET_SECONDS and peak < TARGET_RSS_GIB
  shown = ' '.join(c if c != sys.executable else 'python' for c in COMMAND)
  steps_python = python_startup()
  return '\n'.join(
    [
      SECTION,
      '',
      f'Command (run {len(walls)} times in fresh processes, from the repository root):',
      '',
      '```bash',
      shown,
      '```',
      '',
      '| measure | result | target |',
      '| --- | --- | --- |',
      f'| wall time, median of {len(walls)} (incl. Python start-up) | '
      f'{median:.2f} s | < {TARGET_SECONDS:.1f} s |',
      f'| wall time, each run | {", ".join(f"{w:.2f} s" for w in walls)} | |',
      f'| CPU time (user + sys), median | {statistics.median(cpus):.2f} s | |',
      f'| peak RSS (largest run) | {peak:.3f} GiB ({max(rss) / 2**20:.0f} MiB) | '
      f'< {TARGET_RSS_GIB} GiB |',
      '',
      f'Result: {"within" if ok else "MISSES"} the targets.',
      '',
      'Where the time goes: the same steps run one by one in a fresh process '
      f'(median of {len(walls)}; Python start-up, about '
      f'{steps_python:.2f} s, comes before them):',
      '',
      '| step | seconds | share |',
      '| --- | --- | --- |',
      *(
        f'| {name} | {sec:.3f} | {sec / sum(steps):.1%} |'
        for name, sec in zip(PHASES, steps)
      ),
      '',
      "flax_shardmeta's own work is the last two rows: "
      f'{(steps[2] + steps[3]) / sum(steps):.1%} of the steps. Layouts are '
      'cached per distinct pattern, entries and explanations made when read; '
      'the rest is importing jax and flax and tracing the example model.',
      '',
      f'Machine: {info["nproc"]} CPUs ({info["cpu"]}); Python {info["python"]}, '
      f'jax {info["jax"]}, flax {info["flax"]}. Load average before the runs: '
      f'{info["load"]} (other processes share the CPUs; wall time grows with '
      'load, CPU time does not). Measured with `python benchmarks/plan_405b.py`.',
      '',
    ]
  )


def main() -> int:
  """Runs the benchmark; exit 1 when a target is missed."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--runs', type=int, default=3)
  parser.add_argument('--no-write', action='store_true')
  args = parser.parse_args()
  info = machine()  # before the runs, so the load average is theirs
  walls, cpus, rss = [], [], []
  for i in range(args.runs):
    wall, cpu, peak = run_once()
    walls.append(wall)
    cpus.append(cpu)
    rss.append(peak)
    print(
      f'run {i}: {wall:.2f} s wall, {cpu:.2f} s CPU, peak RSS {peak / 2**20:.0f} MiB'
    )
  section = report(walls, cpus, rss, info, phases(args.runs))
  if not args.no_write:
    write_section(SECTION, section[len(SECTION) :])
  print(section)
  return (
    0
    if statistics.median(walls) < TARGET_SECONDS and max(rss) < TARGET_RSS_GIB * 2**30
    else 1
  )


if __name__ == '__main__':
  sys.exit(main())
