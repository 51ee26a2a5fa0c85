"""``flax-shardmeta audit``: what moving a step from Auto to Explicit axes takes.

Traces a training step written for Auto mesh axes on the same mesh with every
axis Explicit, and lists every operation jax refuses there (not only the
first), each at your own line, with jax's reason and the code that keeps
today's layout (XLA's under Auto). Then it compiles the step with every fix
applied and sets the Auto and Explicit programs side by side: collective
bytes per step by kind and axes, sharding annotations, transposes, memory.

* ``--model NAME`` audits a built-in model's step (written for Auto axes).
* ``--module PKG.MOD:FACTORY`` audits your own: the factory returns ``(step,
  *abstract_args)``, as for ``fit``.
* ``--topology`` compiles for a TPU pod or GPU cluster you do not have; without
  it the mesh is this machine's CPU, as many simulated devices as it has.

Exit codes: 0 no site to change, 1 sites to change (or the fixed step did not
compile), 2 bad arguments (a batch the mesh does not divide, say) or a failing
factory.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from flax_shardmeta.cli import checks, options, rule_files, step
from flax_shardmeta.cli.factory import CONTRACT, under
from flax_shardmeta.cli.options import UsageError

HELP = 'every site a step written for Auto axes must change for Explicit ones'
DESCRIPTION = (
  'Which operations of a training step written for Auto mesh axes does jax '
  'refuse under Explicit ones, and what keeps the layout of today? All of them, '
  'with the fixed step compiled beside the Auto one.'
)
EPILOG = (__doc__ or '').split('\n\n', 1)[1] + '\n\n' + CONTRACT


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The ``audit`` subcommand's options."""
  step.add_arguments(p, 'data=2,model=4 (without --topology: simulated CPU devices)')
  options.add_output(p, table='the sites and the two programs, or JSON', cache=False)


def run(args: argparse.Namespace) -> int:
  """The ``audit`` subcommand; returns the exit code."""
  if not args.topology:
    _simulate_devices(args.mesh)
  made = step.prepared(args)
  import jax

  import flax_shardmeta as fsm

  mesh = made.mesh
  if not args.topology:
    have, want = len(jax.devices()), math.prod(mesh.axis_sizes)
    if have < want:
      raise UsageError(
        f'--mesh {args.mesh}: {want} devices, and this process has {have} '
        '(jax started before the command could simulate them); give a mesh of '
        f'{have} devices or fewer, or --topology'
      )
    mesh = step.mesh(args, mesh.axis_names, mesh.axis_sizes, local=True)
  if made.factory is None:
    from flax_shardmeta.examples import train

    step_and_args: Any = train.train_step(args.model, mesh, **made.options)
    report = fsm.audit_explicit(*step_and_args, mesh=mesh, rules=made.rules)
  else:
    with under(mesh, made.rules), made.factory.running():
      step_and_args = made.factory.step_and_args(
        made.factory(mesh, made.rules, **made.options)
      )
      report = fsm.audit_explicit(*step_and_args, mesh=mesh, rules=made.rules)
  rule_files.note_default_rules(args)
  print(json.dumps(report.to_dict(), indent=1) if args.format == 'json' else report)
  return 0 if report.compiles and not report.sites else 1


def _simulate_devices(mesh_text: str) -> None:
  """As many CPU devices as the mesh has, set before jax starts."""
  import flax_shardmeta as fsm

  _, sizes = checks.parse_mesh(mesh_text)
  # Too late once jax's backends have started (the tests' process has its 8).
  fsm.simulate_cpu_devices(math.prod(sizes))
