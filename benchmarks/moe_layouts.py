"""Experts gathered or tokens routed: the built-in Mixtral-shaped MoE, both
layouts side by side on a TPU pod and on GPU nodes.

The built-in ``mixtral-8x7b`` (its published shapes, 4 layers here; bf16
parameters, adamw, remat full, batch 1 x 2048 per chip) on a ``data x
expert`` mesh of Auto axes with the ``ep`` preset's rules (the experts over
``expert``, the batch over both axes), in two layouts of the routed tokens:

* **expert-parallel**: the rules name ``batch_no_exp`` (the ``ep`` preset
  does), so the routed tokens' expert dimension is laid out as the experts
  are: XLA moves tokens to the experts (why()'s ``routing`` rows) and each
  chip keeps its experts;
* **experts gathered**: the same rules without ``batch_no_exp``: the routed
  tokens stay on their batch shards and XLA gathers the experts to them
  (why() finds them not expert-parallel).

For each: memory per chip and the verdict, the bytes per chip per step by
why()'s reasons, and the roofline's step time. Needs libtpu and jax's CUDA
plugin (``pip install '.[tpu,gpu]'``). Usage: ``python
benchmarks/moe_layouts.py [--no-write]``; each configuration compiles once
unless the figure cache has it.
"""

from __future__ import annotations

import sys
import time

from _common import machine, machine_line, publish

CONFIGS = [('v5p:4x4x8', (16, 8)), ('h100:4x8', (4, 8))]
LAYERS, SEQ = 4, 2048
REASONS = ('routing', 'parameter', 'gradient', 'activation')


def _fit(topology: str, shape: tuple[int, int], routed: bool) -> tuple[object, float]:
  import jax

  import flax_shardmeta as fsm
  from flax_shardmeta.examples import moe, train

  auto = (jax.sharding.AxisType.Auto,) * 2
  mesh = fsm.make_mesh(shape, ('data', 'expert'), topology=topology, axis_types=auto)
  rules = [r for r in moe.MOE_RULES if routed or r[0] != 'batch_no_exp']
  chips = shape[0] * shape[1]
  step, state, batch = train.train_step(
    'mixtral-8x7b', mesh, rules=rules, batch=chips, seq=SEQ, remat='full',
    num_layers=LAYERS,
  )  # fmt: skip
  start = time.perf_counter()
  report = fsm.fit(step, state, batch)
  return report, time.perf_counter() - start


def main(write: bool) -> None:
  import flax_shardmeta as fsm

  fsm.cpu_only_jax()
  lines = [
    machine_line(machine()),
    f'Command: `python benchmarks/moe_layouts.py` (mixtral-8x7b shapes, {LAYERS} '
    f'layers, batch 1 x {SEQ} per chip, bf16 parameters, adamw, remat full; ep rules '
    'over data x expert, Auto axes)',
    '',
    '| target | mesh | layout | per chip | fits | routing | parameter gathers | '
    'gradients | activations | step (roofline) | not expert-parallel |',
    '|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for topology, shape in CONFIGS:
    for routed in (True, False):
      report, seconds = _fit(topology, shape, routed)
      r: object = report
      rows = r.collectives  # type: ignore[attr-defined]
      by = {k: sum(x.bytes for x in rows if x.reason == k) for k in REASONS}
      roofline = r.roofline  # type: ignore[attr-defined]
      step = f'{roofline.step_s * 1e3:,.1f} ms' if roofline else '-'
      found = 'yes' if 'not expert-parallel' in r.why() else 'no'  # type: ignore[attr-defined]
      layout = 'expert-parallel' if routed else 'experts gathered'
      lines.append(
        f'| {topology} | data={shape[0]} expert={shape[1]} | {layout} | '
        f'{fsm.format_bytes(r.total_bytes)} | '  # type: ignore[attr-defined]
        f'{"yes" if r.fits else "no"} | '  # type: ignore[attr-defined]
        + ' | '.join(fsm.format_bytes(int(by[k])) for k in REASONS)
        + f' | {step} | {found} |'
      )
      print(f'{topology} {layout}: fit {seconds:.0f} s', file=sys.stderr)
  lines += [
    '',
    'Bytes are per chip per step, by the reason why() gives each collective.',
    'Reading it:',
    '- Expert-parallel, each chip holds 1/8 of the experts and keeps them: none is',
    '  gathered, and their gradients are reduced over data alone. The tokens move',
    '  instead (routing). Experts gathered, each chip gathers every expert of every',
    '  layer for its own tokens (21 GiB per step here) and reduces their gradients',
    '  over expert as well as data; why() finds them not expert-parallel.',
    '- On v5p the expert-parallel step is the faster by the roofline; on h100 nodes',
    '  the two are close, the routing crossing the network between nodes.',
    "- XLA routes GShard's one-hot einsums with all-gathers: why()'s rows say an",
    '  all-to-all of the same tokens would move 1/16 (v5p, over data) to 1/8 (over',
    '  expert) of their bytes. A shard_map routing with all_to_all / ragged_all_to_all',
    '  is what would move only that.',
    "- A fit's seconds are the compile's, or the figure cache's where the same",
    '  program was compiled before.',
  ]
  publish('## Mixture of experts: experts gathered or tokens routed', lines, write)


if __name__ == '__main__':
  main(write='--no-write' not in sys.argv)
