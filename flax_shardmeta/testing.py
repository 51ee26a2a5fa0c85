"""Helpers for tests: a step's layout pinned in a golden file, and several
processes on one machine.

``fsm.testing.assert_snapshot(fsm.snapshot(step, *args), path)`` records the
layout in ``path`` the first time and compares with it afterwards, failing
with the differences (``fsm.snapshot_diff``) when they differ. Run the tests
with ``FLAX_SHARDMETA_UPDATE_SNAPSHOTS=1`` to record the new layouts when a
change is meant.

``fsm.testing.launch(argv, num_processes=2)`` runs ``python argv`` as that
many processes on 127.0.0.1, each with its own CPU devices, joined by
``jax.distributed`` with gloo collectives: what a pod does with a process per
host. Each calls ``fsm.testing.join_launch()`` first; outside a launch it
returns ``(0, 1)``, so the same script runs alone too.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from flax_shardmeta._errors import FitError

# Re-exported: multi-process tests on one machine.
from flax_shardmeta._hosts.launch import (
  ProcessResult as ProcessResult,
  initialize as join_launch,
  launch as launch,
)
from flax_shardmeta._snapshot.compare import snapshot_diff
from flax_shardmeta._snapshot.schema import check_snapshot

UPDATE_VARIABLE = 'FLAX_SHARDMETA_UPDATE_SNAPSHOTS'
"""The environment variable that, set to ``1`` (or ``true``, ``yes``, ``on``),
rewrites every golden file."""

_YES = ('1', 'true', 'yes', 'on')
_NO = ('', '0', 'false', 'no', 'off')

__all__ = [
  'UPDATE_VARIABLE',
  'ProcessResult',
  'SnapshotMismatch',
  'assert_snapshot',
  'join_launch',
  'launch',
]


class SnapshotMismatch(AssertionError):
  """A layout differs from its golden file: a test failure, as ``assert`` raises.

  Attributes:
    lines: the differences, as ``fsm.snapshot_diff`` gives them.

  Example:
    >>> error = SnapshotMismatch('layout.json', ['params/w: P() -> P(None)'])
    >>> isinstance(error, AssertionError), error.lines
    (True, ['params/w: P() -> P(None)'])
  """

  def __init__(self, path: str | os.PathLike[str], lines: list[str]) -> None:
    self.lines = list(lines)
    shown = '\n'.join(f'  {line}' for line in self.lines)
    super().__init__(
      f'the layout differs from {os.fspath(path)}:\n{shown}\n'
      f'If the change is meant, record the new layout: run the tests again with '
      f'{UPDATE_VARIABLE}=1.'
    )


def assert_snapshot(snapshot: dict[str, Any], path: str | os.PathLike[str]) -> None:
  """Compares ``snapshot`` with the golden file ``path``, or writes it.

  The file is written (JSON, one-space indent, sorted keys, a trailing
  newline; its folders made) when it does not exist or when the environment
  variable ``FLAX_SHARDMETA_UPDATE_SNAPSHOTS`` is ``1`` (or ``true``, ``yes``,
  ``on``, in any case). Otherwise it is read
  and compared with :func:`flax_shardmeta.snapshot_diff`.

  Args:
    snapshot: from :func:`flax_shardmeta.snapshot`.
    path: the golden file, e.g. ``tests/layouts/train_step.json``.

  Raises:
    SnapshotMismatch: (an ``AssertionError``) the layouts differ; the message
      lists the differences and how to record the new layout.
    FitError: the file cannot be read, is a directory, holds no snapshot of
      this format (a field is named with what it should be), or the variable
      has a value that is neither on nor off; one of an older
      version (written by an older flax_shardmeta) must be recorded again,
      with ``FLAX_SHARDMETA_UPDATE_SNAPSHOTS=1``.

  Example:
    >>> import os, tempfile, flax_shardmeta as fsm
    >>> snap = {'version': 2, 'parameters': {'params/w': "P(None, 'model')"}}
    >>> path = os.path.join(tempfile.mkdtemp(), 'layout.json')
    >>> fsm.testing.assert_snapshot(snap, path)  # written: it was missing
    >>> fsm.testing.assert_snapshot(snap, path)  # equal: passes
    >>> moved = {'version': 2, 'parameters': {'params/w': "P('model', None)"}}
    >>> fsm.testing.assert_snapshot(moved, path)
    Traceback (most recent call last):
    ...
    flax_shardmeta.testing.SnapshotMismatch: the layout differs from ...:
      params/w: P(None, 'model') -> P('model', None)
    If the change is meant, record the new layout: run the tests again with FLAX_SHARDMETA_UPDATE_SNAPSHOTS=1.
  """  # noqa: E501
  __tracebackhide__ = True  # pytest shows the caller's line, not this one
  text = _text(snapshot)
  golden = pathlib.Path(path)
  if golden.is_dir():
    raise FitError(
      f'{os.fspath(path)} is a directory; the golden file is a JSON file, '
      'e.g. tests/layouts/train_step.json.'
    )
  if _updating() or not golden.exists():
    golden.parent.mkdir(parents=True, exist_ok=True)
    golden.write_text(text)
    return
  recorded = _read(golden)
  # Named by its path: which golden file to correct or record again.
  check_snapshot(recorded, os.fspath(path))
  lines = snapshot_diff(recorded, json.loads(text))
  if lines:
    raise SnapshotMismatch(path, lines)


def _updating() -> bool:
  """Whether ``FLAX_SHARDMETA_UPDATE_SNAPSHOTS`` asks to record: a value not
  understood is an error, never a silent comparison."""
  value = os.environ.get(UPDATE_VARIABLE, '').strip().lower()
  if value in _YES or value in _NO:
    return value in _YES
  raise FitError(
    f'{UPDATE_VARIABLE}={os.environ[UPDATE_VARIABLE]!r} is neither on '
    f'({", ".join(_YES)}) nor off ({", ".join(repr(v) for v in _NO)}): set it '
    'to 1 to record the golden files, or unset it to compare with them.'
  )


def _read(golden: pathlib.Path) -> Any:
  """The golden file's JSON; fsm's error naming the file when it cannot be
  read or holds no JSON."""
  try:
    text = golden.read_text()
  except (OSError, UnicodeDecodeError) as e:
    raise FitError(f'cannot read {os.fspath(golden)}: {e}') from None
  try:
    return json.loads(text)
  except ValueError as e:
    raise FitError(
      f'{os.fspath(golden)} holds no JSON ({e}): delete it or record '
      f'it again with {UPDATE_VARIABLE}=1.'
    ) from None


def _text(snapshot: Any) -> str:
  """The snapshot as the golden file's text, checked first: what is no
  snapshot is never written as one."""
  try:
    text = json.dumps(snapshot, indent=1, sort_keys=True, allow_nan=False) + '\n'
  except (TypeError, ValueError) as e:
    raise FitError(
      f'the snapshot given is not JSON ({e}); pass what fsm.snapshot returns.'
    ) from None
  # Through JSON and back: tuples become lists, as in the file.
  check_snapshot(json.loads(text), 'the snapshot given')
  return text
