"""Plans of large trees against flax, on the same work, at three sizes.

``fsm.plan(tree, mesh, rules, strict=True).shardings()`` against flax's
``nn.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, rules)`` on
the same trees of 2,000, 20,000 and 200,000 annotated leaves (the patterns of
``speed.py``; fsm's boxes against flax's). Targets: at most 0.4x at 20,000 and
200,000 leaves, and fsm's time growing no faster than leaves^1.02 from 20,000
to 200,000. Not a target, for the whole picture: the same plan with every entry
read as well (``plan.entries``: paths, shard shapes, bytes).

Each pair runs alternately (A B A B ...) after a warm-up, in one process, with
the garbage collector on as in real use (every run starts from a collected
heap). Usage: ``python benchmarks/plan_speed.py [--repeats N] [--no-write]``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # libtpu (the tpu extra) stays quiet

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import alternate, machine, machine_line, publish  # noqa: E402
from speed import PATTERNS, RULES  # noqa: E402

import flax_shardmeta as fsm  # noqa: E402

SECTION = '## Speed: plans of large trees'
SIZES = (2_000, 20_000, 200_000)
TARGET_RATIO = 0.4
TARGET_EXPONENT = 1.02


def _tree(box, leaves: int) -> dict:
  """``leaves`` boxed ShapeDtypeStructs, the patterns of speed.py layer after layer."""
  return {
    f'layer_{i}': {
      f'w{j}': box(jax.ShapeDtypeStruct(shape, jnp.float32), names)
      for j, (shape, names) in enumerate(PATTERNS)
    }
    for i in range(leaves // len(PATTERNS))
  }


def case(leaves: int, repeats: int) -> dict[str, float]:
  mesh = jax.make_mesh((2, 4), ('data', 'model'))
  ours, theirs = (
    _tree(fsm.LogicalPartitioned, leaves),
    _tree(nn.LogicallyPartitioned, leaves),
  )
  # The same layouts, so the timing compares the same work.
  want = jax.tree.leaves(
    nn.logical_to_mesh_sharding(nn.get_partition_spec(theirs), mesh, RULES)
  )
  got = jax.tree.leaves(fsm.plan(ours, mesh, RULES, strict=True).shardings())
  assert want == got, 'layouts differ'
  return alternate(
    {
      'flax': lambda: nn.logical_to_mesh_sharding(
        nn.get_partition_spec(theirs), mesh, RULES
      ),
      'fsm': lambda: fsm.plan(ours, mesh, RULES, strict=True).shardings(),
      'fsm, every entry read': lambda: fsm.plan(ours, mesh, RULES, strict=True).entries,
    },
    repeats,
  )


def exponent(small: float, large: float, ratio: float) -> float:
  """How time grows with size: t ~ size^exponent between two sizes."""
  return math.log(large / small) / math.log(ratio)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--no-write', action='store_true')
  args = parser.parse_args()
  info = machine()
  results = {n: case(n, args.repeats) for n in SIZES}
  lines = [
    'Command: `python benchmarks/plan_speed.py` (medians of '
    f'{args.repeats} alternating runs after a warm-up, one process, garbage '
    'collector on).',
    '',
    'Work: `fsm.plan(tree, mesh, rules, strict=True).shardings()` against '
    "flax's `nn.logical_to_mesh_sharding(nn.get_partition_spec(tree), mesh, "
    'rules)` on the same trees (fsm boxes against flax boxes, the four '
    '`speed.py` patterns layer after layer, mesh (2, 4)); the layouts are '
    'checked equal first.',
    '',
    '| leaves | flax (s) | fsm (s) | ratio | target | fsm, every entry read (s) '
    '| its ratio |',
    '| --- | --- | --- | --- | --- | --- | --- |',
  ]
  ok = True
  for n, r in results.items():
    ratio = r['fsm'] / r['flax']
    target = f'<= {TARGET_RATIO}x' if n >= 20_000 else '-'
    if n >= 20_000:
      ok &= ratio <= TARGET_RATIO
    lines.append(
      f'| {n:,} | {r["flax"]:.4f} | {r["fsm"]:.4f} | {ratio:.2f}x | {target} '
      f'| {r["fsm, every entry read"]:.4f} '
      f'| {r["fsm, every entry read"] / r["flax"]:.2f}x |'
    )
  growth = []
  for (a, ra), (b, rb) in zip(list(results.items()), list(results.items())[1:]):
    growth.append((a, b, *(exponent(ra[k], rb[k], b / a) for k in ('flax', 'fsm'))))
  lines += [
    '',
    '| growth | flax exponent | fsm exponent | target |',
    '| --- | --- | --- | --- |',
  ]
  for a, b, e_flax, e_fsm in growth:
    target = f'<= {TARGET_EXPONENT}' if a == 20_000 else '-'
    if a == 20_000:
      ok &= e_fsm <= TARGET_EXPONENT
    lines.append(f'| {a:,} -> {b:,} | {e_flax:.2f} | {e_fsm:.2f} | {target} |')
  lines += [
    '',
    'Why: a plan finds its problems when it is made (only their leaves get '
    'paths) and makes everything else when first read: entries, their path '
    'strings, totals, replicated-dimension lines and explanations. `shardings()` comes '
    'straight from the cached layouts, so a plan costs about what '
    '`get_sharding` does. When every entry is read, all paths are made in '
    "one pass (jax's key types read through their one attribute, key tuples "
    'not kept), and the fields that do not depend on the path are shared per '
    "distinct layout. Python's cyclic garbage collector is paused while "
    'a tree is walked and entries are made (it would otherwise pass over the '
    'whole heap again and again as 200,000 objects are added to it: about 40% '
    'of the time at 200,000 leaves, and growth faster than linear).',
    '',
    machine_line(info),
  ]
  publish(SECTION, lines, write=not args.no_write)
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
