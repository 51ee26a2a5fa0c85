"""Units and tables for the capacity layer's text: bytes, seconds, aligned columns."""

from __future__ import annotations

from flax_shardmeta._planning.format import format_bytes


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
