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

On GPUs the memory is what CUDA reports, and collectives are timed at the bus
bandwidth NCCL reaches (the ``busbw`` of nccl-tests), not at the link's peak:
NVLink and InfiniBand lose about a fifth of their line rate to protocol
overhead, and the peak of each link is kept beside it for reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
      chip's bidirectional ICI bandwidth over its torus dimensions and over
      the devices per chip; on GPUs NVLink's peak per direction.
    dcn_bandwidth: data-centre network bytes/s per device (between slices);
      on GPUs the cluster network's peak per GPU and direction.
    devices_per_chip: JAX devices one chip is split into.
    source: where the figures come from.
    ici_bus_bandwidth: the bus bandwidth collectives reach over the ICI or
      NVLink (nccl-tests' ``busbw``), or None where the link's figure is used.
    dcn_bus_bandwidth: the same over the network, or None.

  On GPUs the interconnect is NVLink inside a node and the cluster network
  across nodes; both carry a peak (``ici_bandwidth``, ``dcn_bandwidth``) and
  the bus bandwidth NCCL reaches on it (``ici_bus_bandwidth``,
  ``dcn_bus_bandwidth``), which collectives are timed at
  (:meth:`collective_bandwidth`). ``hbm_bytes`` is the memory CUDA reports.

  Example:
    >>> import flax_shardmeta as fsm
    >>> v5p = fsm.chip_named('v5p')
    >>> round(v5p.hbm_bytes / 2**30, 2), v5p.peak_flops / 1e12
    (95.74, 459.0)
    >>> h100 = fsm.chip_named('h100')
    >>> h100.ici_bandwidth / 1e9, h100.collective_bandwidth(crosses_slices=False) / 1e9
    (450.0, 360.0)
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
  ici_bus_bandwidth: float | None = None
  dcn_bus_bandwidth: float | None = None

  @property
  def is_gpu(self) -> bool:
    """Whether this is a GPU (options of jax's GPU allocator apply to it).

    Example:
      >>> chip_named('h100').is_gpu, chip_named('v5p').is_gpu
      (True, False)
    """
    return self.device_kind.startswith('NVIDIA')

  def collective_bandwidth(self, crosses_slices: bool) -> float:
    """Bytes/s per device a collective is timed at: over the network when its
    groups cross slices (nodes), else over the ICI (NVLink); the bus bandwidth
    reached where known, else the link's own figure.

    Example:
      >>> chip_named('v5p').collective_bandwidth(crosses_slices=True) / 1e9
      6.25
      >>> chip_named('h100').collective_bandwidth(crosses_slices=True) / 1e9
      46.0
    """
    if crosses_slices:
      bus, link = self.dcn_bus_bandwidth, self.dcn_bandwidth
    else:
      bus, link = self.ici_bus_bandwidth, self.ici_bandwidth
    return link if bus is None else bus

  def to_dict(self) -> dict[str, float | int | str | None]:
    """JSON-ready form."""
    return dataclasses.asdict(self)


def _gpu(
  name: str,
  kind: str,
  *,
  memory: int,
  flops: float,
  hbm: float,
  nvlink: float,
  nvlink_bus: float,
  network: float,
  network_bus: float,
  source: str,
) -> Chip:
  return Chip(
    name, kind, memory, flops, hbm, nvlink, network, 1, source, nvlink_bus, network_bus
  )


# GPUs, per GPU. memory: what CUDA reports (cudaDeviceProp::totalGlobalMem, as
# cudaGetDeviceProperties and torch.cuda.get_device_properties give it, and
# the total jax's allocator takes its fraction of); it is the description's
# device_memory_size (gpu_targets/*.txtpb), nvidia-smi's memory.total being
# 0.5-0.7 GiB more. hbm: the description's memory_bandwidth. nvlink / network:
# the link's peak per direction (nvlink, network) and the bus bandwidth NCCL
# reaches on it per GPU (nvlink_bus, network_bus: nccl-tests' busbw at large
# sizes, ring algorithms), which collectives are timed at.
_GPUS = (
  _gpu(
    'a100',
    'NVIDIA A100-SXM4-80GB',
    # CUDA's totalGlobalMem, as in XLA's a100_sxm_80 spec (79.26 GiB).
    memory=85100068864,
    # A100 datasheet (80GB SXM): 312 TFLOPS bf16 dense, 2,039 GB/s.
    flops=312e12,
    hbm=2.039e12,
    # 12 NVLink 3 links, 600 GB/s both ways (datasheet); NCCL reaches
    # ~230 GB/s busbw: NVIDIA/nccl-tests issue #149 (sjeaugey: 25 GB/s per
    # link and direction, ~20 GB/s effective, "~230GB/s" on A100).
    nvlink=300e9,
    nvlink_bus=230e9,
    # DGX A100: one 200 Gb/s HDR port per GPU; "the peak for 200G HDR is
    # 24GB/s" (NVIDIA/nccl issue #412, sjeaugey), and a DGX A100 with 8 HDR
    # cards measures 192 GB/s all-reduce busbw (NVIDIA/nccl issue #812).
    network=25e9,
    network_bus=24e9,
    source='NVIDIA A100 datasheet (80GB SXM: 312 TFLOPS bf16 dense, 2,039 GB/s, '
    'NVLink 600 GB/s); DGX A100: one 200 Gb/s HDR port per GPU; bus bandwidth '
    'NCCL reaches: NVIDIA/nccl-tests #149 (NVLink 230 GB/s), NVIDIA/nccl #412 '
    "and #812 (HDR 24 GB/s); memory: CUDA's totalGlobalMem as in XLA's "
    'a100_sxm_80 spec',
  ),
  _gpu(
    'h100',
    'NVIDIA H100 80GB HBM3',
    # CUDA's totalGlobalMem, as in XLA's h100_sxm spec (81,008 MiB, 79.11 GiB;
    # nvidia-smi says 81,559 MiB).
    memory=84942979072,
    # H100 datasheet (SXM): 989 TFLOPS bf16 dense (1,979 is sparse), 3.35 TB/s.
    flops=989e12,
    hbm=3.35e12,
    # 18 NVLink 4 links, 900 GB/s both ways (datasheet). "450GB/s is the line
    # rate. With the protocol overhead (~20%) NCCL can get an effective NVLink
    # bandwidth of 370GB/s" as busbw (NVIDIA/nccl-tests issue #212,
    # sjeaugey); "360 GB/s is exactly what we'd expect on H100" for
    # all_gather and all_reduce busbw (NVIDIA/nccl-tests issue #326).
    nvlink=450e9,
    nvlink_bus=360e9,
    # DGX H100: one 400 Gb/s NDR port per GPU; "For NDR @ 400Gbps you should
    # see 46-48GB/s per NIC" (NVIDIA/nccl-tests issue #290, AddyLaddy): the
    # low end of that range.
    network=50e9,
    network_bus=46e9,
    source='NVIDIA H100 datasheet (SXM: 989 TFLOPS bf16 dense, half the 1,979 '
    'sparse; 3.35 TB/s; NVLink 900 GB/s); DGX H100: one 400 Gb/s NDR port '
    'per GPU; bus bandwidth NCCL reaches: NVIDIA/nccl-tests #212 and #326 '
    "(NVLink 360 GB/s), #290 (NDR 46 GB/s); memory: XLA's h100_sxm spec",
  ),
  _gpu(
    'h200',
    'NVIDIA H200',
    # CUDA's totalGlobalMem on H200 SXM: 150,109,880,320 B (143,155.94 MiB,
    # 139.80 GiB), as torch.cuda.get_device_properties(0).total_memory and
    # cudaMemGetInfo report it in published H200 runs, and as PyTorch's
    # out-of-memory message rounds it ("GPU 5 has a total capacity of 139.80
    # GiB" on 8xH200 in PrimeIntellect-ai/prime-rl benchmarks/results/
    # BENCHMARKS.md, which gives the B200 178.36 GiB, its figure below).
    # nvidia-smi's memory.total is 143,771 MiB; XLA's h200 spec has 141 GiB.
    memory=150109880320,
    # H200 datasheet (SXM): 989 TFLOPS bf16 dense, 4.8 TB/s.
    flops=989e12,
    hbm=4.8e12,
    # NVLink 4 as on H100, 900 GB/s both ways (datasheet), and NCCL reaches
    # the same: H200 nodes measure H100's NVLink-SHARP all-reduce busbw (475
    # GB/s, NVIDIA/nccl-tests issue #272; ~480 on H100, #212), so the ring
    # busbw of H100 (360 GB/s, #212 and #326) applies.
    nvlink=450e9,
    nvlink_bus=360e9,
    # HGX H200: one 400 Gb/s NDR port per GPU, 46-48 GB/s busbw per NIC
    # (NVIDIA/nccl-tests issue #290).
    network=50e9,
    network_bus=46e9,
    source='NVIDIA H200 datasheet (SXM: 989 TFLOPS bf16 dense, 4.8 TB/s, NVLink '
    '900 GB/s); HGX H200: 400 Gb/s per GPU; bus bandwidth NCCL reaches: as '
    "H100 (NVIDIA/nccl-tests #212, #272, #326, #290); memory: CUDA's "
    'totalGlobalMem (139.80 GiB; the datasheet says 141 GB, nvidia-smi '
    '143,771 MiB)',
  ),
  _gpu(
    'b200',
    'NVIDIA B200',
    # CUDA's totalGlobalMem, as in XLA's b200 spec (178.36 GiB; PyTorch's
    # "total capacity of 178.36 GiB" on 8xB200 in PrimeIntellect-ai/prime-rl
    # benchmarks/results/BENCHMARKS.md; nvidia-smi says 183,359 MiB).
    memory=191514411008,
    # DGX/HGX B200 datasheet: 2.25 PFLOPS bf16 dense per GPU.
    flops=2250e12,
    # 7.67 TB/s: the 7,680-bit HBM3e bus CUDA reports at 3,996 MHz, x2 (DDR),
    # as in XLA's b200 spec and pytorch/ao PR #4002 ("update b200 peak memory
    # bandwidth": the driver's bus width went from 8,192 to 7,680 bits); the
    # datasheet's "up to 8 TB/s" counts 8,192 bits.
    hbm=7.67232e12,
    # 18 NVLink 5 links, 1.8 TB/s both ways (datasheet). Derived, as no ring
    # busbw of B200 from NVIDIA was found: 720 GB/s is 80% of the 900 GB/s
    # line rate, the ~20% protocol overhead NCCL loses on NVLink (NVIDIA/
    # nccl-tests issue #212; A100 and H100 land at 77% and 80%), below the
    # ~770 GB/s one-way copy nvbandwidth measures between GB200 GPUs
    # (Azure/AI-benchmarking-guide issue #7).
    nvlink=900e9,
    nvlink_bus=720e9,
    # DGX B200: eight ConnectX-7 at 400 Gb/s, one per GPU; 46-48 GB/s busbw
    # per NDR NIC (NVIDIA/nccl-tests issue #290).
    network=50e9,
    network_bus=46e9,
    source='NVIDIA DGX B200 / HGX B200 datasheet (2.25 PFLOPS bf16 dense per '
    "GPU, NVLink 5 1.8 TB/s); HBM 7.67 TB/s as CUDA reports the bus (XLA's "
    'b200 spec, pytorch/ao #4002; the datasheet says 8 TB/s); DGX B200: 400 '
    "Gb/s per GPU; bus bandwidth: 80% of NVLink 5's line rate (nccl-tests "
    "#212), NDR 46 GB/s (nccl-tests #290); memory: XLA's b200 spec",
  ),
)


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
  *_GPUS,
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
