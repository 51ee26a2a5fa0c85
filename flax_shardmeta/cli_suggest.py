"""``flax-shardmeta suggest``: the best mesh, rules and remat for a model on a pod.

Splits the topology's chips over each rule preset's mesh axes, tries each remat
policy, rejects what cannot work from the plan alone (shapes that do not
divide, a state that cannot fit), compiles the most promising candidates with
libtpu and ranks them: those that fit first, then by estimated step time, then
by headroom. Built-in models use Auto mesh axes.

Presets: fsdp, fsdp+tp, tp, t5x-1d, t5x-2d, ep, or a TOML / JSON file of your
own (``[presets.NAME] axes = [...]; rules = [[name, target], ...]``).

Exit codes: 0 something fits, 1 nothing fits (the closest candidate and its
shortfall are printed), 2 bad arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(sub: Any, builtin_models: tuple[str, ...]) -> argparse.ArgumentParser:
  """Adds the ``suggest`` subcommand to the CLI's subparsers."""
  p = sub.add_parser(
    'suggest',
    help='search meshes, rule presets and remat for the best layout on a pod',
    description='Rank the layouts of a model on a TPU pod by what fits and how fast.',
    epilog=(__doc__ or '').split('\n\n', 1)[1],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument(
    '--model', required=True, help=f'a built-in model: {", ".join(builtin_models)}'
  )
  p.add_argument(
    '--topology',
    required=True,
    metavar='GEN:SHAPE',
    help="the TPU pod, e.g. v5p:4x4x8 (needs libtpu: the 'tpu' extra)",
  )
  p.add_argument(
    '--num-slices', type=int, default=1, help='slices of the topology (default: 1)'
  )
  p.add_argument('--batch', type=int, required=True, help='global batch size')
  p.add_argument(
    '--seq', type=int, default=2048, help='tokens per sequence (default: 2048)'
  )
  p.add_argument(
    '--presets',
    default='fsdp,fsdp+tp,tp',
    help='comma-separated preset names or a presets file (default: fsdp,fsdp+tp,tp)',
  )
  p.add_argument(
    '--remat',
    default='none,full',
    help='comma-separated remat policies (default: none,full)',
  )
  p.add_argument('--hbm', help='memory per chip to judge against, e.g. 95GiB')
  p.add_argument(
    '--max-candidates',
    type=int,
    default=8,
    help='compile at most this many (default: 8)',
  )
  p.add_argument('--top', type=int, default=5, help='rows to show (default: 5)')
  p.add_argument(
    '--optimizer',
    choices=('adamw', 'adam', 'adafactor', 'sgd'),
    default='adamw',
    help='optimizer of the step (default: adamw)',
  )
  p.add_argument('--api', choices=('linen', 'nnx'), default='linen')
  p.add_argument('--dtype', choices=('float32', 'bfloat16'), default='bfloat16')
  p.add_argument(
    '--no-cache', action='store_true', help='compile even if the figures are cached'
  )
  p.add_argument('--format', choices=('table', 'json'), default='table')
  return p


def run(args: argparse.Namespace, usage_error: type[Exception]) -> int:
  """The ``suggest`` subcommand; returns the exit code."""
  from flax_shardmeta.cli_fit import _quiet_libtpu

  for flag in ('batch', 'seq', 'num_slices', 'max_candidates', 'top'):
    value = getattr(args, flag)
    if value is not None and value < 1:
      raise usage_error(f'--{flag.replace("_", "-")} {value}: must be at least 1')
  remat = [r.strip() for r in args.remat.split(',') if r.strip()]
  unknown = [r for r in remat if r not in ('none', 'full', 'dots')]
  if unknown or not remat:
    raise usage_error(f'--remat {args.remat!r}: choose from none, full, dots')
  _quiet_libtpu()

  import jax.numpy as jnp

  import flax_shardmeta as fsm
  from flax_shardmeta._planning import presets as presets_lib
  from flax_shardmeta.examples import train

  presets: list[Any] = []
  for item in (x.strip() for x in args.presets.split(',') if x.strip()):
    if item in fsm.RULE_PRESETS:
      presets.append(item)
      continue
    try:
      with open(item) as f:
        presets += presets_lib.load(f.read(), item)
    except OSError as e:
      raise usage_error(
        f'--presets: {item!r} is neither a preset ({", ".join(fsm.RULE_PRESETS)}) '
        f'nor a readable file ({e.strerror})'
      ) from None
    except fsm.InvalidRulesError as e:
      raise usage_error(f'--presets: {e}') from None
  if args.hbm is not None:
    from flax_shardmeta._planning.chips import parse_bytes

    try:
      parse_bytes(args.hbm)
    except fsm.FitError as e:
      raise usage_error(f'--hbm: {e}') from None
  build = train.builder(
    args.model,
    batch=args.batch,
    seq=args.seq,
    api=args.api,
    optimizer_name=args.optimizer,
    dtype=jnp.bfloat16 if args.dtype == 'bfloat16' else jnp.float32,
  )
  try:
    found = fsm.suggest(
      build,
      batch=args.batch,
      tokens_per_example=1 if args.model == 'mlp' else args.seq,
      topology=args.topology,
      num_slices=args.num_slices,
      hbm=args.hbm,
      presets=presets,
      remat=remat,
      max_candidates=args.max_candidates,
      cache=not args.no_cache,
    )
  except (fsm.TopologyError, fsm.InvalidRulesError) as e:
    raise usage_error(str(e)) from None
  if args.format == 'json':
    print(json.dumps(found.to_dict(), indent=1))
  else:
    print(found.format(top=args.top))
    if found.fitting:
      print()
      print(found[0].explain())
  if not found.fitting:
    closest = found.closest
    if closest is not None and found.hbm_bytes is not None:
      from flax_shardmeta._planning.format import format_bytes

      short = (closest.total_bytes or 0) - found.hbm_bytes
      print(
        f'flax-shardmeta suggest: nothing fits; closest is {closest.label}, '
        f'{format_bytes(short)} over the HBM',
        file=sys.stderr,
      )
    return 1
  return 0
