"""``flax-shardmeta suggest``: the best mesh, rules, remat and offload for a
model on a pod.

Splits the topology's chips over each rule preset's mesh axes, tries each remat
policy (and with ``--offload``, each offload preset), rejects what cannot work
from the plan alone (shapes that do not divide, a state that cannot fit),
compiles the most promising candidates with libtpu (TPU pods) or jax's CUDA
plugin (GPU clusters, ``--topology h100:8x8``: tensor-parallel axes stay
inside a node) and ranks them: those that fit first, then by estimated step
time, then by headroom.

* ``--model NAME`` uses a built-in model (Auto mesh axes).
* ``--module PKG.MOD:FACTORY`` uses your own step: the factory returns ``(step,
  *abstract_args)`` as for ``fit`` and is called for each candidate, under its
  mesh and preset rules (first on an abstract mesh, for the plan). It gets the
  candidate's ``remat`` when it has that parameter (without one, only the
  factory's own layout is tried, shown as remat none), and its ``offload`` (an
  ``fsm.OffloadPreset``) when it has that parameter and ``--offload`` asks for
  one. A step not from
  ``fsm.jit`` is bound to the candidate's mesh and rules with ``fsm.jit``.
  Throughput counts ``--seq`` tokens per example (1 without ``--seq``).

Presets: fsdp, fsdp+tp, tp, t5x-1d, t5x-2d, ep, or a TOML / JSON file of your
own (``[presets.NAME] axes = [...]; rules = [[name, target], ...]``). Offload
presets: none, optimizer (optimizer state in host memory), activations (each
layer's input, ``decoder_layer_input``, offloaded by the remat policy),
optimizer+activations; an offload is judged by the chip's memory, the host's
RAM (``--host-memory``) and its step time with the transfers.

Exit codes: 0 something fits, 1 nothing fits (the closest candidate and its
shortfall are printed), 2 bad arguments or a failing factory (one line on
stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from flax_shardmeta.cli import checks, options, rule_files
from flax_shardmeta.cli.factory import CONTRACT, Factory

HELP = 'search meshes, rule presets and remat for the best layout on a pod'
DESCRIPTION = (
  'Rank the layouts of a model on a TPU pod or GPU cluster by what fits and how fast.'
)
EPILOG = (__doc__ or '').split('\n\n', 1)[1] + '\n\n' + CONTRACT


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The ``suggest`` subcommand's options."""
  options.add_model_or_module(p, 'your own step (see below)')
  options.add_pod(p, required=True)
  options.add_step(
    p,
    remat='comma-separated remat policies (default: none,full; for --module, '
    'none,full when the factory takes remat)',
    batch_required=True,
  )
  p.add_argument(
    '--presets',
    default='fsdp,fsdp+tp,tp',
    help='comma-separated preset names or a presets file',
  )
  p.add_argument(
    '--offload',
    default='none',
    help='comma-separated offload presets: none, optimizer, activations, '
    'optimizer+activations (default: none)',
  )
  p.add_argument(
    '--host-memory',
    metavar='SIZE',
    help='RAM of one host to judge offloads against, e.g. 448GiB (default: the '
    "chip's machine type)",
  )
  p.add_argument(
    '--max-candidates', type=int, default=8, help='compile at most this many'
  )
  p.add_argument('--top', type=int, default=5, help='rows to show')
  options.add_front_end(p, api="a built-in model's Flax front end", dtype='bfloat16')
  options.add_output(
    p, table='the ranked table and why the best wins, or JSON', cache=True
  )


def run(args: argparse.Namespace) -> int:
  """The ``suggest`` subcommand; returns the exit code."""
  checks.check_model_name(args.model)
  checks.require_positive(args, ('batch', 'seq', 'num_slices', 'max_candidates', 'top'))
  remat = [r.strip() for r in (args.remat or 'none,full').split(',') if r.strip()]
  checks.check_remat(args.remat, remat, builtin=args.model is not None)
  checks.check_gpu_run(args)
  checks.check_hbm(args.host_memory, '--host-memory')
  offload = _offloads(args.offload)
  if args.module is not None:
    factory = Factory.load(args.module)
    build = _user_build(factory, args)
    if args.remat is None and not factory.accepts('remat'):
      remat = ['none']  # the factory's own: nothing to choose from
    running: Any = factory.running()
  else:
    build = _builtin_build(args)
    running = contextlib.nullcontext()
  presets = _presets(args.presets)

  import flax_shardmeta as fsm
  from flax_shardmeta.examples import train

  seq = args.seq or (train.SEQ if args.module is None else 1)
  tokens = seq if args.module is not None else train.tokens_per_example(args.model, seq)
  with running:
    found = fsm.suggest(
      build,
      batch=args.batch,
      tokens_per_example=tokens,
      topology=args.topology,
      num_slices=args.num_slices,
      target_config=args.target_config,
      hbm=args.hbm,
      presets=presets,
      remat=remat,
      offload=offload,
      host_memory=args.host_memory,
      max_candidates=args.max_candidates,
      cache=not args.no_cache,
      **checks.gpu_run_options(args),
    )
  if args.format == 'json':
    print(json.dumps(found.to_dict(), indent=1))
  else:
    print(found.format(top=args.top))
    if found.fitting:
      print()
      print(found[0].compare())
  if not found.fitting:
    raised = found.fitting_with_fraction
    closest = found.closest
    report = closest.report if closest is not None else None
    if raised and raised[0].report is not None:
      print(
        "flax-shardmeta suggest: nothing fits at the run's fraction; best with a "
        f'raised one is {raised[0].label}: {raised[0].report.verdict_words}',
        file=sys.stderr,
      )
    elif closest is not None and report is not None and report.hbm_bytes is not None:
      what = 'the usable memory' if report.usable is not None else 'the HBM'
      short = (closest.total_bytes or 0) - report.hbm_bytes
      print(
        f'flax-shardmeta suggest: nothing fits; closest is {closest.label}, '
        f'{fsm.format_bytes(short)} over {what}',
        file=sys.stderr,
      )
    return 1
  return 0


def _builtin_build(args: argparse.Namespace) -> Any:
  from flax_shardmeta.examples import train

  return train.builder(
    args.model,
    batch=args.batch,
    seq=args.seq or train.SEQ,
    api=args.api,
    optimizer_name=args.optimizer,
    dtype=rule_files.param_dtype(args),
  )


def _user_build(factory: Factory, args: argparse.Namespace) -> Any:
  """``build(mesh, rules, remat)`` for ``fsm.suggest`` from your factory."""
  kwargs = factory.options(
    {
      'batch': (f'--batch {args.batch}', args.batch),
      'seq': (f'--seq {args.seq}', args.seq),
    }
  )
  if args.remat is not None:
    factory.require('remat', f'--remat {args.remat}')
  if args.offload != 'none':
    factory.require('offload', f'--offload {args.offload}')
  takes_remat = factory.accepts('remat')

  def build(mesh: Any, rules: Any, remat: str, offload: Any = None) -> tuple[Any, ...]:
    import flax_shardmeta as fsm

    extra: dict[str, Any] = {'remat': remat} if takes_remat else {}
    if offload is not None:
      extra['offload'] = offload
    step, *rest = factory.step_and_args(factory(mesh, rules, **kwargs, **extra))
    if getattr(step, 'mesh', None) is None:
      # suggest fits each candidate outside its mesh and rules: bind them, as
      # fit does for a step it runs under the mesh.
      step = fsm.jit(step, mesh=mesh, rules=rules)
    return (step, *rest)

  return build


def _offloads(text: str) -> list[str]:
  """``--offload``: offload preset names."""
  import flax_shardmeta as fsm

  names = [x.strip() for x in text.split(',') if x.strip()]
  unknown = [n for n in names if n not in fsm.OFFLOAD_PRESETS]
  if unknown or not names:
    raise options.UsageError(
      f'--offload {text!r}: choose from {", ".join(fsm.OFFLOAD_PRESETS)}'
    )
  return names


def _presets(text: str) -> list[Any]:
  """``--presets``: built-in names and presets files, in order."""
  import flax_shardmeta as fsm

  presets: list[Any] = []
  for item in (x.strip() for x in text.split(',') if x.strip()):
    if item in fsm.RULE_PRESETS:
      presets.append(item)
      continue
    try:
      with open(item) as f:
        content = f.read()
    except OSError as e:
      raise options.UsageError(
        f'--presets: {item!r} is neither a preset ({", ".join(fsm.RULE_PRESETS)}) '
        f'nor a readable file ({e.strerror})'
      ) from None
    try:
      presets += fsm.RulePreset.load(content, item)
    except fsm.InvalidRulesError as e:
      raise options.UsageError(f'--presets {item!r}: {e.message}') from None
  return presets
