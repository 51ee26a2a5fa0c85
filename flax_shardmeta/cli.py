"""Command-line interface: ``flax-shardmeta plan``, ``fit``, ``suggest``, ``demo``.

``plan`` lays a model out on a mesh of any size without devices: the mesh is a
``jax.sharding.AbstractMesh`` and the model is only traced by
``jax.eval_shape``, so planning a 405B model for 4096 devices runs on a laptop.

``--module pkg.mod:factory`` plans your own model. ``factory()`` is called
with no arguments and returns either

* ``(linen_module, *example_inputs)``: parameters come from
  ``linen_module.init(key, *example_inputs)['params']``, evaluated abstractly
  (inputs may be arrays or ``jax.ShapeDtypeStruct``); or
* a zero-argument function building the variables: with ``--api linen`` it
  returns a variables tree (its ``'params'`` entry is used when present); with
  ``--api nnx`` it returns an ``nnx.Module`` whose ``nnx.Param`` state is used.

The parameters are then planned with the optimizer state of ``--optimizer``
and the rules of ``--rules`` (T5X's by default for your own models).

Exit codes: 0 success, 1 the plan has problems (0 with ``--allow-problems``),
2 bad arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import sys
import tomllib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from flax_shardmeta.examples import state as example_state


class UsageError(Exception):
  """A bad command-line argument; reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
  """argparse, but errors raise instead of printing usage and exiting."""

  def error(self, message: str) -> NoReturn:
    raise UsageError(message)


class _HelpFormatter(
  argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter
):
  """Descriptions kept as written; every option's help ends with its default."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ''
    if 'default' in text or action.default in (None, argparse.SUPPRESS):
      return text  # said in the text, or required
    if action.nargs == 0:  # a flag
      return f'{text} (default: off)'
    return f'{text} (default: %(default)s)'


def _plain(text: str) -> str:
  """Docstring text as --help shows it: no reStructuredText markup."""
  return text.replace('``', '')


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f'expected a positive integer, got {text!r}')
  return value


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(
    prog='flax-shardmeta',
    description='Lay Flax models out on device meshes: plan a layout without '
    'devices, see whether a training step fits a TPU pod, search for the best '
    'layout, or run the demo on 8 simulated CPU devices.',
    formatter_class=_HelpFormatter,
  )
  sub = parser.add_subparsers(
    dest='command',
    required=True,
    parser_class=_Parser,
    metavar='{plan,fit,suggest,demo}',
  )
  demo = sub.add_parser(
    'demo',
    help='plan, init and train a small model on 8 simulated devices, checking '
    'every sharding',
    description='Plan, initialize and train a small model on 8 simulated CPU '
    'devices, and check every array against the planned layout.',
    formatter_class=_HelpFormatter,
  )
  demo.add_argument(
    '--steps', type=_positive, default=5, metavar='N', help='training steps to run'
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
  p = sub.add_parser(
    'plan',
    help="show every array's layout, memory per device and problems",
    description='Lay a model out on a mesh without devices.',
    epilog=_plain((__doc__ or '').split('\n\n', 2)[2]),
    formatter_class=_HelpFormatter,
  )
  which = p.add_mutually_exclusive_group(required=True)
  which.add_argument(
    '--model', help=f'a built-in model: {", ".join(example_state.MODEL_NAMES)}'
  )
  which.add_argument(
    '--module', metavar='PKG.MOD:FACTORY', help='your own model (see below)'
  )
  p.add_argument(
    '--mesh',
    required=True,
    metavar='AXIS=SIZE,...',
    help='mesh axes and sizes, e.g. data=32,model=8 (required)',
  )
  p.add_argument(
    '--axis-types',
    choices=('auto', 'explicit'),
    default='auto',
    help="the mesh axes' type (jax.sharding.AxisType); unreduced and reduced "
    'axes need explicit',
  )
  p.add_argument(
    '--api', choices=('linen', 'nnx'), default='linen', help='the Flax front end'
  )
  p.add_argument(
    '--rules',
    metavar='t5x|t5x-2d|JSON|FILE.json|FILE.toml',
    help='logical axis rules: a preset, an inline JSON list of [name, target] '
    "pairs or a file (default: the built-in model's own rules, t5x for --module)",
  )
  p.add_argument(
    '--optimizer',
    choices=('adam', 'adafactor', 'none'),
    default='adam',
    help='optimizer state planned with the parameters',
  )
  p.add_argument(
    '--dtype',
    choices=('float32', 'bfloat16'),
    default='float32',
    help="the parameters' dtype",
  )
  p.add_argument(
    '--format',
    choices=('table', 'json'),
    default='table',
    help='output: a table grouped by module, or JSON',
  )
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
  from flax_shardmeta import cli_fit, cli_suggest

  cli_fit.add_parser(sub, example_state.MODEL_NAMES)
  cli_suggest.add_parser(sub, example_state.MODEL_NAMES)
  return parser


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """``'data=32,model=8'`` -> ``(('data', 'model'), (32, 8))``.

  Raises:
    UsageError: for anything else, saying what was expected.

  Example:
    >>> parse_mesh('data=32,model=8')
    (('data', 'model'), (32, 8))
  """
  names: list[str] = []
  sizes: list[int] = []
  for item in text.split(','):
    name, eq, size = item.strip().partition('=')
    name, size = name.strip(), size.strip()
    if not eq or not name or not name.isidentifier():
      raise UsageError(
        f'malformed --mesh {text!r}: expected AXIS=SIZE pairs separated by '
        "commas, e.g. 'data=32,model=8'"
      )
    if name in names:
      raise UsageError(f'--mesh {text!r} names axis {name!r} twice')
    if not size.isdigit() or int(size) < 1:
      raise UsageError(
        f'--mesh {text!r}: size of {name!r} is {size!r}; sizes must be '
        'positive integers'
      )
    names.append(name)
    sizes.append(int(size))
  return tuple(names), tuple(sizes)


def load_rules(spec: str) -> tuple[tuple[str, Any], ...]:
  """Rules from ``t5x``, ``t5x-2d``, inline JSON or a JSON / TOML file.

  JSON: a list of ``[name, target]`` pairs, given inline (``'[["batch",
  "data"]]'``) or in a file. TOML: ``rules = [[name, target], ...]``. A target
  is a mesh axis, a list of mesh axes, or null for replicated; TOML has no
  null, so an empty list ``[]`` means replicated there (and in JSON too).

  Raises:
    UsageError: if the text or file does not hold valid rules.

  Example:
    >>> load_rules('[["batch", "data"], ["embed", null]]')
    (('batch', 'data'), ('embed', None))
  """
  if spec in ('t5x', 't5x-2d'):
    from flax_shardmeta._rules import standard_logical_axis_rules

    if spec == 't5x-2d':
      return standard_logical_axis_rules(1, 2)
    return standard_logical_axis_rules()
  if spec.lstrip().startswith('['):  # inline JSON: a file name never starts so
    try:
      data = json.loads(spec)
    except ValueError as e:
      raise UsageError(f'cannot parse --rules {spec!r} as JSON: {e}') from None
    return _rule_pairs(data, f'--rules {spec!r}')
  try:
    with open(spec, 'rb') as f:
      raw = f.read()
  except OSError as e:
    raise UsageError(f'cannot read rules file {spec!r}: {e.strerror}') from None
  try:
    if spec.endswith('.toml'):
      data = tomllib.loads(raw.decode()).get('rules')
    else:
      data = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise UsageError(f'cannot parse rules file {spec!r}: {e}') from None
  return _rule_pairs(data, f'rules file {spec!r}')


def _rule_pairs(data: Any, where: str) -> tuple[tuple[str, Any], ...]:
  if not isinstance(data, list):
    raise UsageError(
      f'{where} must hold a list of [name, target] pairs '
      '(TOML: rules = [[name, target], ...])'
    )
  # An empty list target means replicated, the only way to say None in TOML.
  pairs: Any = [
    (r[0], None if r[1] == [] else r[1]) if isinstance(r, list) and len(r) == 2 else r
    for r in data
  ]
  # The rule engine (and with it jax) only once the file has been read.
  from flax_shardmeta._rules import normalize_rules

  try:
    return normalize_rules(pairs)
  except ValueError as e:
    raise UsageError(f'{where}: {e}') from None


def _user_state(target: str, api: str, optimizer_name: str) -> Any:
  """The abstract state of ``--module pkg.mod:factory`` (see the module doc)."""
  module_name, colon, attr = target.partition(':')
  if not colon or not module_name or not attr:
    raise UsageError(f'--module {target!r}: expected PKG.MOD:FACTORY')
  # Like `python -m`, let a module next to the user be found.
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  try:
    factory = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError) as e:
    raise UsageError(f'--module {target!r}: {e}') from None
  import jax
  from flax import linen as nn

  made = factory()
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
    raise UsageError(
      f'--module {target!r}: the factory returned {type(made).__name__}; '
      'expected (linen_module, *example_inputs) or a function with no '
      'arguments building the variables'
    )
  return example_state.abstract_train_state(params, optimizer_name)


def _check_mesh_axis_names(
  text: str, axis_names: tuple[str, ...], rules: tuple[tuple[str, Any], ...]
) -> None:
  """A mesh axis the rules never use, spelled like one they use but the mesh
  lacks, is a typo: say so once, instead of a problem per array."""
  import difflib

  wanted = []
  for _, target in rules:
    for axis in (target,) if isinstance(target, str) else (target or ()):
      if axis not in axis_names and axis not in wanted:
        wanted.append(axis)
  used = {a for _, t in rules for a in ((t,) if isinstance(t, str) else (t or ()))}
  unused = [a for a in axis_names if a not in used]
  for axis in wanted:
    close = difflib.get_close_matches(axis, unused, n=1)
    if close:
      raise UsageError(
        f'--mesh {text!r}: no rule uses mesh axis {close[0]!r}, and the rules '
        f'shard over {axis!r}, which the mesh lacks: did you mean {axis!r}?'
      )


def run_plan(args: argparse.Namespace) -> int:
  """The ``plan`` subcommand; returns the exit code."""
  names = example_state.MODEL_NAMES
  if args.model is not None and args.model not in names:
    raise UsageError(
      f'unknown model {args.model!r}; choose from {", ".join(names)} '
      'or pass --module PKG.MOD:FACTORY'
    )
  axis_names, axis_sizes = parse_mesh(args.mesh)
  rules = load_rules(args.rules) if args.rules else None

  # Heavy imports only once the arguments are known to be good.
  if args.model is not None and rules is None:
    rules = example_state.model_rules(args.model)
  elif rules is None:
    rules = load_rules('t5x')
  _check_mesh_axis_names(args.mesh, axis_names, rules)

  import jax
  import jax.numpy as jnp
  from jax.sharding import AxisType

  from flax_shardmeta._planning.plan import plan

  dtype = jnp.bfloat16 if args.dtype == 'bfloat16' else jnp.float32
  if args.model is not None:
    state = example_state.abstract_state(args.model, args.api, args.optimizer, dtype)
  else:
    state = _user_state(args.module, args.api, args.optimizer)
  # Stated, not left to jax: its default changed from Auto to Explicit.
  kind = AxisType.Explicit if args.axis_types == 'explicit' else AxisType.Auto
  mesh = jax.sharding.AbstractMesh(
    axis_sizes, axis_names, axis_types=(kind,) * len(axis_names)
  )
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
    raise UsageError(f'--processes {n}: use 1, 2, 4 or 8 (8 devices in all)')
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


def _local_jax_on_cpu() -> None:
  """Off a TPU VM, jax's own backend is the CPU (unless JAX_PLATFORMS says).

  Every command runs on this machine's CPU (the demo's simulated devices) or
  compiles for a described pod. With libtpu installed (the tpu extra), jax
  would otherwise try to start a local TPU first and print several lines of
  warnings about this machine's missing TPU.
  """
  if glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'):
    return
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``flax-shardmeta`` and ``python -m flax_shardmeta``.

  Example:
    >>> main(['plan', '--model', 'mlp', '--mesh', 'data=0'])
    2
  """
  _local_jax_on_cpu()
  try:
    args = _parser().parse_args(argv)
    if args.command == 'demo':
      return run_demo(args)
    if args.command in ('fit', 'suggest'):
      from flax_shardmeta import cli_fit, cli_suggest

      names = example_state.MODEL_NAMES
      if args.model is not None and args.model not in names:
        raise UsageError(
          f'unknown model {args.model!r}; choose from {", ".join(names)} '
          'or pass --module PKG.MOD:FACTORY'
        )
      if args.command == 'suggest':
        return cli_suggest.run(args, UsageError)
      rules = load_rules(args.rules) if args.rules else None
      return cli_fit.run(args, parse_mesh(args.mesh), rules, UsageError)
    return run_plan(args)
  except (UsageError, example_state.UnknownNameError) as e:
    print(f'flax-shardmeta: error: {e}', file=sys.stderr)
    return 2
  except SystemExit as e:  # --help
    return e.code if isinstance(e.code, int) else 0


if __name__ == '__main__':
  sys.exit(main())
