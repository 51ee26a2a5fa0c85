"""Compiling a step, and what the compiler said while it did.

The one compile ``fit`` makes of a step (for GPUs, for the memory a real run
hands XLA), with XLA's dump written to a temporary folder and read before it
is removed: the buffer assignment (``_programs.buffers``) and, where it is
not the program ``as_text()`` gives, the dumped program those buffers are of.
A compiler that refuses the program for lack of memory gives its required
and available bytes; its rematerialization log gives what it could not save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from flax_shardmeta._capacity import vocabulary as vocab
from flax_shardmeta._capacity.fit import usable
from flax_shardmeta._errors import FitError
from flax_shardmeta._programs import buffers as buffers_lib
from flax_shardmeta._programs.buffers import Buffers

_REFUSAL = re.compile(
  r'(?:required for HLO temporaries|Used)\s*\(?([0-9.]+)\s*([KMGT]?)i?B?\)?'
  r'.*?(?:available HBM|of)\s*\(?([0-9.]+)\s*([KMGT]?)i?B?\)?',
  re.S,
)
_UNIT = {'': 1, 'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30, 'T': 1 << 40}


@dataclasses.dataclass(frozen=True)
class Compiled:
  """One compile of a step.

  Attributes:
    program: the compiled program (None when the compiler refused it).
    refusal: the compiler's out-of-memory verdict, if it refused.
    seconds: the compile's wall time.
    planned: what the compiler planned against and said it rematerialized.
    buffers: its buffer assignment at the heap's peak (None: not dumped).
    dumped: the optimised program as XLA's dump wrote it.
  """

  program: Any
  refusal: vocab.Refusal | None
  seconds: float
  planned: dict[str, Any]
  buffers: Buffers | None = None
  dumped: str | None = None


def parse_refusal(message: str) -> vocab.Refusal | None:
  """The compiler's required and available bytes from an out-of-memory error.

  Example:
    >>> r = parse_refusal('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the '
    ...   'total memory required for HLO temporaries (115.85G) exceeds available '
    ...   'HBM (95.74G).')
    >>> round(r.required_bytes / 2**30, 2), round(r.available_bytes / 2**30, 2)
    (115.85, 95.74)
  """
  if 'RESOURCE_EXHAUSTED' not in message and 'Ran out of memory' not in message:
    return None
  first = message.strip().split('\n')[0]
  m = _REFUSAL.search(first)
  if m is None:
    return vocab.Refusal(0, 0, first)
  need = float(m.group(1)) * _UNIT[m.group(2)]
  have = float(m.group(3)) * _UNIT[m.group(4)]
  return vocab.Refusal(int(need), int(have), first)


def compile_step(lowered: Any, limit: int | None) -> Compiled:
  """Compiles (for GPUs, for the memory a run hands XLA: ``limit``); the
  compiled program, or the refusal, the seconds, what the compiler said of
  its own rematerialization and budget, and its buffer assignment with the
  program it is of (XLA's dump of this compile, read and removed)."""
  start = time.perf_counter()
  planned: dict[str, Any] = {'budget': limit, 'retargeted': False}
  try:
    with _stderr_lines() as said, buffers_lib.dump_folder() as folder:
      options = buffers_lib.dump_options(folder)
      if limit is None:
        compiled = lowered.compile(compiler_options=options)
      else:
        compiled, planned['retargeted'], planned['cublas_matmuls'] = (
          usable.compile_for_memory(lowered, limit, options)
        )
      buffers = buffers_lib.read_dump(folder)
      dumped = buffers_lib.dumped_program(folder) if buffers is not None else None
  except Exception as e:  # jax's JaxRuntimeError (XlaRuntimeError before)
    refusal = parse_refusal(str(e))
    if refusal is None:
      raise FitError(
        f'the compiler failed on the step (not for lack of memory): '
        f'{str(e).strip().splitlines()[0]}'
      ) from e
    return Compiled(None, refusal, time.perf_counter() - start, planned)
  planned.update(remat_said(said))
  seconds = time.perf_counter() - start
  return Compiled(compiled, None, seconds, planned, buffers, dumped)


_REMAT_LINE = re.compile(
  r"Can't reduce memory use below .*?\((\d+) bytes\).*?only reduced to .*?"
  r'\((\d+) bytes\).*?down from .*?\((\d+) bytes\)'
)


# What the report tells itself, so not passed on: rematerialization, and the
# GPU scheduler's complaint when the arguments alone exceed its budget.
_TOLD = re.compile(
  r"Can't reduce memory use below|input/output arguments .* exceeds the base limit"
)


def remat_said(lines: Sequence[str]) -> dict[str, Any]:
  """What XLA's rematerialization logged: the target it missed, what it
  reached and where it started (bytes), when it says so.

  Example:
    >>> remat_said(["W hlo_rematerialization.cc:3231] Can't reduce memory use "
    ...   'below 18.25GiB (19597518118 bytes) by rematerialization; only reduced '
    ...   'to 26.62GiB (28586803392 bytes), down from 45.09GiB (48411443392 '
    ...   'bytes) originally'])['remat_saved_bytes']
    19824640000
  """
  for line in lines:
    m = _REMAT_LINE.search(line)
    if m:
      target, reached, before = (int(g) for g in m.groups())
      return {
        'remat_target_bytes': target,
        'remat_reached_bytes': reached,
        'remat_saved_bytes': before - reached,
        'remat_message': line[line.index("Can't") :].strip(),
      }
  return {}


@contextlib.contextmanager
def _stderr_lines() -> Iterator[list[str]]:
  """What the compiler's C++ logging writes to the process's stderr while
  compiling, as lines; passed on afterwards, but for the lines the report
  itself tells (rematerialization)."""
  lines: list[str] = []
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):  # no real stderr (embedded): nothing to read
    yield lines
    return
  with tempfile.TemporaryFile() as sink:
    os.dup2(sink.fileno(), 2)
    try:
      yield lines
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      sink.seek(0)
      text = sink.read().decode(errors='replace')
      lines.extend(text.splitlines())
      rest = [ln for ln in lines if not _TOLD.search(ln)]
      if rest:
        sys.stderr.write('\n'.join(rest) + '\n')
