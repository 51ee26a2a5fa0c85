"""Shared helpers of the benchmarks: machine description, A/B timing, BENCHMARKS.md."""

from __future__ import annotations

import gc
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict[str, str]:
  """What the numbers were measured on."""
  import flax
  import jax

  cpu = 'unknown'
  try:
    found = re.search(
      r'^model name\s*:\s*(.+)$', Path('/proc/cpuinfo').read_text(), re.M
    )
    cpu = found.group(1).strip() if found else cpu
  except OSError:
    pass
  return {
    'load': ', '.join(f'{x:.2f}' for x in os.getloadavg()),
    'nproc': str(os.cpu_count()),
    'cpu': cpu,
    'python': platform.python_version(),
    'jax': jax.__version__,
    'flax': flax.__version__,
  }


def machine_line(info: dict[str, str]) -> str:
  """One sentence naming the machine and software versions."""
  return (
    f'Machine: {info["nproc"]} CPUs ({info["cpu"]}); Python {info["python"]}, '
    f'jax {info["jax"]}, flax {info["flax"]}; load average before the runs '
    f'{info["load"]}.'
  )


def alternate(
  candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, float]:
  """Median seconds of each candidate, run A B C A B C ... after a warm-up.

  Alternating spreads the noise of a shared machine evenly over candidates,
  so their ratio is meaningful even when absolute times are not. Each run
  starts from a collected heap, so the garbage one candidate leaves is not
  collected (and timed) during the next candidate's run.
  """
  rounds = alternate_rounds(candidates, repeats, warmup)
  return {name: statistics.median(t) for name, t in rounds.items()}


def alternate_rounds(
  candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
  """Like :func:`alternate`, but every run's seconds, in round order."""
  for _ in range(warmup):
    for fn in candidates.values():
      fn()
  times: dict[str, list[float]] = {name: [] for name in candidates}
  for _ in range(repeats):
    for name, fn in candidates.items():
      gc.collect()
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
  return times


def paired_ratio(rounds: dict[str, list[float]], name: str, baseline: str) -> float:
  """Median over rounds of ``name``'s time over ``baseline``'s in that round.

  Runs of one round are close in time, so they share the machine's load; the
  median of their ratios is steadier than the ratio of the medians.
  """
  return statistics.median(
    t / b for t, b in zip(rounds[name], rounds[baseline], strict=True)
  )


def write_section(title: str, body: str, path: Path = ROOT / 'BENCHMARKS.md') -> None:
  """Replaces (or appends) the section headed ``title`` in BENCHMARKS.md."""
  section = f'{title}\n\n{body.strip()}\n'
  text = path.read_text() if path.exists() else '# Benchmarks\n'
  start = text.find(title + '\n')
  if start == -1:
    text = text.rstrip('\n') + '\n\n' + section
  else:
    nxt = text.find('\n## ', start + len(title))
    rest = '' if nxt == -1 else '\n' + text[nxt + 1 :]
    text = text[:start] + section + rest
  path.write_text(text)


def publish(title: str, lines: list[str], write: bool) -> None:
  """Prints a benchmark's section and, if ``write``, stores it in BENCHMARKS.md."""
  body = '\n'.join(lines)
  print(body)
  if write:
    write_section(title, body)


def xla_totals(m: dict[str, int]) -> tuple[int, int]:
  """XLA's device and host totals per chip from ``memory_analysis()``'s
  fields, combined as fit combines them: argument + output - alias + temp
  (+ generated code on the device)."""

  def side(p: str) -> int:
    return (
      m.get(f'{p}argument_size_in_bytes', 0)
      + m.get(f'{p}output_size_in_bytes', 0)
      - m.get(f'{p}alias_size_in_bytes', 0)
      + m.get(f'{p}temp_size_in_bytes', 0)
    )

  return side('') + m.get('generated_code_size_in_bytes', 0), side('host_')
