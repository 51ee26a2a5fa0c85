"""``flax-shardmeta snapshot``: a training step's layout as JSON, for golden files.

Builds the step as ``fit`` does (the same ``--model`` / ``--module``, ``--mesh``,
``--topology`` and step options) and writes its snapshot: every parameter's,
optimizer state's and input's spec by path, the layout each sharding
constraint of the step asks for (with your line and the module scope), and
the collectives ``fit`` finds in the compiled step, with what each is for.
``flax-shardmeta diff OLD.json NEW.json`` says what changed between two.

* ``--model NAME`` uses a built-in model and its rules (Auto mesh axes).
* ``--module PKG.MOD:FACTORY`` uses your own step: the factory returns ``(step,
  *abstract_args)``, as for ``fit``.

Without ``--topology`` the mesh is an ``AbstractMesh`` (Auto axes): specs and
constraints are the same, and there are no collectives (nothing compiles).

Exit codes: 0 written, 2 bad arguments, a layout that cannot be, or a failing
factory (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from flax_shardmeta.cli import options, rule_files, step
from flax_shardmeta.cli.factory import CONTRACT, under

HELP = "write a training step's layout as JSON, to pin it in a golden file"
DESCRIPTION = (
  "A training step's layout as JSON: specs by path, sharding constraints and "
  'attributed collectives; compare two with flax-shardmeta diff.'
)
EPILOG = (__doc__ or '').split('\n\n', 1)[1] + '\n\n' + CONTRACT


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The ``snapshot`` subcommand's options: ``fit``'s step and mesh, ``--out``."""
  step.add_arguments(p, 'data=2,model=4')
  p.add_argument(
    '--out', metavar='FILE', help='where to write the JSON (default: stdout)'
  )
  p.add_argument(
    '--no-cache', action='store_true', help='compile even if the figures are cached'
  )
  p.add_argument(
    '--traceback', action='store_true', help='print the whole traceback of your factory'
  )


def run(args: argparse.Namespace) -> int:
  """The ``snapshot`` subcommand; returns the exit code."""
  for flag in ('hbm', 'mem_fraction', 'reserve'):
    if getattr(args, flag) is not None:
      name = '--' + flag.replace('_', '-')
      raise options.UsageError(
        f"{name}: snapshot records the step's collectives and judges no memory; "
        f'leave {name} out (fit takes it)'
      )
  made = step.prepared(args)
  text = json.dumps(_snapshot(args, made), indent=1, sort_keys=True)
  rule_files.note_default_rules(args)
  if args.out is None:
    print(text)
    return 0
  try:
    with open(args.out, 'w') as f:
      f.write(text + '\n')
  except OSError as e:
    raise options.UsageError(f'--out {args.out!r}: {e.strerror}') from None
  return 0


def _snapshot(args: argparse.Namespace, made: step.Prepared) -> dict[str, Any]:
  import flax_shardmeta as fsm
  from flax_shardmeta.examples import train

  cache = not args.no_cache
  mesh, rules, factory = made.mesh, made.rules, made.factory
  if factory is None:
    made_step = train.train_step(args.model, mesh, **made.options)
    return fsm.snapshot(*made_step, cache=cache)
  # A plain or jax.jit step reads its mesh and rules from the context, as in fit.
  with under(mesh, rules), factory.running():
    made_step = factory.step_and_args(factory(mesh, rules, **made.options))
    return fsm.snapshot(*made_step, cache=cache)
