"""Units as text, for plans and reports alike: bytes, element counts, seconds,
and aligned tables; and sizes read back from text (``parse_bytes``).

Example:
  >>> format_bytes(3 * 2**30), format_count(70_553_706_496), format_seconds(0.0123)
  ('3.00 GiB', '70.55 B', '12.3 ms')
"""

from __future__ import annotations

import re

from flax_shardmeta._errors import SizeError


def format_bytes(n: int) -> str:
  """Bytes in binary units, as every table and message of fsm writes them.

  Example:
    >>> import flax_shardmeta as fsm
    >>> fsm.format_bytes(3 * 2**30), fsm.format_bytes(512)
    ('3.00 GiB', '512 B')
  """
  if n < 1024:
    return f'{n} B'
  value = float(n)
  for unit in ('KiB', 'MiB', 'GiB'):
    value /= 1024
    if value < 1024:
      return f'{value:.2f} {unit}'
  return f'{value / 1024:.2f} TiB'


def format_count(n: int) -> str:
  """Element counts with a short suffix, e.g. ``70.55 B`` for 70,553,706,496."""
  for div, unit in ((10**12, 'T'), (10**9, 'B'), (10**6, 'M'), (10**3, 'K')):
    if n >= div:
      return f'{n / div:.2f} {unit}'
  return str(n)


def signed_bytes(n: float | int | None) -> str:
  """``-1536`` -> ``'-1.5 KiB'`` (``'?'`` for None)."""
  if n is None:
    return '?'
  sign = '-' if n < 0 else ''
  return sign + format_bytes(int(abs(n)))


def format_seconds(s: float | None) -> str:
  """``0.0123`` -> ``'12.3 ms'`` (``'-'`` for None)."""
  if s is None:
    return '-'
  if s >= 1:
    return f'{s:.2f} s'
  if s >= 1e-3:
    return f'{s * 1e3:.1f} ms'
  return f'{s * 1e6:.0f} us'


def table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
  """Rows as aligned lines; the columns in ``right`` right-aligned."""
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

  def line(r: tuple[str, ...]) -> str:
    cells = [
      c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)
    ]
    return '  '.join(cells).rstrip()

  return [line(r) for r in rows]


_UNITS = {
  '': 1,
  'b': 1,
  'k': 1000,
  'kb': 1000,
  'm': 10**6,
  'mb': 10**6,
  'g': 10**9,
  'gb': 10**9,
  't': 10**12,
  'tb': 10**12,
  'kib': 1 << 10,
  'mib': 1 << 20,
  'gib': 1 << 30,
  'tib': 1 << 40,
}


def parse_bytes(text: str | int | float) -> int:
  """``'95GiB'``, ``'16GB'``, ``'512MiB'`` or a number -> bytes.

  Raises:
    SizeError: for anything else (each caller that takes a size as an
      argument raises its own error, naming the argument).

  Example:
    >>> parse_bytes('95GiB'), parse_bytes('1.5 GB'), parse_bytes(1024)
    (102005473280, 1500000000, 1024)
  """
  if isinstance(text, (int, float)):
    return int(text)
  match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*', text)
  unit = match.group(2).lower() if match else None
  if match is None or unit not in _UNITS:
    raise SizeError(
      f'{text!r} is not a size; write a number of bytes with an optional unit, '
      "e.g. '95GiB', '16GB' or '512MiB'"
    )
  return int(float(match.group(1)) * _UNITS[unit])
