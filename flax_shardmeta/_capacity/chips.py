"""Per-device figures of accelerator generations, for verdicts and rooflines.

``fit`` judges a program against the memory of the device it was compiled
for and turns XLA's cost figures into a step-time estimate. Both need a few
numbers per device: the usable HBM, peak bf16 throughput, HBM bandwidth and
interconnect bandwidth. They come from the vendors' published specifications
(Google Cloud TPU system-architecture pages; NVIDIA data sheets, each GPU's
row saying which), divided by
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
    source: where the figures come from.

  On GPUs the interconnect is NVLink inside a node (``ici_bandwidth``, per
  direction) and the cluster network across nodes (``dcn_bandwidth``, per
  GPU and direction); ``hbm_bytes`` is the memory CUDA reports.

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
  source: str = ''

  def to_dict(self) -> dict[str, float | int | str]:
    """JSON-ready form."""
    return dataclasses.asdict(self)


# GPUs, per GPU: (name, device_kind as the target config's device_description_str,
# memory bytes as CUDA reports it (totalGlobalMem, the verdict's figure; it is
# the config's device_memory_size), dense bf16 FLOP/s, HBM B/s, NVLink B/s per
# direction, network B/s per direction, source).
_GPU_TABLE = (
  (
    'a100',
    'NVIDIA A100-SXM4-80GB',
    85100068864,
    312e12,
    2.039e12,
    300e9,
    25e9,
    'NVIDIA A100 datasheet (80GB SXM: 312 TFLOPS bf16 dense, 2,039 GB/s, '
    'NVLink 600 GB/s); DGX A100: one 200 Gb/s HDR port per GPU; memory: '
    "CUDA's totalGlobalMem as in XLA's a100_sxm_80 spec",
  ),
  (
    'h100',
    'NVIDIA H100 80GB HBM3',
    84942979072,
    989e12,
    3.35e12,
    450e9,
    50e9,
    'NVIDIA H100 datasheet (SXM: 989 TFLOPS bf16 dense, half the 1,979 '
    'sparse; 3.35 TB/s; NVLink 900 GB/s); DGX H100: one 400 Gb/s NDR port '
    "per GPU; memory: XLA's h100_sxm spec",
  ),
  (
    'h200',
    'NVIDIA H200',
    150754820096,
    989e12,
    4.8e12,
    450e9,
    50e9,
    'NVIDIA H200 datasheet (SXM: 989 TFLOPS bf16 dense, 4.8 TB/s, NVLink '
    '900 GB/s); HGX H200: 400 Gb/s per GPU; memory: nvidia-smi memory.total '
    '(143,771 MiB; the datasheet says 141 GB)',
  ),
  (
    'b200',
    'NVIDIA B200',
    191514411008,
    2250e12,
    8.0e12,
    900e9,
    50e9,
    'NVIDIA DGX B200 / HGX B200 datasheet (2.25 PFLOPS bf16 dense per GPU, '
    '8 TB/s, NVLink 5 1.8 TB/s); DGX B200: 400 Gb/s per GPU; memory: '
    "XLA's b200 spec",
  ),
)


def _gpu(
  name: str,
  kind: str,
  memory: int,
  flops: float,
  hbm: float,
  nvlink: float,
  network: float,
  source: str,
) -> Chip:
  return Chip(name, kind, memory, flops, hbm, nvlink, network, 1, source)


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
    'Google Cloud TPU system architecture pages; HBM as the compiler reports it',
  )


CHIPS: tuple[Chip, ...] = (
  # name, device_kind, usable HBM GiB per device (compiler), bf16 TFLOP/s,
  # HBM GB/s, bidirectional ICI GB/s, torus dims, DCN GB/s (all per chip).
  _tpu('v4', 'TPU v4', 30.75, 275, 1200, 540, 3, 6.25),
  _tpu('v5e', 'TPU v5 lite', 15.75, 197, 819, 400, 2, 3.125),
  _tpu('v5p', 'TPU v5', 95.74, 459, 2765, 1200, 3, 6.25),
  _tpu('v6e', 'TPU v6 lite', 31.25, 918, 1638, 800, 2, 6.25),
  _tpu('tpu7x', 'TPU7x', 2 * 94.75, 2307, 7380, 1200, 3, 12.5, devices=2),
  # GPUs: one device per GPU, compiled for through jax's CUDA plugin (gpu.py).
  *(_gpu(*row) for row in _GPU_TABLE),
)
"""The generations ``fit`` knows, per device. TPUs: v4, v5e, v5p, v6e and
TPU7x (what libtpu compiles for); GPUs: A100, H100, H200 and B200 (what the
project's GPU descriptions compile for)."""

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
