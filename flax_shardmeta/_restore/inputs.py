"""A restore's arguments checked: the host budget, the step, counts.

Each bad value gets fsm's own error naming the argument, what it was given
and what it takes, before anything is read.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from typing import Any

import numpy as np

from flax_shardmeta._errors import HostBudgetError, RestoreError, SizeError, message


def budget_bytes(value: Any) -> int | None:
  """``host_budget`` as a positive number of bytes (None: no budget).

  Takes an int (numpy's too), a float of at least one byte (whole bytes
  kept) or a size such as ``'64MiB'``.

  Raises:
    HostBudgetError: for anything else, saying what was given.

  Example:
    >>> budget_bytes('2KiB'), budget_bytes(1024)
    (2048, 1024)
    >>> budget_bytes(float('nan'))
    Traceback (most recent call last):
    ...
    flax_shardmeta._errors.HostBudgetError: host_budget=nan: ...
  """
  from flax_shardmeta._units import parse_bytes

  if value is None:
    return None
  why, got = '', 0
  if isinstance(value, (bool, np.bool_)):
    why = 'a bool is not a size'
  elif isinstance(value, str):
    try:
      got = parse_bytes(value)
    except SizeError as e:
      why = message(e).split('; ', 1)[0]
    else:
      why = '' if got >= 1 else f'it is {got} bytes'
  elif isinstance(value, numbers.Integral):
    got = operator.index(value)
    why = '' if got >= 1 else 'it is not positive'
  elif isinstance(value, numbers.Real):
    number = float(value)
    if not math.isfinite(number):
      why = 'it is not a finite number'
    else:
      got = int(number)  # whole bytes
      why = '' if number >= 1 else 'it is less than one byte'
  else:
    why = f'a {type(value).__name__} is not a size'
  if why:
    raise HostBudgetError(
      f'host_budget={value!r}: {why}; the budget is the host memory a restore '
      'may stage per host, a positive number of bytes: an int or a size such '
      "as '8GiB' (or None for no budget)"
    )
  return got


def count(name: str, value: Any, least: int) -> int | None:
  """``value`` as an int of at least ``least`` (None stays None); else raises."""
  if value is None:
    return None
  try:
    n = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
  except TypeError:
    n = None
  if n is None or n < least:
    what = 'a positive int' if least == 1 else f'an int of at least {least}'
    raise RestoreError(f'{name}={value!r}: expected {what}')
  return n


def check_step(
  source: str | os.PathLike[str], directory: str, step: int | None
) -> None:
  """Raises if ``step`` was asked of a checkpoint that is not a manager's root
  and holds another step (or none): it would not be the step restored."""
  if step is None:
    return
  parent = os.path.basename(os.path.dirname(directory))
  here = os.path.basename(directory)
  held = next((int(n) for n in (parent, here) if n.isdigit()), None)
  if held == step:
    return
  where = os.fspath(source)
  if held is None:
    raise RestoreError(
      f'{where} is a single checkpoint, not a CheckpointManager root: it holds '
      f'no steps to choose from, and step={step} was asked; drop step= (it '
      'picks among the steps of a root)'
    )
  step_folder = os.path.dirname(directory) if parent.isdigit() else directory
  root = os.path.dirname(step_folder)
  raise RestoreError(
    f'{where} holds step {held}, not step {step} as asked: pass the '
    f"CheckpointManager's root ({root}) with step={step}, or this folder "
    'without step='
  )


def check_flag(name: str, value: Any) -> bool:
  """``partial`` / ``allow_cast`` as a bool; anything else raises (a string
  such as ``'no'`` would read as true)."""
  if not isinstance(value, (bool, np.bool_)):
    raise RestoreError(f'{name}={value!r}: expected True or False')
  return bool(value)


def check_hosts(devices: int, devices_per_host: int | None) -> None:
  """Raises unless ``devices_per_host`` splits ``devices`` into whole hosts."""
  if devices_per_host is None or devices % devices_per_host == 0:
    return
  raise RestoreError(
    f"devices_per_host={devices_per_host} does not divide the target mesh's "
    f'{devices} devices into hosts; pass the devices each host has (a divisor '
    f'of {devices}), or leave it out to group a concrete mesh by process'
  )
