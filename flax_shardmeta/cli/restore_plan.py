"""``flax-shardmeta restore-plan``: restoring a checkpoint onto another mesh.

Reads the saved layout from an orbax checkpoint's metadata (not its arrays)
and plans restoring it as a model laid out on ``--mesh`` (an
``AbstractMesh`` with Auto axes, so the devices need not exist), by
``--rules``: what each host reads and needs, device memory during and after,
and, with ``--host-budget``, how leaves are restored in groups that fit it.

``--model NAME`` restores a built-in model's train state; ``--module
pkg.mod:factory`` your own, as ``plan`` builds it.

Exit codes: 0 the budget holds (or none was given), 1 it cannot be met or the
plan has problems, 2 bad arguments or a failing factory (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from flax_shardmeta.cli import checks, options, process, rule_files
from flax_shardmeta.cli.factory import CONTRACT, Factory
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
    type=int,
    metavar='N',
    help="with CKPT a CheckpointManager's root, the step (default: the latest)",
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
  options.add_output(p, table='a table of arrays and totals, or JSON', cache=False)


def run(args: argparse.Namespace) -> int:
  """The ``restore-plan`` subcommand; returns the exit code."""
  checks.check_model_name(args.model)
  checks.check_hbm(args.host_budget, '--host-budget')
  axis_names, axis_sizes = checks.parse_mesh(args.mesh)
  rules = rule_files.mesh_rules(args, axis_names)
  process.start_jax_quietly()
  factory = Factory.load(args.module) if args.module is not None else None

  # Heavy imports only once the arguments are known to be good.
  import jax
  from jax.sharding import AxisType

  import flax_shardmeta as fsm
  from flax_shardmeta._units import format_bytes
  from flax_shardmeta.cli.plan import user_state

  # Stated, not left to jax: its default changed from Auto to Explicit.
  mesh = jax.sharding.AbstractMesh(
    axis_sizes, axis_names, axis_types=(AxisType.Auto,) * len(axis_names)
  )
  if factory is None:
    dtype = rule_files.param_dtype(args)
    state = example_state.abstract_state(args.model, args.api, args.optimizer, dtype)
  else:
    state, _ = user_state(factory, mesh, rules, args.api, args.optimizer)
  # Laid out as plan lays it out: unannotated leaves (a step count) replicated.
  target = fsm.as_abstract(state, mesh, rules)
  result = fsm.restore_plan(
    args.checkpoint,
    target,
    host_budget=args.host_budget,
    # An abstract mesh has no processes: without the flag it is one host.
    devices_per_host=args.devices_per_host or math.prod(axis_sizes),
    step=args.step,
  )
  rule_files.note_default_rules(args)
  print(json.dumps(result.to_dict(), indent=1) if args.format == 'json' else result)
  if result.problems:
    print(
      f'flax-shardmeta restore-plan: {len(result.problems)} problem(s)',
      file=sys.stderr,
    )
    return 1
  if result.fits_budget is False:
    print(
      'flax-shardmeta restore-plan: no schedule fits --host-budget '
      f'{args.host_budget}; the smallest budget is '
      f'{format_bytes(result.min_budget_bytes)}',
      file=sys.stderr,
    )
    return 1
  return 0
