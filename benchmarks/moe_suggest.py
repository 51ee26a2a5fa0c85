"""Expert degree x FSDP x capacity factor, ranked: ``fsm.suggest`` on the
built-in Mixtral-shaped MoE, on a TPU pod and on GPU nodes, beside the layout
a MaxText user gets by default.

The built-in ``mixtral-8x7b`` (its published shapes, 4 layers here; bf16
parameters, adamw, remat full, batch 1 x 2048 per chip) is ranked over the
presets ``fsdp`` (no expert parallelism), ``ep`` (the experts over an axis of
their own) and ``ep+fsdp`` (that axis shared with FSDP, as MaxText lays out
its MoE models), every split of the chips over their axes, and the capacity
factors 1.0, 1.25 and 2.0 (``knobs=``). Each target's table lists the
compiled candidates as suggest ranks them: memory per chip, the routing bytes
why() names, the parameters gathered, the roofline's step time, and the share
of tokens the factor drops at uniform routing.

In the same run, MaxText's default layout is compiled the same way:
``ici_fsdp_parallelism=-1`` (every chip FSDP) and no expert parallelism,
which is the ``fsdp`` preset over all the chips, at capacity factor 1.25.

Needs libtpu and jax's CUDA plugin (``pip install '.[tpu,gpu]'``). Usage:
``python benchmarks/moe_suggest.py [--no-write] [--max-candidates N]``;
compiled figures are cached, so a second run answers at once.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from _common import machine, machine_line, publish

TARGETS = ('v5p:4x4x8', 'h100:4x8')
PRESETS = ('fsdp', 'ep', 'ep+fsdp')
CAPACITY = (1.0, 1.25, 2.0)
DEFAULT_CAPACITY = 1.25
LAYERS, SEQ = 4, 2048


def _build(chips: int) -> Any:
  from flax_shardmeta.examples import train

  return train.builder('mixtral-8x7b', batch=chips, seq=SEQ, num_layers=LAYERS)


def _maxtext_default(topology: str, chips: int) -> Any:
  """``fsm.fit`` of MaxText's default: every chip FSDP, experts unsplit."""
  import jax

  import flax_shardmeta as fsm

  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = fsm.make_mesh((1, chips), ('data', 'fsdp'), topology=topology, axis_types=auto)
  rules = fsm.RULE_PRESETS['fsdp'].rules
  step, state, batch = _build(chips)(
    mesh, rules, 'full', capacity_factor=DEFAULT_CAPACITY
  )
  return fsm.fit(step, state, batch)


def _row(rank: str, label: str, report: Any, notes: str) -> str:
  import flax_shardmeta as fsm

  rows = report.collectives
  routing = sum(r.bytes for r in rows if r.reason == 'routing')
  gathered = sum(r.bytes for r in rows if r.reason == 'parameter')
  roofline = report.roofline
  step = f'{roofline.step_s * 1e3:,.1f} ms' if roofline else '-'
  tokens = (
    f'{SEQ / roofline.step_s:,.0f}' if roofline and roofline.step_s else '-'
  )  # one sequence per chip
  fits = {True: 'yes', False: 'no', None: '-'}[report.fits]
  found = 'yes' if any('expert-parallel' in n for n in report.notes) else 'no'
  return (
    f'| {rank} | {label} | {fsm.format_bytes(report.total_bytes)} | {fits} | '
    f'{fsm.format_bytes(int(routing))} | {fsm.format_bytes(int(gathered))} | '
    f'{step} | {tokens} | {notes} | {found} |'
  )


def _target(topology: str, max_candidates: int) -> list[str]:
  import flax_shardmeta as fsm
  from flax_shardmeta._devices.topology import topology_devices

  chips = len(topology_devices(topology))
  start = time.perf_counter()
  found = fsm.suggest(
    _build(chips),
    batch=chips,
    tokens_per_example=SEQ,
    topology=topology,
    presets=list(PRESETS),
    remat=['full'],
    knobs={'capacity_factor': list(CAPACITY)},
    max_candidates=max_candidates,
    progress=lambda line: print(line, file=sys.stderr),
  )
  searched = time.perf_counter() - start
  default = _maxtext_default(topology, chips)
  tried = len(found) + len(found.rejected) + len(found.skipped)
  cached = sum(1 for c in found if c.report is not None and c.report.cached)
  lines = [
    f'**{topology}** ({chips} chips): {tried} candidates, {len(found)} compiled '
    f'(suggest took {searched:,.0f} s, {cached} of them from the figure cache).',
    '',
    '| rank | layout | per chip | fits | routing | parameter gathers | '
    'step (roofline) | tokens/s/chip | capacity | not expert-parallel |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for k, c in enumerate(found, 1):
    notes = c.knob_notes.replace('of the routed tokens ', '')
    lines.append(_row(str(k), c.label, c.report, notes))
  lines.append(
    _row(
      'MaxText default',
      f'fsdp data=1 fsdp={chips}, remat full, capacity_factor={DEFAULT_CAPACITY}',
      default,
      _build(chips)
      .knob_notes(capacity_factor=DEFAULT_CAPACITY)
      .replace('of the routed tokens ', ''),
    )
  )
  best = found[0].report if found else None
  if best is not None and best.roofline and default.roofline:
    gain = default.roofline.step_s / best.roofline.step_s
    lines += [
      '',
      f"The first ranked runs a step {gain:.2f}x as fast as MaxText's default "
      f'layout by the roofline ({best.roofline.step_s * 1e3:,.1f} ms against '
      f'{default.roofline.step_s * 1e3:,.1f} ms).',
    ]
  print(f'{topology}: suggest {searched:.0f} s', file=sys.stderr)
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--no-write', action='store_true')
  parser.add_argument('--max-candidates', type=int, default=6)
  a = parser.parse_args()
  import flax_shardmeta as fsm

  fsm.cpu_only_jax()
  lines = [
    machine_line(machine()),
    f'Command: `python benchmarks/moe_suggest.py` (mixtral-8x7b shapes, {LAYERS} '
    f'layers, batch 1 x {SEQ} per chip, bf16 parameters, adamw, remat full; presets '
    f'{", ".join(PRESETS)}; capacity factors {", ".join(map(str, CAPACITY))}; '
    f'at most {a.max_candidates} compiled per target; Auto axes)',
    '',
  ]
  for topology in TARGETS:
    lines += _target(topology, a.max_candidates)
    lines.append('')
  lines += [
    'Routing and parameter gathers are bytes per chip per step, by the reason',
    "why() gives each collective; the capacity column is the build's note: the",
    'share of routed tokens a factor drops when the router spreads them evenly.',
    "MaxText's default (ici_fsdp_parallelism=-1) splits no expert: every chip",
    'gathers every expert of every layer, as FSDP gathers any weight.',
  ]
  publish(
    '## Mixture of experts: expert degree, FSDP and capacity ranked',
    lines,
    not a.no_write,
  )


if __name__ == '__main__':
  main()
