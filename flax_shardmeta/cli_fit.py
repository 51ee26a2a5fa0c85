"""``flax-shardmeta fit``: does a training step fit the pod, before the pod?

Builds a model's training step abstractly (forward, backward and the
optimizer update, the state donated) and compiles it for a TPU topology with
libtpu, or estimates it on an abstract mesh, then prints the per-chip report:
memory by category, the verdict against HBM, collectives per step and a
roofline step time.

* ``--model NAME`` uses a built-in model and its rules (Auto mesh axes, as the
  built-in models are written for).
* ``--module PKG.MOD:FACTORY`` calls your factory, which returns ``(step,
  *abstract_args)``: the training step (a plain function, ``jax.jit`` or
  ``fsm.jit``) and its arguments as ``jax.eval_shape`` trees; annotated
  arguments are laid out by the rules, an argument that is itself a box (e.g.
  ``fsm.LogicalPartitioned(batch, ('batch', None))``) by its annotation. The
  factory may take any of the keyword arguments ``batch``, ``seq``, ``remat``
  and ``num_layers``; those given on the command line are passed (with
  ``--extrapolate``, ``num_layers``' default is the depth reported on).

Without ``--topology`` the mesh is an ``AbstractMesh`` (Auto axes) and the
figures are an estimate (``--chip`` names the hardware for the verdict).

Exit codes: 0 the step fits (or no memory size is known), 1 it does not fit,
2 bad arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from typing import Any

_REMAT = ('none', 'full', 'dots')
_OPTIMIZERS = ('adamw', 'adam', 'adafactor', 'sgd')
# Kept in step with examples.train by a test; duplicated so that argument
# errors are reported before jax and flax are imported.


def add_parser(sub: Any, builtin_models: tuple[str, ...]) -> argparse.ArgumentParser:
  """Adds the ``fit`` subcommand to the CLI's subparsers."""
  p = sub.add_parser(
    'fit',
    help='memory per chip, collectives and step time of a training step on a pod',
    description='Will a training step fit each chip? Compiled for a TPU topology '
    '(libtpu), or estimated on an abstract mesh.',
    epilog=(__doc__ or '').split('\n\n', 1)[1],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  which = p.add_mutually_exclusive_group(required=True)
  which.add_argument('--model', help=f'a built-in model: {", ".join(builtin_models)}')
  which.add_argument(
    '--module', metavar='PKG.MOD:FACTORY', help='your own step (see below)'
  )
  p.add_argument(
    '--mesh',
    required=True,
    metavar='AXIS=SIZE,...',
    help='mesh axes and sizes, e.g. data=32,model=4 (their product is the '
    'number of devices of the topology)',
  )
  p.add_argument(
    '--topology',
    metavar='GEN:SHAPE',
    help='a TPU pod to compile for, e.g. v5p:4x4x8 (needs libtpu: pip install '
    "'flax_shardmeta[tpu]'); without it the figures are an estimate",
  )
  p.add_argument(
    '--num-slices', type=int, default=1, help='slices of the topology (default: 1)'
  )
  p.add_argument('--batch', type=int, help='global batch size (default: 8)')
  p.add_argument('--seq', type=int, help='tokens per sequence (default: 2048)')
  p.add_argument(
    '--remat',
    help=f'rematerialise each layer: {", ".join(_REMAT)} (default: none)',
  )
  p.add_argument(
    '--optimizer',
    choices=_OPTIMIZERS,
    default='adamw',
    help='optimizer of the built-in step (default: adamw)',
  )
  p.add_argument('--api', choices=('linen', 'nnx'), default='linen')
  p.add_argument('--dtype', choices=('float32', 'bfloat16'), default='bfloat16')
  p.add_argument(
    '--rules',
    metavar='t5x|t5x-2d|FILE',
    help="logical axis rules (default: the built-in model's own, or t5x)",
  )
  p.add_argument('--hbm', help='memory per chip to judge against, e.g. 95GiB')
  p.add_argument(
    '--chip', help='hardware figures when the mesh does not say, e.g. v5p, h100'
  )
  p.add_argument(
    '--extrapolate',
    action='store_true',
    help='compile at 2 and 4 layers and extrapolate (faster only when compile '
    'time grows with depth, i.e. layers not scanned)',
  )
  p.add_argument(
    '--no-cache', action='store_true', help='compile even if the figures are cached'
  )
  p.add_argument('--format', choices=('table', 'json'), default='table')
  return p


def _quiet_libtpu() -> None:
  """libtpu's start-up warnings describe this (TPU-less) machine: skip them."""
  from flax_shardmeta._planning.topology import _QUIET_ENV, _on_a_tpu_vm

  if not _on_a_tpu_vm():
    for key, value in _QUIET_ENV.items():
      os.environ.setdefault(key, value)


def run(
  args: argparse.Namespace,
  mesh_axes: tuple[tuple[str, ...], tuple[int, ...]],
  rules: Any,
  usage_error: type[Exception],
) -> int:
  """The ``fit`` subcommand; returns the exit code.

  ``mesh_axes`` and ``rules`` are ``--mesh`` and ``--rules`` as the CLI parsed
  them; ``usage_error`` is the CLI's one-line argument error.
  """
  names, sizes = mesh_axes
  if args.remat is not None and args.remat not in _REMAT and not args.module:
    raise usage_error(f'--remat {args.remat!r}: choose from {", ".join(_REMAT)}')
  for flag in ('batch', 'seq', 'num_slices'):
    value = getattr(args, flag)
    if value is not None and value < 1:
      raise usage_error(f'--{flag.replace("_", "-")} {value}: must be at least 1')
  _quiet_libtpu()

  import jax

  import flax_shardmeta as fsm
  from flax_shardmeta._planning.chips import parse_bytes

  if args.hbm is not None:
    try:
      parse_bytes(args.hbm)
    except fsm.FitError as e:
      raise usage_error(f'--hbm: {e}') from None
  auto = (jax.sharding.AxisType.Auto,) * len(names)
  if args.topology:
    try:
      mesh: Any = fsm.make_mesh(
        sizes,
        names,
        topology=args.topology,
        num_slices=args.num_slices,
        axis_types=auto,
      )
    except (fsm.TopologyError, fsm.MeshShapeError) as e:
      raise usage_error(str(e)) from None
  else:
    mesh = jax.sharding.AbstractMesh(sizes, names, axis_types=auto)
  options = {
    'hbm': args.hbm,
    'chip': args.chip,
    'cache': not args.no_cache,
  }
  try:
    if args.model is not None:
      report = _builtin(args, mesh, rules, options)
    else:
      report = _user(args, mesh, rules, options, usage_error)
  except fsm.FitError as e:
    if 'chip=' in str(e) or 'hbm=' in str(e):
      raise usage_error(str(e)) from None
    raise
  if args.format == 'json':
    print(json.dumps(report.to_dict(), indent=1))
  else:
    print(report)
  return 1 if report.fits is False else 0


def _builtin(args: argparse.Namespace, mesh: Any, rules: Any, options: dict) -> Any:
  import jax.numpy as jnp

  import flax_shardmeta as fsm
  from flax_shardmeta.examples import train

  kwargs = {
    'rules': rules,
    'batch': args.batch or 8,
    'seq': args.seq or 2048,
    'api': args.api,
    'remat': args.remat or 'none',
    'optimizer_name': args.optimizer,
    'dtype': jnp.bfloat16 if args.dtype == 'bfloat16' else jnp.float32,
  }
  if args.extrapolate:
    config_layers = _layers_of(args.model)

    def build(n: int) -> Any:
      return train.train_step(args.model, mesh, num_layers=n, **kwargs)

    return fsm.fit(build, layers=config_layers, **options)
  return fsm.fit(*train.train_step(args.model, mesh, **kwargs), **options)


def _layers_of(name: str) -> int:
  from flax_shardmeta.examples import _common

  if name == 'mlp':
    return 4
  return _common.LLAMA_CONFIGS[name].num_layers


def _user(
  args: argparse.Namespace,
  mesh: Any,
  rules: Any,
  options: dict,
  usage_error: type[Exception],
) -> Any:
  import jax

  import flax_shardmeta as fsm
  from flax_shardmeta._rules import standard_logical_axis_rules

  module_name, colon, attr = args.module.partition(':')
  if not colon or not module_name or not attr:
    raise usage_error(f'--module {args.module!r}: expected PKG.MOD:FACTORY')
  if os.getcwd() not in sys.path:  # like `python -m`, find a module next to the user
    sys.path.insert(0, os.getcwd())
  try:
    factory = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError) as e:
    raise usage_error(f'--module {args.module!r}: {e}') from None
  given = {
    'batch': args.batch,
    'seq': args.seq,
    'remat': args.remat,
  }
  accepted = inspect.signature(factory).parameters
  kwargs = {k: v for k, v in given.items() if v is not None and k in accepted}
  rules = standard_logical_axis_rules() if rules is None else rules

  def context() -> Any:
    # A fresh one each time: jax's mesh contexts cannot be entered twice.
    if isinstance(mesh, jax.sharding.AbstractMesh):
      return jax.sharding.use_abstract_mesh(mesh)
    return jax.set_mesh(mesh)

  def made(**extra: Any) -> tuple[Any, ...]:
    with context(), fsm.logical_axis_rules(rules):
      out = factory(**kwargs, **extra)
    if not isinstance(out, (tuple, list)) or len(out) < 1 or not callable(out[0]):
      raise usage_error(
        f'--module {args.module!r}: the factory returned {type(out).__name__}; '
        'expected (step, *abstract_args)'
      )
    return tuple(out)

  with context(), fsm.logical_axis_rules(rules):
    if args.extrapolate:
      if 'num_layers' not in accepted:
        raise usage_error(
          f'--extrapolate: {args.module} takes no num_layers keyword argument'
        )
      layers = accepted['num_layers'].default
      if not isinstance(layers, int):
        raise usage_error(
          f'--extrapolate: give num_layers of {args.module} a default (the depth '
          'to report on)'
        )
      return fsm.fit(lambda n: made(num_layers=n), layers=layers, **options)
    return fsm.fit(*made(), **options)
