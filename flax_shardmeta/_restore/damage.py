"""Damaged checkpoint files, named: which leaf or file, and orbax's reason.

orbax and TensorStore report a damaged data file as a bare ``Exception``
carrying kilobytes of TensorStore spec, and orbax logs corrupt metadata
files rather than raising. Here both become a ``CheckpointDamagedError``
naming the leaf or the file, with the underlying reason in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from flax_shardmeta._errors import CheckpointDamagedError

_REASON_CHARS = 300
FIX = 'restore from another checkpoint (an earlier step, or a copy)'


def reason(error: BaseException) -> str:
  """``error``'s own message in one line, without TensorStore's spec."""
  causes = []
  e: BaseException | None = error
  while e is not None and len(causes) < 4:
    causes.append(e)
    e = e.__cause__ or e.__context__
  # The innermost TensorStore error says what is wrong; orbax's wrapper only
  # which index it was reading.
  inner = next((c for c in reversed(causes) if _STATUS.match(str(c))), causes[0])
  text = str(inner).split(' [tensorstore_spec=')[0].split(' See full TensorStore')[0]
  text = ' '.join(text.split())
  if len(text) > _REASON_CHARS:
    text = text[: _REASON_CHARS - 3] + '...'
  return f'{type(inner).__name__}: {text}'


_STATUS = re.compile(r'^[A-Z_]+: ')  # TensorStore's status codes lead its messages
_READ_FAILURE = re.compile(
  r'(DATA_LOSS|OUT_OF_RANGE|NOT_FOUND|Error reading|Error decoding)[^\n]*'
  r'(OCDBT|local file|chunk)'
)


def json_problem(path: str) -> str | None:
  """Why the JSON file at ``path`` cannot be read (None: it parses, or is absent)."""
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      value = json.load(f)
  except (OSError, ValueError) as e:
    return f'{type(e).__name__}: {e}'
  if not isinstance(value, dict):
    return f'it holds a JSON {type(value).__name__}, not an object'
  return None


def check_metadata_files(where: str) -> None:
  """Raises naming orbax's metadata file at ``where`` that is not JSON."""
  for name in ('_CHECKPOINT_METADATA', '_METADATA'):
    problem = json_problem(os.path.join(where, name))
    if problem is not None:
      raise CheckpointDamagedError(
        f'{os.path.join(where, name)}: this orbax metadata file is corrupt '
        f'({problem}), so the checkpoint cannot be read; {FIX}'
      )


def metadata_error(where: str, error: BaseException) -> CheckpointDamagedError:
  """The error for orbax failing to read the metadata at ``where``."""
  check_metadata_files(where)
  text = _chain_text(error)
  if not any(w in text for w in ('OCDBT', 'TensorStore', 'tensorstore', 'zarr')):
    # JSON, but not orbax's: the tree in _METADATA is what it cannot read.
    return CheckpointDamagedError(
      f'{os.path.join(where, "_METADATA")}: this orbax metadata file is corrupt '
      f'(orbax cannot read its tree: {reason(error)}), so the checkpoint cannot '
      f'be read; {FIX}'
    )
  leaf = _saved_name(text, None)
  what = f"leaf {leaf.replace('.', '/')}'s array metadata" if leaf else 'its metadata'
  return CheckpointDamagedError(
    f"{where}: orbax cannot read {what} from the checkpoint's data files, "
    f'which are damaged or incomplete ({reason(error)}); {FIX}'
  )


def read_error(
  directory: str, names: dict[str, str], error: BaseException
) -> CheckpointDamagedError | None:
  """The error for a failed read of leaves ``names`` (orbax name -> path).

  None when ``error`` is not a TensorStore read failure (then it is raised
  as it is).
  """
  text = _chain_text(error)
  # TensorStore failing to get a chunk's bytes, not any error of a read.
  if not _READ_FAILURE.search(text):
    return None
  name = _saved_name(text, names)
  leaf = names.get(name or '', None)
  if leaf is None:
    paths = ', '.join(sorted(names.values()))
    what = f'one of the leaves {paths}' if len(names) > 1 else f'leaf {paths}'
  else:
    what = f'leaf {leaf}'
  key = re.search(r'Error reading "([^"]+)" in OCDBT', text)
  file = None if key is None else _data_file(directory, key.group(1))
  where = f' (its chunk {key.group(1)}, in {file})' if key and file else ''
  return CheckpointDamagedError(
    f'{directory}: the array data of {what}{where} cannot be read: the '
    f"checkpoint's data files are damaged or incomplete ({reason(error)}); {FIX}"
  )


def _data_file(directory: str, key: str) -> str | None:
  """The OCDBT data file holding ``key``'s value (None: inline or unknown)."""
  try:
    import tensorstore as ts

    store = ts.KvStore.open(f'file://{os.path.abspath(directory)}/').result()
    versions = ts.ocdbt.dump(store).result().get('versions') or []
    nodes = [versions[-1]['root']['location']] if versions else []
    while nodes:  # the b-tree, breadth first; checkpoints keep it shallow
      for entry in ts.ocdbt.dump(store, nodes.pop()).result().get('entries', ()):
        name = entry.get('key', b'')
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name == key and 'indirect_value' in entry:
          # 'value:<folder>/:<file>:<offset>:<length>'
          _, folder, file, *_ = str(entry['indirect_value']).split(':')
          return os.path.join(directory, folder + file)
        nodes += [
          entry[c] for c in ('node', 'location') if isinstance(entry.get(c), str)
        ]
  except Exception:  # noqa: BLE001 - naming the file is a courtesy, not a need
    return None
  return None


def _chain_text(error: BaseException) -> str:
  parts, e = [], error
  while e is not None and len(parts) < 4:
    parts.append(str(e))
    e = e.__cause__ or e.__context__
  return '\n'.join(parts)


def _saved_name(text: str, names: dict[str, str] | None) -> str | None:
  """The orbax name of the array ``text`` (an error) is about, if it says.

  TensorStore names the key it read (``"w/0.0"``, ``"b.c/.zarray"``); its
  spec names the array's folder (``'path': 'w/'``).
  """
  for quoted in re.findall(r'"([^"\n]+)"|\'([^\'\n]+)\'', text):
    key = quoted[0] or quoted[1]
    if key.startswith('/') or ':' in key:
      continue  # a file or a URL, not a key
    if names is None:
      if key.endswith('/.zarray'):
        return key[: -len('/.zarray')]
      continue
    for name in (key.rstrip('/'), key.rsplit('/', 1)[0]):
      if name in names:
        return name
  return None


@contextlib.contextmanager
def reading(plan: Any, paths: tuple[str, ...]) -> Iterator[None]:
  """Names the leaf of a read of ``paths`` that fails on damaged data."""
  try:
    yield
  except CheckpointDamagedError:
    raise
  except Exception as e:  # noqa: BLE001 - orbax re-raises TensorStore's as bare ones
    ckpt = plan.checkpoint
    names = {'.'.join(ckpt.keys[p]): p for p in paths if p in ckpt.keys}
    error = read_error(ckpt.directory, names, e)
    if error is None:
      raise
    raise error from e
