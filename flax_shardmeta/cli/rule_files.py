"""The logical axis rules a command uses: from ``--rules`` (a preset, a JSON or
TOML file), the built-in models' defaults, or those a mesh's axes call for;
and the parameters' dtype option.

Nothing here imports jax or flax at module level.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from typing import Any

from flax_shardmeta.cli.checks import check_mesh_axis_names
from flax_shardmeta.cli.options import UsageError
from flax_shardmeta.examples import state as example_state

T5X_PRESETS = {'t5x': 't5x-1d', 't5x-1d': 't5x-1d', 't5x-2d': 't5x-2d'}
"""``--rules`` names of the rule presets, as ``suggest --presets`` spells them
(``t5x`` is ``t5x-1d``)."""


def load_rules(spec: str) -> tuple[tuple[str, Any], ...]:
  """Rules from a T5X preset (``t5x-1d``, or ``t5x`` for short, and
  ``t5x-2d``: ``fsm.RULE_PRESETS``' rules), inline JSON or a JSON / TOML file.

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
  if spec in T5X_PRESETS:
    import flax_shardmeta as fsm

    return fsm.RULE_PRESETS[T5X_PRESETS[spec]].rules
  if spec.lstrip().startswith('['):  # inline JSON: a file name never starts so
    try:
      data = json.loads(spec)
    except ValueError as e:
      raise UsageError(f'cannot parse --rules {spec!r} as JSON: {e}') from None
    return _rule_pairs(data, f'--rules {spec!r}')
  try:
    with open(spec, 'rb') as f:
      raw = f.read()
  except FileNotFoundError as e:
    return _rules_text(spec, e)
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


def _rules_text(spec: str, missing: OSError) -> tuple[tuple[str, Any], ...]:
  """``--rules`` that names no file: read as JSON text, else say it is neither."""
  try:
    data = json.loads(spec)
  except ValueError as e:
    raise UsageError(
      f'--rules {spec!r} is not valid: as JSON text: {e}; as a file path: '
      f'{missing.strerror}. Give a JSON list such as [["batch", "data"]], a '
      '.json or .toml rules file, or t5x-1d (t5x) / t5x-2d'
    ) from None
  return _rule_pairs(data, f'--rules {spec!r}')


def _rule_pairs(data: Any, where: str) -> tuple[tuple[str, Any], ...]:
  # The rule engine (and with it jax) only once the file has been read.
  import flax_shardmeta as fsm

  try:
    return fsm.rules_from_lists(data, where)
  except fsm.FlaxShardmetaError as e:
    raise UsageError(e.message) from None


def command_rules(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
  """``--rules``, else the built-in model's own rules, else T5X's."""
  if args.rules:
    return load_rules(args.rules)
  if args.model is not None:
    return example_state.model_rules(args.model)
  return load_rules('t5x')


def note_default_rules(args: argparse.Namespace) -> None:
  """One line on stderr when :func:`command_rules` fell back to T5X's rules
  (your own model, no ``--rules``): a layout from rules nobody chose should
  say whose they are. Said with the output, so that errors stay one line."""
  if not args.rules and args.model is None:
    print(
      'flax-shardmeta: rules: T5X defaults (pass --rules t5x-2d, inline JSON or '
      'a JSON / TOML file to choose)',
      file=sys.stderr,
    )


def mesh_rules(
  args: argparse.Namespace, axis_names: tuple[str, ...]
) -> tuple[tuple[str, Any], ...]:
  """The command's rules (:func:`command_rules`), checked against the mesh's
  axis names for a misspelt axis (:func:`check_mesh_axis_names`)."""
  rules = command_rules(args)
  check_mesh_axis_names(args.mesh, axis_names, rules)
  return rules


def param_dtype(args: argparse.Namespace) -> Any:
  """``--dtype`` as a jax dtype (imports jax: call once the arguments are good)."""
  import jax.numpy as jnp

  return jnp.bfloat16 if args.dtype == 'bfloat16' else jnp.float32
