"""The training step ``fit`` and ``snapshot`` build: one set of options, one
check of them, one mesh and one way to make the step.

``--model NAME`` (a built-in model, its rules, Auto axes) or ``--module
PKG.MOD:FACTORY`` (your own), ``--mesh``, ``--topology`` (a TPU pod or GPU
cluster; without it an ``AbstractMesh``), and the step's own options.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from flax_shardmeta.cli import checks, options, rule_files
from flax_shardmeta.cli.factory import Factory


def add_arguments(p: argparse.ArgumentParser, mesh_example: str) -> None:
  """The options that say which step, on which mesh."""
  options.add_model_or_module(p, 'your own step (see below)')
  options.add_mesh(p, mesh_example)
  options.add_pod(p, required=False)
  options.add_step(
    p,
    remat=f'rematerialise each layer: {", ".join(options.REMAT)} (default: none)',
    batch_required=False,
  )
  options.add_front_end(p, api="a built-in model's Flax front end", dtype='bfloat16')
  options.add_rules(p)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What ``fit`` and ``snapshot`` make their step from.

  Attributes:
    mesh: over the topology's devices, else abstract (Auto axes).
    rules: the command's rules, checked against the mesh's axis names.
    factory: your ``--module`` factory, or None for a built-in model.
    options: the step's keyword arguments: ``examples.train.train_step``'s for
      a built-in model, those your factory takes otherwise.
    run_options: ``fsm.fit``'s ``mem_fraction=`` and ``reserve=``, where given.
  """

  mesh: Any
  rules: Any
  factory: Factory | None
  options: dict[str, Any]
  run_options: dict[str, Any]


def prepared(args: argparse.Namespace) -> Prepared:
  """The step's mesh, rules, factory and options; bad arguments are a
  ``UsageError`` before jax starts."""
  names, sizes = checks.step_arguments(args)
  run_options = checks.gpu_run_options(args)
  rules = rule_files.mesh_rules(args, names)
  over = mesh(args, names, sizes)
  if args.module is None:
    factory, options = None, builtin_options(args, rules)
  else:
    factory = Factory.load(args.module)
    options = factory_options(factory, args)
  return Prepared(over, rules, factory, options, run_options)


def mesh(
  args: argparse.Namespace,
  names: tuple[str, ...],
  sizes: tuple[int, ...],
  *,
  explicit: bool = False,
  local: bool = False,
) -> Any:
  """Every command's mesh from its options: over ``--topology``'s devices,
  else over this process's devices (``local``: the audit's simulated ones),
  else abstract. Axis types are stated, never left to jax (its default
  changed from Auto to Explicit): Auto, as the built-in models are written
  for, unless ``explicit``."""
  import jax

  import flax_shardmeta as fsm

  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  types = (kind,) * len(names)
  topology = getattr(args, 'topology', None)
  if topology:
    return fsm.make_mesh(
      sizes,
      names,
      topology=topology,
      num_slices=args.num_slices,
      target_config=args.target_config,
      axis_types=types,
    )
  if local:
    return jax.make_mesh(tuple(sizes), tuple(names), axis_types=types)
  return jax.sharding.AbstractMesh(tuple(sizes), tuple(names), axis_types=types)


def builtin_options(args: argparse.Namespace, rules: Any) -> dict[str, Any]:
  """``examples.train.train_step``'s options from the command line."""
  from flax_shardmeta.examples import train

  return {
    'rules': rules,
    'batch': args.batch or train.BATCH,
    'seq': args.seq or train.SEQ,
    'api': args.api,
    'remat': args.remat or 'none',
    'optimizer_name': args.optimizer,
    'dtype': rule_files.param_dtype(args),
    'offload': getattr(args, 'offload', None) or 'none',
  }


def factory_options(factory: Factory, args: argparse.Namespace) -> dict[str, Any]:
  """Your factory's options from the command line (those it takes)."""
  given = {'batch': args.batch, 'seq': args.seq, 'remat': args.remat}
  flags = {k: (f'--{k} {v}', v) for k, v in given.items()}
  offload = getattr(args, 'offload', None)
  if offload not in (None, 'none'):
    import flax_shardmeta as fsm

    flags['offload'] = (f'--offload {offload}', fsm.OFFLOAD_PRESETS[offload])
  return factory.options(flags)
