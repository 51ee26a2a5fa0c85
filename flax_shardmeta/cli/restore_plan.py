"""``flax-shardmeta restore-plan``: restoring a checkpoint onto another mesh.

Reads the saved layout from an orbax checkpoint's metadata (not its arrays)
and plans restoring it as a model laid out on ``--mesh`` (an
``AbstractMesh`` with Auto axes, so the devices need not exist), by
``--rules``: what each host reads and needs, device memory during and after,
and, with ``--host-budget``, how leaves are restored in groups that fit it.

``--model NAME`` restores a built-in model's train state; ``--module
pkg.mod:factory`` your own: the factory returns the state restored as it is
(an abstract tree, boxes annotated), a function with no arguments building
it (``jax.eval_shape``; an NNX module gives its state), or ``(step, state,
*args)`` (the step's first argument is the state). Its annotated leaves are
laid out by ``--rules``, the others replicated.

Notes (a cast that keeps every value, a memory-kind change, with
``--partial`` saved leaves the target lacks, with ``--allow-cast`` a cast
that can lose values) are listed and do not fail the plan.

Exit codes: 0 the plan can be restored (notes at most) within the budget (or
none was given), 1 it has problems or the budget cannot be met, 2 bad
arguments or a failing factory (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from typing import Any

from flax_shardmeta.cli import checks, options, rule_files, step as step_lib
from flax_shardmeta.cli.factory import CONTRACT, Factory, built, made_kind
from flax_shardmeta.examples import state as example_state

HELP = 'what each host reads to restore a checkpoint onto another mesh'
DESCRIPTION = 'Plan restoring an orbax checkpoint onto a mesh, per host.'
EPILOG = (__doc__ or '').split('\n\n', 1)[1] + '\n\n' + CONTRACT


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The ``restore-plan`` subcommand's options."""
  p.add_argument(
    'checkpoint',
    metavar='CKPT',
    help="an orbax checkpoint directory, or a CheckpointManager's step folder or root",
  )
  p.add_argument(
    '--step',
    type=_step_number,
    metavar='N',
    help="with CKPT a CheckpointManager's root, the step (default: the latest); "
    'a step folder holds only its own',
  )
  options.add_model_or_module(p, 'your own model, as for plan')
  options.add_mesh(p, 'data=2,model=4')
  options.add_state(p, 'restored')
  p.add_argument(
    '--host-budget',
    metavar='SIZE',
    help='host memory for staging reads, e.g. 8GiB (default: none)',
  )
  p.add_argument(
    '--devices-per-host',
    type=options.positive,
    metavar='N',
    help='devices of the mesh per host (default: all on one host)',
  )
  p.add_argument(
    '--partial',
    action='store_true',
    help="restore the target's leaves of a checkpoint that has more "
    '(fsm.restore(..., partial=True))',
  )
  p.add_argument(
    '--allow-cast',
    action='store_true',
    help='allow target dtypes that can lose saved values, e.g. float32 into '
    'int8 (fsm.restore(..., allow_cast=True))',
  )
  p.add_argument(
    '--verbose',
    action='store_true',
    help='a row per array (default: a row per module, identical copies stacked)',
  )
  options.add_output(
    p,
    table='a table of modules (arrays with --verbose) and totals, or JSON',
    cache=False,
  )


def _step_number(text: str) -> int:
  """argparse ``type=`` for ``--step``: a step number, 0 or more."""
  try:
    value = int(text)
  except ValueError:
    value = -1
  if value < 0:
    raise argparse.ArgumentTypeError(
      f'expected a step number of 0 or more, got {text!r}'
    )
  return value


_PYTHON_NAMES = re.compile(r'\b(step|devices_per_host|host_budget)=(\S*)')


def _in_flag_names(error: Exception) -> Exception:
  """``error`` as the command line says it: ``--step 2``, not ``step=2``."""
  import flax_shardmeta as fsm

  def flag(m: re.Match[str]) -> str:
    name = '--' + m.group(1).replace('_', '-')
    return f'{name} {m.group(2)}' if m.group(2) else name

  if type(error) is not fsm.RestoreError:
    return error
  text = _PYTHON_NAMES.sub(flag, error.message)
  if text == error.message:
    return error
  return fsm.RestoreError(text, getattr(error, 'problems', ()))


def run(args: argparse.Namespace) -> int:
  """The ``restore-plan`` subcommand; returns the exit code."""
  checks.check_model_name(args.model)
  _check_budget(args.host_budget)
  axis_names, axis_sizes = checks.parse_mesh(args.mesh)
  rules = rule_files.mesh_rules(args, axis_names)
  factory = Factory.load(args.module) if args.module is not None else None

  # Heavy imports only once the arguments are known to be good.

  import flax_shardmeta as fsm

  mesh = step_lib.mesh(args, axis_names, axis_sizes)
  if factory is None:
    dtype = rule_files.param_dtype(args)
    state = example_state.abstract_state(args.model, args.api, args.optimizer, dtype)
  else:
    state = restored_state(factory, mesh, rules, args.api, args.optimizer)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    try:
      result = fsm.restore_plan(
        args.checkpoint,
        state,
        mesh=mesh,
        rules=rules,
        host_budget=args.host_budget,
        # An abstract mesh has no processes: without the flag it is one host.
        devices_per_host=args.devices_per_host or math.prod(axis_sizes),
        step=args.step,
        partial=args.partial,
        allow_cast=args.allow_cast,
        # Step counts replicated, as plan lays them out.
        replicate_unannotated=True,
      )
    except fsm.RestoreError as e:
      raise _in_flag_names(e) from None
  for w in caught:
    print(f'flax-shardmeta: warning: {w.message}', file=sys.stderr)
  rule_files.note_default_rules(args)
  if args.format == 'json':
    print(json.dumps(result.to_dict(), indent=1))
  else:
    print(result.format(verbose=args.verbose))
  if result.blocking:
    print(
      f'flax-shardmeta restore-plan: {len(result.blocking)} problem(s)',
      file=sys.stderr,
    )
    return 1
  if result.fits_budget is False:
    print(
      'flax-shardmeta restore-plan: no schedule fits --host-budget '
      f'{args.host_budget}; the smallest budget is '
      f'{fsm.format_bytes(result.min_budget_bytes)}',
      file=sys.stderr,
    )
    return 1
  return 0


def _check_budget(text: str | None) -> None:
  """``--host-budget``, when given, is a positive size."""
  import flax_shardmeta as fsm

  if text is None:
    return
  checks.check_hbm(text, '--host-budget')
  if fsm.parse_bytes(text) < 1:
    raise options.UsageError(
      f'--host-budget {text}: the host memory a restore may stage per host '
      "must be at least one byte; give a size such as '8GiB'"
    )


def restored_state(
  factory: Factory, mesh: Any, rules: Any, api: str, optimizer: str
) -> Any:
  """The state ``--module pkg.mod:factory`` restores, as it is (see the
  module doc): never re-wrapped as the parameters of a train state."""
  made = factory(mesh, rules)
  kind = made_kind(made)
  with factory.running():
    if kind == 'module':
      # A model and its inputs: its parameters and --optimizer's state, as plan.
      params = example_state.abstract_linen_params(made[0], *made[1:])
      return example_state.abstract_train_state(params, optimizer)
    if kind == 'step':
      if len(made) < 2:
        raise options.UsageError(
          f'--module {factory.target}: the factory returned a step without '
          'arguments; return (step, state, *args), the state restored, or a '
          'function building it'
        )
      return made[1]
    if kind == 'builder':
      return built(made, api)
  return made
