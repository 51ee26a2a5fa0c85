"""Per-device figures of accelerator generations, for verdicts and rooflines.

``fit`` judges a program against the memory of the device it was compiled
for and turns XLA's cost figures into a step-time estimate. Both need a few
numbers per device: the usable HBM, peak bf16 throughput, HBM bandwidth and
interconnect bandwidth. They come from the vendors' published specifications
(Google Cloud TPU system-architecture pages; NVIDIA data sheets), divided by
the devices JAX makes of one chip (2 for TPU7x, whose TensorCores are separate
devices). HBM of TPUs is what the compiler itself reports as available when
it refuses a program ("exceeds available HBM (95.74G)" on v5p), so the verdict
agrees with the compiler's own.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from flax_shardmeta._errors import FitError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """Published figures of one accelerator generation, per JAX device.

  Attributes:
    name: short name, e.g. ``'v5p'``.
    device_kind: what ``jax.Device.device_kind`` reports, e.g. ``'TPU v5'``.
    hbm_bytes: usable HBM per device.
    peak_flops: peak bf16 FLOP/s per device (dense).
    hbm_bandwidth: HBM bytes/s per device.
    ici_bandwidth: interconnect bytes/s per device along one mesh axis: the
      chip's bidirectional ICI (NVLink) bandwidth over its torus dimensions
      and over the devices per chip.
    dcn_bandwidth: data-centre network bytes/s per device (between slices).
    devices_per_chip: JAX devices one chip is split into.

  Example:
    >>> from flax_shardmeta._capacity.chips import chip_named
    >>> v5p = chip_named('v5p')
    >>> round(v5p.hbm_bytes / 2**30, 2), v5p.peak_flops / 1e12
    (95.74, 459.0)
  """

  name: str
  device_kind: str
  hbm_bytes: int
  peak_flops: float
  hbm_bandwidth: float
  ici_bandwidth: float
  dcn_bandwidth: float
  devices_per_chip: int = 1

  def to_dict(self) -> dict[str, float | int | str]:
    """JSON-ready form."""
    return dataclasses.asdict(self)


def _tpu(
  name: str,
  kind: str,
  hbm_gib: float,
  tflops: float,
  hbm_gbps: float,
  ici_gbps: float,
  torus_dims: int,
  dcn_gbps: float,
  devices: int = 1,
) -> Chip:
  # Per chip in, per device out; ICI is split over the torus dimensions
  # because a collective over one mesh axis uses that axis's links only.
  return Chip(
    name,
    kind,
    int(hbm_gib * GIB),
    tflops * 1e12 / devices,
    hbm_gbps * 1e9 / devices,
    ici_gbps * 1e9 / torus_dims / devices,
    dcn_gbps * 1e9 / devices,
    devices,
  )


CHIPS: tuple[Chip, ...] = (
  # name, device_kind, usable HBM GiB per device (compiler), bf16 TFLOP/s,
  # HBM GB/s, bidirectional ICI GB/s, torus dims, DCN GB/s (all per chip).
  _tpu('v4', 'TPU v4', 30.75, 275, 1200, 540, 3, 6.25),
  _tpu('v5e', 'TPU v5 lite', 15.75, 197, 819, 400, 2, 3.125),
  _tpu('v5p', 'TPU v5', 95.74, 459, 2765, 1200, 3, 6.25),
  _tpu('v6e', 'TPU v6 lite', 31.25, 918, 1638, 800, 2, 6.25),
  _tpu('tpu7x', 'TPU7x', 2 * 94.75, 2307, 7380, 1200, 3, 12.5, devices=2),
  # GPUs, for estimates on abstract meshes (nothing compiles for them here):
  # one NVLink domain counts as one "torus dimension"; DCN is 400 Gb/s a GPU.
  Chip(
    'a100', 'NVIDIA A100-SXM4-80GB', int(79.15 * GIB), 312e12, 2.039e12, 300e9, 50e9
  ),
  Chip('h100', 'NVIDIA H100 80GB HBM3', int(79.11 * GIB), 989e12, 3.35e12, 450e9, 50e9),
  Chip('b200', 'NVIDIA B200', int(178.4 * GIB), 2250e12, 8.0e12, 900e9, 50e9),
)
"""The generations ``fit`` knows, per device. TPUs: v4, v5e, v5p, v6e and
TPU7x (what libtpu compiles for); GPUs for estimates only."""

# TPU7x's HBM above is per chip; per device it is half, as the compiler says.
CHIPS = tuple(
  dataclasses.replace(c, hbm_bytes=c.hbm_bytes // c.devices_per_chip) for c in CHIPS
)


def chip_named(name: str) -> Chip | None:
  """The chip of a short name (``'v5p'``) or device kind (``'TPU v5'``).

  Example:
    >>> chip_named('TPU v5 lite').name, chip_named('H100').name
    ('v5e', 'h100')
  """
  key = name.strip().lower()
  for c in CHIPS:
    if key in (c.name, c.device_kind.lower()):
      return c
  return None


def chip_of(devices: object) -> Chip | None:
  """The chip of a device list (or mesh): the first device's kind, if known."""
  flat: Any = getattr(devices, 'devices', devices)
  flat = getattr(flat, 'flat', flat)
  try:
    first = next(iter(flat))
  except (TypeError, StopIteration):
    return None
  kind = getattr(first, 'device_kind', None)
  return chip_named(kind) if isinstance(kind, str) else None


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
    FitError: for anything else.

  Example:
    >>> parse_bytes('95GiB'), parse_bytes('1.5 GB'), parse_bytes(1024)
    (102005473280, 1500000000, 1024)
  """
  if isinstance(text, (int, float)):
    return int(text)
  match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*', text)
  unit = match.group(2).lower() if match else None
  if match is None or unit not in _UNITS:
    raise FitError(
      f'{text!r} is not a size; write a number of bytes with an optional unit, '
      "e.g. '95GiB', '16GB' or '512MiB'"
    )
  return int(float(match.group(1)) * _UNITS[unit])
