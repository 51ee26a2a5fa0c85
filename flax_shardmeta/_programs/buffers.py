"""XLA's buffer assignment of a compiled program: which value sits where in the
device's memory, and which are alive when the memory is fullest.

``memory_analysis()`` gives four sums; the buffer assignment behind them says
which values they are made of. XLA writes it, with each value's live range in
the schedule, when asked to dump a compilation (``xla_dump_to``): the files
``*after_optimizations-buffer-assignment.txt`` and ``*-live-range.txt``, the
same form on the CPU, for compile-only GPU targets and for compile-only TPU
topologies. :func:`compile_dumped` compiles with a dump into a temporary
folder; :func:`read_dump` reads it into a :class:`Buffers` record, small
enough to cache with the program's figures: the temporary allocations and
the values alive at the heap's peak.

Only the device's own memory counts (memory space 0): a TPU's VMEM and SMEM
(colors 1 and 2) are on-chip scratch, which ``memory_analysis()`` leaves out.

Example:
  >>> text = '''BufferAssignment:
  ... allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
  ...  value: <1 p @0> (size=64,offset=0): f32[16]{0}
  ... allocation 1: size 128, preallocated-temp:
  ...  value: <2 exp @0> (size=64,offset=0): f32[16]{0}
  ...  value: <3 add @0> (size=64,offset=64): f32[16]{0}
  ... '''
  >>> ranges = {'p{}': (0, 3), 'exp{}': (1, 2), 'add{}': (2, 3)}
  >>> buffers = from_texts(text, ranges, ['p', 'exp', 'add', 'root'])
  >>> buffers.temporaries, buffers.peak_time, [v.name for v in buffers.at_peak]
  (128, 2, ['add', 'exp'])
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

_ALLOCATION = re.compile(r'^allocation (\d+): size (\d+)(.*):\s*$')
_VALUE = re.compile(
  r'^\s+value: <(\d+) ([^\s{>]+)(\{[\d,]*\})? @(\d+)> '
  r'\(size=(\d+),offset=(\d+)\): (.*)$'
)
_COLOR = re.compile(r'\bcolor (\d+)\b')
_RANGE = re.compile(r'^\s+(\S+?)(\{[\d,]*\}):(\d+)-(\d+)\s*$')
_SEQUENCE = re.compile(r'^\s+(\d+):(\S+)\s*$')

DUMP_SUFFIX = 'after_optimizations-buffer-assignment.txt'
"""How the file XLA writes the buffer assignment of the optimised program ends."""


@dataclasses.dataclass(frozen=True)
class Value:
  """One value of the program, where the buffer assignment put it.

  Attributes:
    name: the instruction that defines it (``'fusion.4'``).
    index: its place in a tuple-shaped result, ``''`` for an array result
      (``'{0}'`` for the first element of a tuple).
    bytes: its size in memory, with the layout's padding.
    offset: where it starts in its allocation.
    shape: its shape with layout, as XLA writes it (``f32[512,512]{1,0}``).
    allocation: the allocation it sits in.
  """

  name: str
  index: str
  bytes: int
  offset: int
  shape: str
  allocation: int

  def to_list(self) -> list[Any]:
    """A compact JSON form: the cache keeps thousands of these."""
    return [self.name, self.index, self.bytes, self.offset, self.shape, self.allocation]

  @classmethod
  def from_list(cls, item: Sequence[Any]) -> Value:
    name, index, size, offset, shape, allocation = item
    return cls(
      str(name), str(index), int(size), int(offset), str(shape), int(allocation)
    )


@dataclasses.dataclass(frozen=True)
class Buffers:
  """The temporary memory of one device and what holds it at its peak.

  Attributes:
    temporaries: bytes of the temporary allocations in device memory: XLA's
      heap, the part of ``temp_size_in_bytes`` its buffer assignment shows.
    peak_time: the step of the schedule at which the temporaries alive take
      the most memory.
    at_peak: the temporaries alive then, largest first.
    peak_instruction: the instruction the schedule runs at ``peak_time``.
    live_bytes: bytes the values at the peak cover (overlapping values of one
      buffer counted once): ``temporaries - live_bytes`` is the heap's
      fragmentation and alignment at the peak.
  """

  temporaries: int
  peak_time: int
  at_peak: tuple[Value, ...]
  peak_instruction: str = ''
  live_bytes: int = 0

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form, as the figure cache keeps it."""
    return {
      'temporaries': self.temporaries,
      'peak_time': self.peak_time,
      'peak_instruction': self.peak_instruction,
      'live_bytes': self.live_bytes,
      'at_peak': [v.to_list() for v in self.at_peak],
    }

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> Buffers:
    """The record of :meth:`to_dict`'s form."""
    return cls(
      int(data['temporaries']),
      int(data['peak_time']),
      tuple(Value.from_list(v) for v in data['at_peak']),
      str(data.get('peak_instruction', '')),
      int(data.get('live_bytes', 0)),
    )


def parse_assignment(text: str) -> tuple[dict[int, tuple[int, str]], list[Value]]:
  """``(allocations, values)`` of a buffer assignment's text: per allocation
  number its size and flags (``'parameter 0, ...'``, ``'preallocated-temp'``),
  and every value with where it sits.

  Example:
    >>> allocs, values = parse_assignment(
    ...     'allocation 3: size 8, thread-local:\\n'
    ...     ' value: <7 add.1 @0> (size=4,offset=4): f32[]\\n')
    >>> allocs, values[0].name, values[0].offset
    ({3: (8, ' thread-local')}, 'add.1', 4)
  """
  allocations: dict[int, tuple[int, str]] = {}
  values: list[Value] = []
  current = None
  for line in text.splitlines():
    m = _ALLOCATION.match(line)
    if m:
      current = int(m.group(1))
      allocations[current] = (int(m.group(2)), m.group(3).lstrip(','))
      continue
    v = _VALUE.match(line)
    if v and current is not None:
      index = v.group(3) or ''
      values.append(
        Value(v.group(2), '' if index == '{}' else index, int(v.group(5)),
              int(v.group(6)), v.group(7).strip(), current)
      )  # fmt: skip
  return allocations, values


def is_temporary(flags: str) -> bool:
  """Whether an allocation of these flags is temporary device memory: not an
  argument, an output, a constant or a thread's scratch, and in memory space 0.

  Example:
    >>> is_temporary(' preallocated-temp'), is_temporary(' color 1, preallocated-temp')
    (True, False)
  """
  color = _COLOR.search(flags)
  if color is not None and color.group(1) != '0':
    return False
  kept_out = (
    'parameter ',
    'output shape',
    'maybe-live-out',
    'constant',
    'thread-local',
  )
  return not any(word in flags for word in kept_out)


def parse_live_ranges(text: str) -> tuple[dict[str, tuple[int, int]], list[str]]:
  """``(ranges, sequence)`` of a live-range dump: per value (``'dot.3{}'``)
  its first and last step of the schedule, and the instructions by step."""
  ranges: dict[str, tuple[int, int]] = {}
  sequence: list[str] = []
  section = ''
  for line in text.splitlines():
    stripped = line.strip()
    if stripped.endswith(':') and not stripped[0].isdigit():
      section = stripped
      continue
    if section == 'InstructionSequence:':
      m = _SEQUENCE.match(line)
      if m:
        sequence.append(m.group(2))
    elif section == 'BufferLiveRange:':
      m = _RANGE.match(line)
      if m:
        ranges[m.group(1) + m.group(2)] = (int(m.group(3)), int(m.group(4)))
  return ranges, sequence


def from_texts(
  assignment: str, ranges: dict[str, tuple[int, int]], sequence: Sequence[str] = ()
) -> Buffers:
  """The :class:`Buffers` of a buffer assignment's text and its live ranges."""
  allocations, values = parse_assignment(assignment)
  temp = {n for n, (_, flags) in allocations.items() if is_temporary(flags)}
  heap = [v for v in values if v.allocation in temp]
  total = sum(allocations[n][0] for n in temp)
  spans = {id(v): ranges.get(f'{v.name}{v.index or "{}"}') for v in heap}
  peak_time = _peak_time(heap, spans)

  def alive_then(v: Value) -> bool:
    span = spans[id(v)]
    return span is not None and span[0] <= peak_time <= span[1]

  alive = [v for v in heap if alive_then(v)]
  alive.sort(key=lambda v: (-v.bytes, v.name))
  at = sequence[peak_time] if 0 <= peak_time < len(sequence) else ''
  return Buffers(total, peak_time, tuple(alive), at, covered_bytes(alive))


def _peak_time(heap: Sequence[Value], spans: dict[int, tuple[int, int] | None]) -> int:
  """The step at which the live values cover the most bytes. The values of
  one buffer (an in-place update, an async pair) share their place: a place
  counts once however many of its values are alive."""
  events: list[tuple[int, int, tuple[int, int, int]]] = []
  for v in heap:
    span = spans[id(v)]
    if span is not None:
      place = (v.allocation, v.offset, v.bytes)
      events += [(span[0], 1, place), (span[1] + 1, -1, place)]
  events.sort(key=lambda e: (e[0], e[1]))  # at one step, frees before starts
  holders: dict[tuple[int, int, int], int] = {}
  live, best, peak_time, i = 0, -1, 0, 0
  while i < len(events):
    time = events[i][0]
    while i < len(events) and events[i][0] == time:
      _, change, place = events[i]
      before = holders.get(place, 0)
      holders[place] = before + change
      if before == 0 and change > 0:
        live += place[2]
      elif before == 1 and change < 0:
        live -= place[2]
      i += 1
    if live > best:
      peak_time, best = time, live
  return peak_time


def covered_bytes(values: Sequence[Value]) -> int:
  """Bytes the values cover in their allocations, overlaps counted once (the
  values of one buffer share its bytes).

  Example:
    >>> a = Value('a', '', 64, 0, 'f32[16]', 1)
    >>> b = Value('b', '', 64, 32, 'f32[16]', 1)
    >>> covered_bytes([a, b])
    96
  """
  total = 0
  by_allocation: dict[int, list[tuple[int, int]]] = {}
  for v in values:
    by_allocation.setdefault(v.allocation, []).append((v.offset, v.offset + v.bytes))
  for spans in by_allocation.values():
    end = -1
    for start, stop in sorted(spans):
      if stop <= end:
        continue
      total += stop - max(start, end)
      end = stop
  return total


def read_dump(folder: str) -> Buffers | None:
  """The :class:`Buffers` XLA's dump in ``folder`` holds for its one program,
  or None where it wrote no buffer assignment (a backend that does not dump)."""
  found = sorted(glob.glob(os.path.join(folder, f'*{DUMP_SUFFIX}')))
  if not found:
    return None
  # One program per dump folder; of several, the last compiled is the step.
  path = found[-1]
  live = path.replace(DUMP_SUFFIX, 'after_optimizations-live-range.txt')
  with open(path) as f:
    assignment = f.read()
  ranges, sequence = {}, []
  if os.path.exists(live):
    with open(live) as f:
      ranges, sequence = parse_live_ranges(f.read())
  return from_texts(assignment, ranges, sequence)


def dumped_program(folder: str) -> str | None:
  """The optimised program XLA's dump in ``folder`` holds, the one its
  buffer assignment is of (None where there is none). ``Compiled.as_text()``
  is the same program on most backends; where it is not (jax 0.12's CUDA
  plugin), the buffer assignment's values are named as here."""
  found = sorted(glob.glob(os.path.join(folder, f'*{DUMP_SUFFIX}')))
  if not found:
    return None
  path = found[-1].replace(DUMP_SUFFIX, 'after_optimizations.txt')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return f.read()


def dump_options(folder: str) -> dict[str, Any]:
  """Compile options that make XLA write its buffer assignment into ``folder``
  (``lowered.compile(compiler_options=...)``: this compile only, whatever
  ``XLA_FLAGS`` say)."""
  return {'xla_dump_to': folder, 'xla_dump_hlo_as_text': True}


@contextlib.contextmanager
def dump_folder() -> Iterator[str]:
  """A temporary folder for one compilation's dump, removed afterwards."""
  folder = tempfile.mkdtemp(prefix='fsm-xla-dump-')
  try:
    yield folder
  finally:
    shutil.rmtree(folder, ignore_errors=True)


def compile_dumped(lowered: Any, **options: Any) -> tuple[Any, Buffers | None]:
  """``lowered.compile()`` with XLA's dump on: the compiled program and its
  :class:`Buffers` (None where the backend wrote none). ``options`` are
  further compile options.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> lowered = jax.jit(lambda x: jnp.sin(x) @ x.T).lower(jnp.ones((64, 64)))
    >>> compiled, buffers = compile_dumped(lowered)
    >>> buffers is None or buffers.temporaries >= 0
    True
  """
  with dump_folder() as folder:
    compiled = lowered.compile({**options, **dump_options(folder)})
    return compiled, read_dump(folder)
