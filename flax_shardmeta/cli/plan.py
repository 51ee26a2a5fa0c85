"""``flax-shardmeta plan``: a model's layout on a mesh of any size, without devices.

``plan`` lays a model out on a mesh of any size without devices: the mesh is a
``jax.sharding.AbstractMesh`` and the model is only traced by
``jax.eval_shape``, so planning a 405B model for 4096 devices runs on a laptop.

``--module pkg.mod:factory`` plans your own model. The factory returns either

* ``(step, *abstract_args)``, as for ``fit`` and ``suggest``: the arguments
  that carry annotations (a train state from ``jax.eval_shape``, a boxed
  batch) are planned as they are, by the step's parameter names, their
  optimizer state included; the others are left to the step and named on
  stderr; or
* ``(linen_module, *example_inputs)``: parameters come from
  ``linen_module.init(key, *example_inputs)['params']``, evaluated abstractly
  (inputs may be arrays or ``jax.ShapeDtypeStruct``); or
* a zero-argument function building the variables: with ``--api linen`` it
  returns a variables tree (its ``'params'`` entry is used when present); with
  ``--api nnx`` it returns an ``nnx.Module`` whose ``nnx.Param`` state is used.

The parameters of the last two are planned with the optimizer state of
``--optimizer``. The rules are those of ``--rules`` (T5X's by default for your
own models, which stderr says).

Exit codes: 0 success, 1 the plan has problems (0 with ``--allow-problems``),
2 bad arguments or a failing factory (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from flax_shardmeta.cli import checks, options, rule_files, step as step_lib
from flax_shardmeta.cli.factory import CONTRACT, Factory, built, made_kind
from flax_shardmeta.examples import state as example_state

HELP = "show every array's layout, memory per device and problems"
DESCRIPTION = 'Lay a model out on a mesh without devices.'
EPILOG = (__doc__ or '').split('\n\n', 2)[2] + '\n\n' + CONTRACT


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The ``plan`` subcommand's options."""
  options.add_model_or_module(p, 'your own model (see below)')
  options.add_mesh(p, 'data=32,model=8')
  p.add_argument(
    '--axis-types',
    choices=('auto', 'explicit'),
    default='auto',
    help="the mesh axes' type (jax.sharding.AxisType); unreduced and reduced "
    'axes need explicit',
  )
  options.add_state(p, 'planned')
  p.add_argument(
    '--allow-problems',
    action='store_true',
    help='exit 0 even when the plan has problems',
  )
  p.add_argument(
    '--replicate-indivisible',
    '--fit',  # its former name, kept for one release
    dest='replicate_indivisible',
    action='store_true',
    help='replicate dimensions the mesh cannot divide, and list them',
  )
  p.add_argument(
    '--strict',
    action='store_true',
    help='a logical name no rule maps is a problem instead of being replicated',
  )
  options.add_output(p, table='a table grouped by module, or JSON', cache=False)


def run(args: argparse.Namespace) -> int:
  """The ``plan`` subcommand; returns the exit code."""
  checks.check_model_name(args.model)
  axis_names, axis_sizes = checks.parse_mesh(args.mesh)
  rules = rule_files.mesh_rules(args, axis_names)
  factory = Factory.load(args.module) if args.module is not None else None

  # Heavy imports only once the arguments are known to be good.

  import flax_shardmeta as fsm

  explicit = args.axis_types == 'explicit'
  mesh = step_lib.mesh(args, axis_names, axis_sizes, explicit=explicit)
  left_out: tuple[str, ...] = ()
  if factory is None:
    dtype = rule_files.param_dtype(args)
    state = example_state.abstract_state(args.model, args.api, args.optimizer, dtype)
  else:
    state, left_out = user_state(factory, mesh, rules, args.api, args.optimizer)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    result = fsm.plan(
      state,
      mesh,
      rules,
      replicate_indivisible=args.replicate_indivisible,
      strict=args.strict,
    )
  for w in caught:
    # Replicated dimensions are part of the output below; no need to say them
    # twice.
    if not issubclass(w.category, fsm.IndivisibleDimensionWarning):
      print(f'flax-shardmeta: warning: {w.message}', file=sys.stderr)
  rule_files.note_default_rules(args)
  if left_out:
    print(
      'flax-shardmeta: plan: arguments of the step without annotations, not '
      f'planned: {", ".join(left_out)}',
      file=sys.stderr,
    )
  if args.format == 'json':
    print(json.dumps(result.to_dict(), indent=1))
  else:
    print(result)
  if result.problems and not args.allow_problems:
    print(
      f'flax-shardmeta plan: {len(result.problems)} problem(s); fix them, '
      'pass --replicate-indivisible to replicate what the mesh cannot divide, '
      'or --allow-problems',
      file=sys.stderr,
    )
    return 1
  return 0


def user_state(
  factory: Factory, mesh: Any, rules: Any, api: str, optimizer_name: str
) -> tuple[Any, tuple[str, ...]]:
  """The abstract state of ``--module pkg.mod:factory`` (see the module doc),
  and the arguments of a step left out of it."""
  made = factory(mesh, rules)
  kind = made_kind(made)
  with factory.running():
    if kind == 'module':
      params = example_state.abstract_linen_params(made[0], *made[1:])
    elif kind == 'step':
      return _step_arguments(factory, made)
    elif kind == 'builder' and api == 'nnx':
      from flax import nnx

      params = built(made, api).filter(nnx.Param)
    elif kind == 'builder':
      variables = built(made, api)
      is_dict = isinstance(variables, dict) and 'params' in variables
      params = variables['params'] if is_dict else variables
    else:
      raise options.UsageError(
        f'--module {factory.target}: the factory returned {type(made).__name__}; '
        'expected (step, *abstract_args), (linen_module, *example_inputs) or a '
        'function with no arguments building the variables'
      )
  return example_state.abstract_train_state(params, optimizer_name), ()


def _step_arguments(
  factory: Factory, made: Any
) -> tuple[dict[str, Any], tuple[str, ...]]:
  """The annotated arguments of ``(step, *abstract_args)`` by the step's
  parameter names (``state/params/...``, as ``fit`` names them), and the names
  of the others."""
  import flax_shardmeta as fsm

  step, *args = made
  out, others = fsm.step_arguments(step, args)
  if not out:
    raise options.UsageError(
      f'--module {factory.target}: none of the arguments of the step it returned '
      f'({", ".join(others) or "none"}) carries annotations, so there is nothing '
      'to plan; annotate them (fsm.with_logical_partitioning, '
      'fsm.LogicalPartitioned) or see the layout with flax-shardmeta fit'
    )
  return out, others
