"""Command-line interface: ``flax-shardmeta plan``, ``fit``, ``suggest``, ``demo``.

``plan`` lays a model out on a mesh of any size without devices: the mesh is a
``jax.sharding.AbstractMesh`` and the model is only traced by
``jax.eval_shape``, so planning a 405B model for 4096 devices runs on a laptop.

``--module pkg.mod:factory`` plans your own model. The factory returns either

* ``(linen_module, *example_inputs)``: parameters come from
  ``linen_module.init(key, *example_inputs)['params']``, evaluated abstractly
  (inputs may be arrays or ``jax.ShapeDtypeStruct``); or
* a zero-argument function building the variables: with ``--api linen`` it
  returns a variables tree (its ``'params'`` entry is used when present); with
  ``--api nnx`` it returns an ``nnx.Module`` whose ``nnx.Param`` state is used.

The parameters are then planned with the optimizer state of ``--optimizer``
and the rules of ``--rules`` (T5X's by default for your own models).

Exit codes: 0 success, 1 the plan has problems (0 with ``--allow-problems``),
2 bad arguments or a failing factory (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flax_shardmeta import cli_common as common
from flax_shardmeta._errors import FlaxShardmetaError
from flax_shardmeta.cli_factory import CONTRACT, Factory
from flax_shardmeta.examples import state as example_state


def _parser() -> argparse.ArgumentParser:
  parser = common.Parser(
    prog='flax-shardmeta',
    description='Lay Flax models out on device meshes: plan a layout without '
    'devices, see whether a training step fits a TPU pod, search for the best '
    'layout, or run the demo on 8 simulated CPU devices.',
    formatter_class=common.HelpFormatter,
  )
  sub = parser.add_subparsers(
    dest='command',
    required=True,
    parser_class=common.Parser,
    metavar='{plan,fit,suggest,demo}',
  )
  demo = common.add_command(
    sub,
    'demo',
    help='plan, init and train a small model on 8 simulated devices, checking '
    'every sharding',
    description='Plan, initialize and train a small model on 8 simulated CPU '
    'devices, and check every array against the planned layout.',
  )
  demo.add_argument(
    '--steps',
    type=common.positive,
    default=5,
    metavar='N',
    help='training steps to run',
  )
  demo.add_argument(
    '--processes',
    type=int,
    default=1,
    metavar='N',
    help='run across N local processes (8/N CPU devices each) under '
    'jax.distributed, then compare with 1 process',
  )
  demo.add_argument('--out', type=Path, help=argparse.SUPPRESS)
  p = common.add_command(
    sub,
    'plan',
    help="show every array's layout, memory per device and problems",
    description='Lay a model out on a mesh without devices.',
    epilog=(__doc__ or '').split('\n\n', 2)[2] + '\n\n' + CONTRACT,
  )
  common.add_model_or_module(p, 'your own model (see below)')
  common.add_mesh(p, 'data=32,model=8')
  p.add_argument(
    '--axis-types',
    choices=('auto', 'explicit'),
    default='auto',
    help="the mesh axes' type (jax.sharding.AxisType); unreduced and reduced "
    'axes need explicit',
  )
  common.add_rules(p)
  p.add_argument(
    '--optimizer',
    choices=('adam', 'adafactor', 'none'),
    default='adam',
    help='optimizer state planned with the parameters',
  )
  common.add_front_end(p, api='the Flax front end', dtype='float32')
  p.add_argument(
    '--allow-problems',
    action='store_true',
    help='exit 0 even when the plan has problems',
  )
  p.add_argument(
    '--fit',
    action='store_true',
    help='replicate dimensions that cannot be sharded, and list them',
  )
  p.add_argument(
    '--strict',
    action='store_true',
    help='a logical name no rule maps is a problem instead of being replicated',
  )
  common.add_output(p, table='a table grouped by module, or JSON', cache=False)
  from flax_shardmeta import cli_fit, cli_suggest

  cli_fit.add_parser(sub)
  cli_suggest.add_parser(sub)
  return parser


def _user_state(
  factory: Factory, mesh: Any, rules: Any, api: str, optimizer_name: str
) -> Any:
  """The abstract state of ``--module pkg.mod:factory`` (see the module doc)."""
  made = factory(mesh, rules)
  import jax
  from flax import linen as nn

  with factory.running():
    if isinstance(made, tuple) and made and isinstance(made[0], nn.Module):
      params = example_state.abstract_linen_params(made[0], *made[1:])
    elif callable(made) and api == 'nnx':
      from flax import nnx

      params = nnx.state(nnx.eval_shape(made), nnx.Param)
    elif callable(made):
      variables = jax.eval_shape(made)
      is_dict = isinstance(variables, dict) and 'params' in variables
      params = variables['params'] if is_dict else variables
    else:
      raise common.UsageError(
        f'--module {factory.target}: the factory returned {type(made).__name__}; '
        'expected (linen_module, *example_inputs) or a function with no '
        'arguments building the variables'
      )
  return example_state.abstract_train_state(params, optimizer_name)


def run_plan(args: argparse.Namespace) -> int:
  """The ``plan`` subcommand; returns the exit code."""
  common.check_model_name(args.model)
  axis_names, axis_sizes = common.parse_mesh(args.mesh)
  rules = common.command_rules(args)
  common.check_mesh_axis_names(args.mesh, axis_names, rules)
  factory = Factory.load(args.module) if args.module is not None else None

  # Heavy imports only once the arguments are known to be good.
  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType

  from flax_shardmeta._planning.plan import plan

  # Stated, not left to jax: its default changed from Auto to Explicit.
  kind = AxisType.Explicit if args.axis_types == 'explicit' else AxisType.Auto
  mesh = jax.sharding.AbstractMesh(
    axis_sizes, axis_names, axis_types=(kind,) * len(axis_names)
  )
  dtype = jnp.bfloat16 if args.dtype == 'bfloat16' else jnp.float32
  if factory is None:
    state = example_state.abstract_state(args.model, args.api, args.optimizer, dtype)
  else:
    state = _user_state(factory, mesh, rules, args.api, args.optimizer)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    result = plan(state, mesh, rules, fit=args.fit, strict=args.strict)
  from flax_shardmeta._errors import ShardingFitWarning

  for w in caught:
    # Fit-mode changes are part of the output below; no need to say them twice.
    if not issubclass(w.category, ShardingFitWarning):
      print(f'flax-shardmeta: warning: {w.message}', file=sys.stderr)
  if args.format == 'json':
    print(json.dumps(result.to_dict(), indent=1))
  else:
    print(result)
  if result.problems and not args.allow_problems:
    print(
      f'flax-shardmeta plan: {len(result.problems)} problem(s); fix them, '
      'pass --fit to replicate what cannot be sharded, or --allow-problems',
      file=sys.stderr,
    )
    return 1
  return 0


def run_demo(args: argparse.Namespace) -> int:
  """The ``demo`` subcommand: in this process, or across ``--processes``."""
  from flax_shardmeta._hosts import launch as _launch

  n = args.processes
  if n < 1 or 8 % n:
    raise common.UsageError(f'--processes {n}: use 1, 2, 4 or 8 (8 devices in all)')
  _, launched = _launch.initialize()  # a worker of a launch joins it here
  if launched == 1:
    _simulate_cpu_devices(8)
  from flax_shardmeta.examples import demo as demo_lib

  if n == 1 or launched > 1:
    return demo_lib.run(args.steps, out=args.out)
  import tempfile

  with tempfile.TemporaryDirectory(prefix='fsm-demo-') as tmp:
    print(
      f'launching {n} processes x {8 // n} CPU devices on 127.0.0.1 (gloo)', flush=True
    )
    try:
      results = _launch.launch(
        [
          '-m',
          'flax_shardmeta',
          'demo',
          '--steps',
          str(args.steps),
          '--out',
          str(Path(tmp) / 'multi'),
        ],
        num_processes=n,
        devices_per_process=8 // n,
        timeout=600,
      )
    except Exception as e:  # LaunchError: the message holds each stderr
      print(f'FAILED: {e}', file=sys.stderr)
      return 1
    # gloo reports each connection on stdout; the demo's own output is the rest.
    shown = [
      line
      for line in results[0].stdout.splitlines(keepends=True)
      if not line.startswith('[Gloo]')
    ]
    print(''.join(shown), end='', flush=True)
    print('same run in 1 process x 8 devices, for comparison ...', flush=True)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as single_out:
      code = demo_lib.run(args.steps, out=Path(tmp) / 'single')
    if code:
      print(single_out.getvalue())
      return code
    different = demo_lib.compare(Path(tmp) / 'single', Path(tmp) / 'multi')
  if different:
    print(f'FAILED: the {n}-process run differs from 1 process: {different}')
    return 1
  print(
    f'OK: same parameters as 1 process x 8 devices (rtol 1e-5), '
    f'from {n} processes x {8 // n} devices'
  )
  return 0


def _simulate_cpu_devices(n: int) -> None:
  """Asks jax for ``n`` CPU devices, if its backends have not started yet.

  ``python -m flax_shardmeta`` sets the XLA flag before jax is imported; the
  console script does not, but no backend exists until the first device
  query, so the config option still takes effect here.
  """
  import jax

  try:
    jax.config.update('jax_num_cpu_devices', n)
  except RuntimeError:
    pass  # already started (e.g. under pytest): use the devices that exist


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``flax-shardmeta`` and ``python -m flax_shardmeta``.

  Example:
    >>> main(['plan', '--model', 'mlp', '--mesh', 'data=0'])
    2
  """
  common.local_jax_on_cpu()
  args = None
  try:
    args = _parser().parse_args(argv)
    if args.command == 'demo':
      return run_demo(args)
    if args.command == 'fit':
      from flax_shardmeta import cli_fit

      return cli_fit.run(args)
    if args.command == 'suggest':
      from flax_shardmeta import cli_suggest

      return cli_suggest.run(args)
    return run_plan(args)
  except common.UsageError as e:
    shown = e.cause is not None and getattr(args, 'traceback', False)
    if shown:
      traceback.print_exception(e.cause)
    hint = ' (--traceback shows where)' if e.cause is not None and not shown else ''
    print(f'flax-shardmeta: error: {e}{hint}', file=sys.stderr)
    return 2
  except FlaxShardmetaError as e:  # a layout that cannot be, a topology unknown...
    print(f'flax-shardmeta: error: {e}', file=sys.stderr)
    return 2
  except SystemExit as e:  # --help
    return e.code if isinstance(e.code, int) else 0


if __name__ == '__main__':
  sys.exit(main())
