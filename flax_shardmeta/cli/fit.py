"""``flax-shardmeta fit``: does a training step fit the pod, before the pod?

Builds a model's training step abstractly (forward, backward and the
optimizer update, the state donated) and compiles it for a TPU topology with
libtpu or a GPU cluster with jax's CUDA plugin (``--topology h100:4x8``: 4
nodes of 8 H100s; the trailing mesh axis stays inside a node), or estimates it
on an abstract mesh, then prints the per-chip report: memory by category, the
verdict against HBM, collectives per step with the link each uses (ici / dcn
on TPUs, nvlink / network on GPUs) and a roofline step time.

* ``--model NAME`` uses a built-in model and its rules (Auto mesh axes, as the
  built-in models are written for).
* ``--module PKG.MOD:FACTORY`` uses your own step: the factory returns ``(step,
  *abstract_args)``, the training step (a plain function, ``jax.jit`` or
  ``fsm.jit``) and its arguments as ``jax.eval_shape`` trees; annotated
  arguments are laid out by the rules, an argument that is itself a box (e.g.
  ``fsm.LogicalPartitioned(batch, ('batch', None))``) by its annotation. With
  ``--extrapolate`` it takes ``num_layers``, whose default is the depth
  reported on.

Without ``--topology`` the mesh is an ``AbstractMesh`` (Auto axes) and the
figures are an estimate (``--chip`` names the hardware for the verdict).

Exit codes: 0 the step fits (or no memory size is known), 1 it does not fit
(on GPUs: not at the run's allocator fraction), 2 bad arguments or a failing
factory (one line on stderr), 3 an estimate too close to the limit to call
without compiling.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flax_shardmeta.cli import checks, options, rule_files, step
from flax_shardmeta.cli.factory import CONTRACT, Factory, under
from flax_shardmeta.cli.options import UsageError

HELP = 'memory per chip, collectives and step time of a training step on a pod'
DESCRIPTION = (
  'Will a training step fit each chip? Compiled for a TPU topology (libtpu) or '
  'a GPU cluster (CUDA plugin), or estimated on an abstract mesh.'
)
EPILOG = (__doc__ or '').split('\n\n', 1)[1] + '\n\n' + CONTRACT


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The ``fit`` subcommand's options."""
  step.add_arguments(
    p, 'data=32,model=4 (their product is the number of devices of the topology)'
  )
  p.add_argument(
    '--chip',
    help='hardware figures when the mesh does not say, e.g. v5p, h100 '
    "(default: the devices' own)",
  )
  p.add_argument(
    '--offload',
    choices=('none', 'optimizer', 'activations', 'optimizer+activations'),
    help='what the step keeps in host memory (an fsm.OFFLOAD_PRESETS name): the '
    "optimizer state, each layer's input offloaded by the remat policy, or both; "
    'a --module factory gets it as offload= (default: none)',
  )
  p.add_argument(
    '--host-memory',
    metavar='SIZE',
    help='RAM of one host to judge what the step keeps in host memory against '
    '(pinned_host arguments, offloaded activations), e.g. 448GiB (default: the '
    "chip's machine type; unchecked for other devices)",
  )
  p.add_argument(
    '--extrapolate',
    action='store_true',
    help='compile 2 and 4 layers and extrapolate where the program grows with '
    'depth (layers unrolled) enough for that to be clearly faster; else (scanned '
    "layers) compile the whole model once; the report's notes say which",
  )
  p.add_argument(
    '--why',
    action='store_true',
    help='after the report, why each collective is there: the parameter, '
    'gradient or line of code behind it, and what looks unexpected',
  )
  p.add_argument(
    '--peak',
    action='store_true',
    help='after the report, what holds the peak: every byte per chip by '
    'parameter, optimizer slot, input, output, activation line, gradient, '
    'collective buffer and workspace, and where in the step the peak falls',
  )
  p.add_argument(
    '--against',
    metavar='REPORT.json',
    help='with --peak: compare with a report saved by --format json (another '
    'batch, remat, mesh or preset): what the change moved, row by row '
    '(default: none)',
  )
  options.add_output(p, table='a table of the per-chip report, or JSON', cache=True)


def run(args: argparse.Namespace) -> int:
  """The ``fit`` subcommand; returns the exit code."""
  before = _against(args)
  checks.check_hbm(args.host_memory, '--host-memory')
  made = step.prepared(args)
  fit_options = {
    'hbm': args.hbm,
    'chip': args.chip,
    'cache': not args.no_cache,
    **made.run_options,
    **({'host_memory': args.host_memory} if args.host_memory else {}),
  }
  if made.factory is None:
    report = _builtin(args, made, fit_options)
  else:
    report = _user(args, made.factory, made, fit_options)
  rule_files.note_default_rules(args)
  diff = before.diff(report.peak()) if before is not None else None
  if args.format == 'json':
    out = report.to_dict()
    if diff is not None:
      out['peak_against'] = {'file': args.against, **diff.to_dict()}
    print(json.dumps(out, indent=1))
  else:
    print(report)
    if args.why:
      print()
      print(report.why())
    if args.peak:
      print()
      print(report.peak())
    if diff is not None:
      print()
      print(f'{args.against} (before) against this step (after):')
      print(diff)
  if report.too_close_to_call:
    return TOO_CLOSE
  return 1 if report.fits is False else 0


TOO_CLOSE = 3
"""The exit code of an estimate within its measured error of the limit."""


def _against(args: argparse.Namespace) -> Any:
  """``--against``'s peak, read before anything is built."""
  if args.against is None:
    return None
  if not args.peak:
    raise UsageError('--against: goes with --peak (what holds the peak, compared)')
  try:
    with open(args.against) as f:
      data = json.load(f)
  except OSError as e:
    raise UsageError(f'--against: cannot read {args.against!r}: {e.strerror}') from None
  except ValueError as e:
    raise UsageError(f'--against: {args.against!r} holds no JSON: {e}') from None
  import flax_shardmeta as fsm

  peak = data.get('peak') if isinstance(data, dict) else None
  if not isinstance(peak, dict):
    raise UsageError(
      f'--against: {args.against!r} is no report with a peak; save one with '
      'flax-shardmeta fit ... --format json > REPORT.json'
    )
  try:
    return fsm.PeakMemory.from_dict(peak)
  except (KeyError, TypeError, ValueError) as e:
    raise UsageError(
      f'--against: {args.against!r}: its peak is unreadable ({e})'
    ) from None


def _builtin(args: argparse.Namespace, made: step.Prepared, fit_options: dict) -> Any:
  import flax_shardmeta as fsm
  from flax_shardmeta.examples import train

  def build(n: int | None = None) -> Any:
    return train.train_step(args.model, made.mesh, num_layers=n, **made.options)

  if not args.extrapolate:
    return fsm.fit(*build(), **fit_options)
  return fsm.fit(build, layers=train.num_layers(args.model), **fit_options)


def _user(
  args: argparse.Namespace,
  factory: Factory,
  made: step.Prepared,
  fit_options: dict,
) -> Any:
  import flax_shardmeta as fsm

  mesh, rules, kwargs = made.mesh, made.rules, made.options
  if args.extrapolate:
    factory.require('num_layers', '--extrapolate')
  # fit reads a plain or jax.jit step's mesh and rules from the context.
  with under(mesh, rules), factory.running():
    if args.extrapolate:
      layers = factory.default('num_layers')
      if not isinstance(layers, int):
        raise UsageError(
          f'--extrapolate: give num_layers of {factory} a default (the depth '
          'to report on)'
        )
      return fsm.fit(
        lambda n: factory.step_and_args(factory(mesh, rules, num_layers=n, **kwargs)),
        layers=layers,
        **fit_options,
      )
    return fsm.fit(
      *factory.step_and_args(factory(mesh, rules, **kwargs)), **fit_options
    )
