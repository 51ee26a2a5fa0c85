"""What a step keeps in host memory: per chip, per host, and against the
host's RAM.

A step offloads by asking for host memory: arguments or outputs laid out
with a host memory kind (``pinned_host``: optimizer state, master weights)
and values a remat policy offloads by name. XLA counts them apart from the
chip's memory (``host_argument_size_in_bytes`` and the like); combined as
the device figures are, they are what each chip keeps on its host, and a
host holds that for each of its chips. The host's RAM is the machine type's
(:data:`HOST_RAM`, by chip), or what ``fit(host_memory=...)`` says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from flax_shardmeta._units import format_seconds, signed_bytes

_GIB = 2**30

HOST_RAM: dict[str, tuple[int, int, str]] = {
  # chip -> (RAM of one VM, chips that VM drives, where the figure is from).
  # Compute Engine lists machine memory in "GB" of 2**30 bytes (memoryMb / 1024).
  'v4': (407 * _GIB, 4, 'Compute Engine machine type ct4p-hightpu-4t: 407 GB'),
  'v5e': (384 * _GIB, 8, 'Compute Engine machine type ct5lp-hightpu-8t: 384 GB'),
  'v5p': (
    448 * _GIB,
    4,
    'Cloud TPU docs, ct5p-hightpu-4t: 448 GB per 4-chip VM (half of it under NUMA '
    'binding)',
  ),
  'v6e': (1440 * _GIB, 8, 'Compute Engine machine type ct6e-standard-8t: 1440 GB'),
  'tpu7x': (960 * _GIB, 4, 'Cloud TPU docs, tpu7x-standard-4t: 960 GB per 4-chip VM'),
  'a100': (1360 * _GIB, 8, 'Compute Engine machine type a2-ultragpu-8g: 1360 GB'),
  'h100': (1872 * _GIB, 8, 'Compute Engine machine type a3-megagpu-8g: 1872 GB'),
  'h200': (2952 * _GIB, 8, 'Compute Engine machine type a3-ultragpu-8g: 2952 GB'),
  'b200': (3968 * _GIB, 8, 'Compute Engine machine type a4-highgpu-8g: 3968 GB'),
}
"""The host RAM fit checks against by default, per chip name."""

HOST_LINK: dict[str, tuple[float, str]] = {
  # chip -> (host <-> device bytes/s per direction, where the figure is from).
  'a100': (32e9, 'PCIe Gen4 x16: 32 GB/s each way (A100 datasheet: 64 GB/s both ways)'),
  **{
    name: (
      64e9,
      'PCIe Gen5 x16: 64 GB/s each way (datasheet: 128 GB/s both ways; MLPerf '
      'system descriptions: PCIe Gen5 x16)',
    )
    for name in ('h100', 'h200', 'b200')
  },
}
"""The host link's bandwidth per chip name; TPUs publish none."""

KINDS = ('argument', 'output', 'offloaded activations', 'host temporaries')


@dataclasses.dataclass(frozen=True)
class HostRow:
  """One thing a chip keeps in host memory.

  Attributes:
    kind: one of :data:`KINDS`.
    what: an argument's path (``opt_state/0/mu/w``), an output's, or the
      names a remat policy offloads (``'x', 'mlpwi'``).
    where: the user's lines of those names' ``checkpoint_name`` calls.
    bytes: bytes per chip.

  Example:
    >>> row = HostRow('argument', 'state/opt_state/0/mu/w', '', 4 * 2**20)
    >>> row.to_dict()['kind'], row.bytes // 2**20
    ('argument', 4)
  """

  kind: str
  what: str
  where: str
  bytes: int

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class HostMemory:
  """What one step keeps in host memory, and whether each host has room.

  Attributes:
    per_chip_bytes: host argument + host output - host alias + host
      temporaries, per chip (XLA's host figures, combined as the device ones).
    rows: what those bytes are, largest first; they add up to
      ``per_chip_bytes`` (XLA's alias is taken off the outputs).
    chips_per_host: the devices one host drives, as the mesh's devices say.
    hosts: how many hosts the mesh spans.
    capacity_bytes: the host RAM judged against, if known.
    capacity_source: where that figure is from.
    method: how the host figures were made.

  Example:
    >>> h = HostMemory(2**30, (HostRow('argument', 'opt_state/mu', '', 2**30),), 4, 2,
    ...                448 * 2**30, 'ct5p-hightpu-4t', "XLA's host figures")
    >>> h.per_host_bytes == 4 * 2**30, h.fits
    (True, True)
  """

  per_chip_bytes: int
  rows: tuple[HostRow, ...]
  chips_per_host: int
  hosts: int
  capacity_bytes: int | None
  capacity_source: str
  method: str
  to_device_bytes: int = 0
  to_host_bytes: int = 0
  link_bandwidth: float | None = None
  link_source: str = ''
  overlapped: bool | None = None

  @property
  def transfer_s(self) -> float | None:
    """Seconds of host transfers per step at the link's bandwidth, both
    directions at once (None: the link's bandwidth is unknown)."""
    if self.link_bandwidth is None:
      return None
    return max(self.to_device_bytes, self.to_host_bytes) / self.link_bandwidth

  @property
  def per_host_bytes(self) -> int:
    """What each host holds for its chips."""
    return self.per_chip_bytes * self.chips_per_host

  @property
  def fits(self) -> bool | None:
    """Whether each host has room (None: the host RAM is unknown)."""
    if self.capacity_bytes is None:
      return None
    return self.per_host_bytes <= self.capacity_bytes

  def verdict(self) -> str:
    """One line: the host side's verdict."""
    held = (
      f'{signed_bytes(self.per_host_bytes)} per host ({self.chips_per_host} chips x '
      f'{signed_bytes(self.per_chip_bytes)})'
    )
    if self.capacity_bytes is None:
      return (
        f'host memory: {held}; unchecked: no host RAM known for these devices '
        "(pass host_memory=..., e.g. '448GiB')"
      )
    room = self.capacity_bytes - self.per_host_bytes
    ram = f'{signed_bytes(self.capacity_bytes)} ({self.capacity_source})'
    if room >= 0:
      return f'host memory: {held}, fits, headroom {signed_bytes(room)} of {ram}'
    return f'host memory: {held}, DOES NOT FIT: {signed_bytes(-room)} over the {ram}'

  def lines(self) -> list[str]:
    """The host side as report lines."""
    out = [self.verdict()]
    if self.to_device_bytes or self.to_host_bytes:
      out.append(f'  transfers per step and chip: {self.transfer_words()}')
    for r in self.rows:
      where = f' at {r.where}' if r.where else ''
      out.append(f'  {r.kind}: {r.what}{where}: {signed_bytes(r.bytes)} per chip')
    return out

  def transfer_words(self) -> str:
    """The host transfers of a step, their time and overlap, in words."""
    moved = (
      f'{signed_bytes(self.to_device_bytes)} to the chip, '
      f'{signed_bytes(self.to_host_bytes)} to the host'
    )
    if self.transfer_s is None:
      return f'{moved}; {self.time_words()}'
    return f'{moved}: {self.time_words()}'

  def time_words(self) -> str:
    """The transfers' time at the host link and their overlap, in words."""
    if self.transfer_s is None:
      return 'no published host link bandwidth for these chips: time unknown'
    overlap = {
      True: "asynchronous in XLA's schedule (they can overlap compute)",
      False: "synchronous in XLA's schedule (they add to the step)",
      None: 'overlap unknown',
    }[self.overlapped]
    return f'{format_seconds(self.transfer_s)} at {self.link_source}; {overlap}'

  def to_dict(self) -> dict[str, Any]:
    return {
      'per_chip_bytes': self.per_chip_bytes,
      'to_device_bytes': self.to_device_bytes,
      'to_host_bytes': self.to_host_bytes,
      'transfer_s': self.transfer_s,
      'link_source': self.link_source,
      'overlapped': self.overlapped,
      'per_host_bytes': self.per_host_bytes,
      'chips_per_host': self.chips_per_host,
      'hosts': self.hosts,
      'capacity_bytes': self.capacity_bytes,
      'capacity_source': self.capacity_source,
      'fits': self.fits,
      'method': self.method,
      'rows': [r.to_dict() for r in self.rows],
    }


def host_capacity(
  chip_name: str | None, chips_per_host: int, given: int | None
) -> tuple[int | None, str]:
  """The host RAM to judge against and where it is from: ``given``
  (``host_memory=``), else the chip's machine type, scaled to the chips a
  host drives here; ``(None, '')`` when neither is known."""
  if given is not None:
    return given, 'host_memory='
  known = HOST_RAM.get(chip_name or '')
  if known is None:
    return None, ''
  ram, chips, source = known
  if chips == chips_per_host:
    return ram, source
  return (
    ram * chips_per_host // chips,
    f'{source}, for {chips_per_host} of its {chips} chips',
  )


def host_rows(
  memory: Any,
  inputs: Sequence[Sequence[Any]],
  output_bytes: Sequence[Sequence[Any]],
  aliases: dict[int, int],
  offloaded: Sequence[tuple[str, str]] = (),
) -> tuple[HostRow, ...]:
  """What each chip keeps on its host, row by row, adding up to XLA's host
  figures (``memory``: a ``ProgramMemory``). ``inputs``: ``(path, bytes per
  chip, on the host)`` per input leaf; ``output_bytes``: ``(bytes, on the
  host)`` per output leaf; ``offloaded``: ``(name, line)`` of each value a
  remat policy offloads."""
  rows = [
    HostRow('argument', path, '', int(size)) for path, size, hosted in inputs if hosted
  ]
  rows += [
    HostRow('output', f'output[{i}]', '', int(b))
    for i, (b, h) in enumerate(output_bytes)
    if h and i not in aliases and int(b)
  ]
  held = sum(r.bytes for r in rows)
  left = memory.host_arguments + memory.host_outputs - memory.host_aliased - held
  temps = memory.host_temporaries
  if offloaded and temps:
    names = ', '.join(dict.fromkeys(repr(n) for n, _ in offloaded))
    lines = ', '.join(dict.fromkeys(at for _, at in offloaded if at))
    rows.append(HostRow('offloaded activations', names, lines, temps))
  elif temps:
    rows.append(
      HostRow('host temporaries', 'values the program moves to the host', '', temps)
    )
  if left:  # what XLA counts beyond the leaves' own bytes (padding, layout)
    rows.append(HostRow('argument', 'bytes XLA adds to the host arguments', '', left))
  return tuple(sorted(rows, key=lambda r: -r.bytes))


def transfers(memory: Any) -> tuple[int, int]:
  """``(to the chip, to the host)`` bytes per step and chip: host arguments
  are read and host outputs written once a step, and an offloaded value goes
  out in the forward pass and back in the backward pass."""
  temps = memory.host_temporaries
  return memory.host_arguments + temps, memory.host_outputs + temps
