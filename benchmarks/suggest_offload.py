"""suggest with offload on the built-in Llama-3-8B, at a batch that does not
fit without help, beside the rule of thumb: the largest batch that fits with
remat full and no offload.

For v5p:4x4x8 (128 chips) and h100:4x8 (32 GPUs), fully sharded over one
``fsdp`` axis (Auto axes), sequences of 2048 tokens, bf16 parameters, adamw:

1. the rule of thumb (MaxText's first resort): the largest batch per chip
   whose step fits with ``remat='full'`` and no offload, found with ``fit``
   (the total grows linearly with the batch: two fits place it, two more
   check it);
2. ``fsm.suggest`` one batch per chip above it, over remat full and the
   offload presets none, activations and optimizer+activations: the ranked
   table with device memory, host memory and step time;
3. side by side: tokens/s/chip of the rule of thumb against the best that
   fits at the larger batch.

Needs libtpu and jax's CUDA plugin (``pip install '.[tpu,gpu]'``). Usage:
``python benchmarks/suggest_offload.py [--no-write]``. Compiles are cached
(``benchmarks/offload.py`` compiles the batch of 1 per chip).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from _common import machine, machine_line, publish

CONFIGS = [('v5p:4x4x8', 128), ('h100:4x8', 32)]
SEQ = 2048
RULES = [('batch', 'fsdp'), ('embed', 'fsdp')]
OFFLOADS = ['none', 'activations', 'optimizer+activations']


def _mesh(topology: str, chips: int) -> Any:
  import jax

  import flax_shardmeta as fsm

  auto = (jax.sharding.AxisType.Auto,)
  return fsm.make_mesh((chips,), ('fsdp',), topology=topology, axis_types=auto)


def _fit(topology: str, chips: int, per_chip: int) -> Any:
  import flax_shardmeta as fsm
  from flax_shardmeta.examples import train

  step, state, batch = train.train_step(
    'llama3-8b',
    _mesh(topology, chips),
    rules=RULES,
    batch=chips * per_chip,
    seq=SEQ,
    remat='full',
  )
  return fsm.fit(step, state, batch)


def rule_of_thumb(topology: str, chips: int) -> tuple[int, Any, list[str]]:
  """The largest batch per chip that fits with remat full and no offload,
  its report, and how it was found: from the line through the two nearest
  fits, refined until a batch fits and the next does not."""
  said: list[str] = []
  known = {1: _fit(topology, chips, 1), 2: _fit(topology, chips, 2)}
  for b in (1, 2):
    said.append(
      f'  - batch {b} per chip: {known[b].total_bytes:,} B, {known[b].verdict_words}'
    )
  b = _next_guess(known, 2)
  for _ in range(10):
    if b in known:
      break
    known[b] = r = _fit(topology, chips, b)
    said.append(f'  - batch {b} per chip: {r.total_bytes:,} B, {r.verdict_words}')
    if r.fits and b + 1 in known and not known[b + 1].fits:
      break
    if not r.fits and b - 1 in known and known[b - 1].fits:
      break
    guess = _next_guess(known, b)
    b = guess if guess not in known else (b + 1 if r.fits else b - 1)
  best = max((k for k, r in known.items() if r.fits), default=0)
  return best, known.get(best), said


def _next_guess(known: dict[int, Any], at: int) -> int:
  """Where the line through the fit at ``at`` and the nearest other one
  meets the limit."""
  other = min((k for k in known if k != at), key=lambda k: abs(k - at))
  a, b = known[other], known[at]
  slope = (b.total_bytes - a.total_bytes) / (at - other)
  limit = b.hbm_bytes
  return max(1, at + int((limit - b.total_bytes) // slope))


def main(write: bool) -> None:
  import flax_shardmeta as fsm
  from flax_shardmeta.examples import train

  fsm.cpu_only_jax()
  lines = [
    machine_line(machine()),
    f'Command: `python benchmarks/suggest_offload.py` (llama3-8b, sequences of {SEQ}, '
    'bf16 parameters, adamw, fsdp over every chip; Auto axes)',
    '',
  ]
  preset = fsm.RulePreset('fsdp', ('fsdp',), RULES, 'every chip on one fsdp axis')
  for topology, chips in CONFIGS:
    best, thumb, said = rule_of_thumb(topology, chips)
    lines += [f'- {topology}: the rule of thumb (remat full, no offload)', *said]
    larger = best + 1
    start = time.perf_counter()
    found = fsm.suggest(
      train.builder('llama3-8b', batch=chips * larger, seq=SEQ),
      batch=chips * larger,
      tokens_per_example=SEQ,
      topology=topology,
      presets=[preset],
      remat=['full'],
      offload=OFFLOADS,
      progress=False,
    )
    seconds = time.perf_counter() - start
    lines += [
      f'  - suggest at batch {larger} per chip ({chips * larger}), remat full, '
      f'offload {", ".join(OFFLOADS)}: {seconds:.0f} s',
      '',
      '```text',
      found.format(),
      '```',
      '',
    ]
    top = found.fitting[0] if found.fitting else None
    theirs = thumb.roofline.step_s if thumb is not None else None
    if top is not None and top.rank_s and theirs:
      ours = top.tokens_per_second_per_chip or 0
      thumb_tps = best * SEQ / theirs
      lines.append(
        f'  - side by side: rule of thumb batch {best} per chip, '
        f'{thumb_tps:,.0f} tokens/s/chip; suggest at batch {larger}: '
        f'{top.label}, {ours:,.0f} tokens/s/chip ({ours / thumb_tps:.2f}x)'
      )
    else:
      lines.append(
        f'  - nothing fits at batch {larger} per chip, with or without offload'
      )
    lines.append('')
  lines += [
    'Reading it:',
    '- Each offload is judged by the same compiled figures as fit: the chip, the',
    "  host's RAM and, where the host link's bandwidth is published (GPUs), the",
    '  transfers in the step time. On v5p that bandwidth is not published, so an',
    "  offload's transfers are given in bytes and not timed.",
    '- An offload that fits where the rule of thumb does not buys batch; whether',
    '  it buys throughput is the tokens/s/chip column.',
  ]
  publish('## suggest with offload: Llama-3-8B past the rule of thumb', lines, write)


if __name__ == '__main__':
  main(write='--no-write' not in sys.argv)
