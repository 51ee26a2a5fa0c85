"""The built-in models, written for Auto axes, audited for Explicit ones on a v5p pod.

Each model's training step (``examples.train.train_step``: forward, backward
and the optimizer update) is audited by ``fsm.audit_explicit`` on a
``v5p:4x4x4`` topology (64 chips, compiled by libtpu on this machine) as
``data=16, model=4``: the sites it lists, their fixes, and the Auto and
Explicit programs side by side. Recorded in BENCHMARKS.md with the command and
the machine.

Usage: ``python benchmarks/explicit_audit.py [--no-write]`` (needs the ``tpu``
extra; about ten minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from _common import machine, machine_line, write_section  # noqa: E402

SECTION = '## Explicit axes: the built-in models audited for a v5p pod'
TOPOLOGY, MESH = 'v5p:4x4x4', (16, 4)
MODELS = (('mlp', 'linen'), ('llama3-8b', 'linen'), ('llama3-8b', 'nnx'))
STEP = {'batch': 64, 'seq': 2048}


def audit(name: str, api: str) -> tuple[object, float]:
  import jax

  import flax_shardmeta as fsm
  from flax_shardmeta.examples import train

  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = fsm.make_mesh(MESH, ('data', 'model'), topology=TOPOLOGY, axis_types=auto)
  start = time.perf_counter()
  step, state, batch = train.train_step(name, mesh, api=api, **STEP)
  report = fsm.audit_explicit(step, state, batch, mesh=mesh)
  return report, time.perf_counter() - start


def section(results: list[tuple[str, str, object, float]], info: dict) -> str:
  from flax_shardmeta._specs import format_spec
  from flax_shardmeta._units import format_bytes

  lines = [
    f"Each built-in model's training step ({STEP['batch']} sequences of "
    f'{STEP["seq"]} tokens for Llama, 64 rows for the MLP; adamw; bfloat16 '
    f'parameters), written for Auto axes, audited by `fsm.audit_explicit` on '
    f'`{TOPOLOGY}` (64 chips, compiled by libtpu on this machine) as '
    f'`data={MESH[0]}, model={MESH[1]}`.',
    '',
    '| model | sites | operations refused | fixed step compiles | Explicit costs more '
    '| seconds |',
    '| --- | --- | --- | --- | --- | --- |',
  ]
  for name, api, r, seconds in results:
    refused = sum(s.count for s in r.sites)
    more = '; '.join(r.costs_more()) or 'nowhere (within 10%)'
    lines.append(
      f'| {name} ({api}) | {len(r.sites)} | {refused} | '
      f'{"yes" if r.compiles else "no: " + r.error} | {more} | {seconds:.0f} |'
    )
  for name, api, r, _ in results:
    lines += ['', f'**{name} ({api})**:', '']
    if not r.sites:
      lines.append('No site: the model is written for both axis types.')
    for i, s in enumerate(r.sites, 1):
      lines.append(
        f'{i}. `{s.where}` {s.op} (x{s.count}), layout {format_spec(s.spec)}'
        + ('' if s.from_auto else ' (replicated: XLA gave none)')
        + f': `{s.fix}`'
      )
    if r.explicit is None:
      continue
    lines += ['', '| per chip per step | Auto | Explicit |', '| --- | --- | --- |']
    a, e = r.auto, r.explicit
    for key in sorted(set(a.collectives) | set(e.collectives)):
      lines.append(
        f'| {key[0]} over {",".join(key[1]) or "-"} | '
        f'{format_bytes(a.collectives.get(key, 0))} | '
        f'{format_bytes(e.collectives.get(key, 0))} |'
      )
    lines += [
      f'| sharding annotations | {a.sharding_ops} | {e.sharding_ops} |',
      f'| transposes | {a.transposes} | {e.transposes} |',
      f'| memory | {format_bytes(a.memory)} | {format_bytes(e.memory)} |',
    ]
  lines += [
    '',
    'Command, from the repository root: `python benchmarks/explicit_audit.py`.',
    '',
    machine_line(info),
  ]
  return '\n'.join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--no-write', action='store_true')
  args = parser.parse_args()
  info = machine()
  results = []
  for name, api in MODELS:
    report, seconds = audit(name, api)
    print(f'{name} ({api}): {seconds:.0f} s', flush=True)
    print(report, flush=True)
    results.append((name, api, report, seconds))
  body = section(results, info)
  print(SECTION + '\n\n' + body)
  if not args.no_write:
    write_section(SECTION, body)
  return 0 if all(r.compiles for _, _, r, _ in results) else 1


if __name__ == '__main__':
  sys.exit(main())
