"""The memory a real jax run gets on a GPU, and compiling for it.

A GPU's memory is not all XLA's. jax's allocator takes a fraction of it
(``XLA_CLIENT_MEM_FRACTION``, formerly ``XLA_PYTHON_CLIENT_MEM_FRACTION``;
default 0.75), and what a run holds outside that pool (the CUDA context,
cuBLAS / cuDNN handles, NCCL's communicators, CUDA graphs) must fit in the
rest of the card. So a step fits when XLA's total fits in::

  usable = min(fraction x device memory, device memory - reserve)

the pool, as long as the reserve fits beside it. The reserve comes from the
table below (every figure with its source) or ``reserve=``.

XLA also plans with that figure: on a real GPU, jaxlib hands XLA the
allocator's limit as the device's memory, its scheduler and
rematerialization plan against it, while a compile-only client hands
nothing over and XLA plans against 80% of the described memory. So fit
compiles GPU programs for devices whose description carries the memory that
makes XLA plan against ``fraction x device memory``, as the run's compile
would (:func:`compile_for_memory`).

A real run also autotunes each matmul: XLA times a Triton kernel with the
matmul's neighbours fused into it against a cuBLAS call with them split out
(their results then held in memory), and keeps the faster. A compile-only
client cannot time anything and keeps every Triton fusion, the least memory
of the choices. So fit compiles GPU programs with Triton matmul fusions off
(:data:`GPU_COMPILER_OPTIONS`), the most memory of the choices: on the
device check's transformer (BENCHMARKS.md, "GPU truth") the autotuned run
chose cuBLAS for 17 of its 21 matmuls and needed 9% more than the fused
compile, and the compile with Triton off matched it to 5 KiB.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from flax_shardmeta._devices import gpu
from flax_shardmeta._devices.chips import GIB
from flax_shardmeta._errors import FitError, SizeError, message
from flax_shardmeta._programs.hosts import host_count
from flax_shardmeta._units import format_bytes as _bytes, parse_bytes

DEFAULT_FRACTION = 0.75
"""jax's default allocator fraction on GPUs (``XLA_CLIENT_MEM_FRACTION``)."""

GIVEN_RESERVE = 'reserve='
"""``UsableMemory.reserve_from`` of a reserve given as ``reserve=``."""

MAX_FRACTION = 0.95
"""The largest fraction fit proposes: above it the CUDA context and NCCL have
too little room beside the pool on any card the project describes."""

FRACTION_VARIABLES = gpu.FRACTION_VARIABLES
"""The variables jaxlib reads for the fraction, current name first (the old
one is deprecated: openxla/xla#16457; jaxlib refuses both at once)."""

# XLA's GPU compiler plans (scheduling, rematerialization) against the
# module's device_memory_size when the client sets one (a real run: the
# allocator's bytes_limit), else against 80% of the described memory
# (xla/service/gpu/gpu_hlo_schedule.cc, GetSchedulerMemoryLimit).
_COMPILE_ONLY_SHARE = 0.8

# What a real run holds outside XLA's pool, per GPU. Approximate figures from
# users' measurements, to be replaced by the device check's
# (benchmarks/gpu_truth.py); reserve= overrides them.
CONTEXT_BYTES = 1 * GIB
"""The CUDA context with cuBLAS / cuDNN handles and workspaces, per process:
about 0.5-1 GiB on recent GPUs (jax#17426, jax#8506: "both cuDNN and JAX
need some memory"); measured 0.54 GiB idle and 0.61 GiB during a training
step on an H200 with jax 0.11.2 (BENCHMARKS.md, "GPU truth"); 1 GiB, rounded
up for other drivers and libraries."""

NCCL_IN_NODE_BYTES = int(0.7e9)
"""One NCCL communicator among GPUs of one node (NVLink): 0.5-0.7 GB each,
measured on 4 x A100 (NVIDIA/nccl#964); the upper figure."""

NCCL_ACROSS_NODES_BYTES = int(2.0e9)
"""One NCCL communicator spanning nodes (network buffers per peer): about
1.6 GB for one and 6 GB for three or more on larger jobs (NVIDIA/nccl#864):
2 GB each."""


@dataclasses.dataclass(frozen=True)
class UsableMemory:
  """What a GPU run's XLA program can use: the rows behind a GPU verdict.

  Attributes:
    device_bytes: the GPU's memory (CUDA's figure, as jax's allocator sees).
    fraction: the allocator's fraction of it.
    fraction_from: where the fraction comes from (``'mem_fraction='``, the
      environment variable's name, or ``"jax's default"``).
    reserve_bytes: what the run holds outside XLA's pool.
    reserve_from: how the reserve is made up, in words.

  Example:
    >>> m = UsableMemory(80 * 2**30, 0.75, "jax's default", 2**30, 'context')
    >>> m.pool_bytes / 2**30, m.usable_bytes / 2**30
    (60.0, 60.0)
    >>> m = UsableMemory(80 * 2**30, 0.95, 'mem_fraction=', 6 * 2**30, 'NCCL')
    >>> m.usable_bytes / 2**30
    74.0
  """

  device_bytes: int
  fraction: float
  fraction_from: str
  reserve_bytes: int
  reserve_from: str

  def __post_init__(self) -> None:
    """A given reserve or fraction that leaves the pool no room is an error,
    not a verdict (the table's reserve against a tiny ``hbm=`` is a verdict:
    nothing fits)."""
    if self.usable_bytes > 0:
      return
    gpu_memory, reserve = _bytes(self.device_bytes), _bytes(self.reserve_bytes)
    if self.reserve_bytes >= self.device_bytes:
      if self.reserve_from != GIVEN_RESERVE:
        return
      raise FitError(
        f"reserve {reserve} ({self.reserve_from}) is not less than the GPU's "
        f"{gpu_memory} of memory: nothing is left for XLA's pool. Give reserve= "
        'the memory a run holds outside the pool per GPU (CUDA context, NCCL), '
        "e.g. '2GiB'."
      )
    raise FitError(
      f'allocator fraction {fraction_text(self.fraction)} ({self.fraction_from}) '
      f"of {gpu_memory} leaves XLA's pool no memory; give a larger fraction, "
      'e.g. 0.9.'
    )

  @property
  def pool_bytes(self) -> int:
    """The allocator's pool: ``fraction x device_bytes``."""
    return int(self.fraction * self.device_bytes)

  @property
  def usable_bytes(self) -> int:
    """The pool, less what of the reserve does not fit beside it."""
    return max(min(self.pool_bytes, self.device_bytes - self.reserve_bytes), 0)

  @property
  def compile_limit_bytes(self) -> int:
    """The memory a real run hands XLA's compiler: the pool."""
    return self.pool_bytes

  def with_fraction(self, fraction: float, source: str) -> UsableMemory:
    """The same GPU and reserve at another fraction."""
    return dataclasses.replace(self, fraction=fraction, fraction_from=source)

  def needed_fraction(self, total_bytes: int) -> float | None:
    """The smallest fraction (two decimals, at most :data:`MAX_FRACTION`)
    whose usable memory holds ``total_bytes``, or None when none does.

    Example:
      >>> m = UsableMemory(100, 0.75, "jax's default", 3, '')
      >>> m.needed_fraction(85), m.needed_fraction(96), m.needed_fraction(50)
      (0.85, None, 0.75)
    """
    for hundredths in range(math.ceil(self.fraction * 100 - 1e-9), 96):
      x = hundredths / 100
      if self.with_fraction(x, '').usable_bytes >= total_bytes:
        return x
    return None

  def rows(self) -> tuple[tuple[str, int, str], ...]:
    """``(name, bytes, where from)`` of the device, pool, reserve and usable."""
    return (
      ('GPU memory', self.device_bytes, "CUDA's total"),
      (
        'allocator pool',
        self.pool_bytes,
        f'fraction {fraction_text(self.fraction)} ({self.fraction_from})',
      ),
      ('reserve', self.reserve_bytes, f'outside the pool: {self.reserve_from}'),
      ('usable', self.usable_bytes, 'min(pool, GPU memory - reserve)'),
    )

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'device_bytes': int(self.device_bytes),
      'fraction': self.fraction,
      'fraction_from': self.fraction_from,
      'pool_bytes': self.pool_bytes,
      'reserve_bytes': int(self.reserve_bytes),
      'reserve_from': self.reserve_from,
      'usable_bytes': self.usable_bytes,
    }


def run_fraction(mem_fraction: Any = None) -> tuple[float, str]:
  """The allocator fraction a run uses: ``mem_fraction``, else the
  environment's (as jaxlib reads it), else jax's default 0.75.

  Raises:
    FitError: a fraction that is not a number in (0, 1] (numeric strings and
      numpy numbers are numbers), or both variables set.

  Example:
    >>> run_fraction(0.9)
    (0.9, 'mem_fraction=')
  """
  if mem_fraction is not None:
    fraction = gpu.checked_fraction(mem_fraction, 'mem_fraction=', FitError)
    return fraction, 'mem_fraction='
  return gpu.environment_fraction(FitError) or (DEFAULT_FRACTION, "jax's default")


def fraction_text(fraction: float) -> str:
  """``fraction`` with two decimals, or as many more as it needs.

  Example:
    >>> fraction_text(0.75), fraction_text(0.9), fraction_text(0.001)
    ('0.75', '0.90', '0.001')
  """
  short = f'{fraction:.2f}'
  return short if float(short) == fraction else f'{fraction:.6g}'


def check_run(mem_fraction: Any, reserve: Any) -> None:
  """Refuses a bad ``mem_fraction=`` or ``reserve=`` at once, on any chip.

  Raises:
    FitError: as :func:`run_fraction` and :func:`reserve_for` say.
  """
  if mem_fraction is not None:
    run_fraction(mem_fraction)
  if reserve is not None:
    reserve_for((), reserve)


class Communicator(NamedTuple):
  """A group of mesh axes collectives run over, and the link they take."""

  over: str
  link: str = 'nvlink'


def communicators(collectives: Iterable[Any]) -> tuple[int, int]:
  """``(in a node, across nodes)``: NCCL communicators a GPU joins, one per
  distinct group of mesh axes its collectives run over."""
  groups: dict[str, bool] = {}
  for c in collectives:
    over = getattr(c, 'over', '') or ''
    across = getattr(c, 'link', '') == 'network'
    groups[over] = groups.get(over, False) or across
  across = sum(groups.values())
  return len(groups) - across, across


def reserve_for(
  collectives: Iterable[Any], reserve: int | str | None
) -> tuple[int, str]:
  """The reserve of a run whose program has ``collectives``: ``reserve=`` if
  given, else the table's figure for its communicators.

  Example:
    >>> import types
    >>> rows = [types.SimpleNamespace(over='data', link='nvlink')]
    >>> size, why = reserve_for(rows, None)
    >>> size == CONTEXT_BYTES + NCCL_IN_NODE_BYTES, why
    (True, 'CUDA context 1.00 GiB, NCCL communicators 1 in a node')
  """
  if reserve is not None:
    return _checked_reserve(reserve), GIVEN_RESERVE
  inside, across = communicators(collectives)
  size = CONTEXT_BYTES + inside * NCCL_IN_NODE_BYTES + across * NCCL_ACROSS_NODES_BYTES
  why = f'CUDA context {CONTEXT_BYTES / GIB:.2f} GiB'
  counts = ((inside, 'in a node'), (across, 'across nodes'))
  groups = [f'{n} {where}' for n, where in counts if n]
  if groups:
    why += ', NCCL communicators ' + ' + '.join(groups)
  return size, why


def _checked_reserve(reserve: Any) -> int:
  """``reserve=`` in bytes: a size (``'2GiB'``) or a finite number of 0 or more."""
  if isinstance(reserve, bool) or (
    isinstance(reserve, numbers.Real) and not math.isfinite(float(reserve))
  ):
    raise FitError(
      f'reserve={reserve!r}: give the bytes held outside the pool per GPU, a '
      "number of 0 or more or a size such as '2GiB'."
    )
  try:
    number = isinstance(reserve, numbers.Real)
    value = parse_bytes(float(reserve) if number else reserve)
  except (SizeError, TypeError) as e:
    reason = message(e) if isinstance(e, SizeError) else 'not a size'
    raise FitError(f'reserve={reserve!r}: {reason}') from None
  if value < 0:
    raise FitError(f'reserve={reserve!r}: give 0 or more bytes.')
  return value


# Compiling for the memory a run hands XLA
# ------------------------------------------------------------------------------

GPU_COMPILER_OPTIONS: dict[str, Any] = {'xla_gpu_enable_triton_gemm': False}
"""XLA options fit compiles GPU programs with: matmuls as cuBLAS calls,
the most memory autotuning can pick (module docstring)."""

_MEMORY_FIELD = re.compile(r'(\bdevice_memory_size\s*:\s*)(\d+)')


def description_for(text: str, limit_bytes: int) -> str:
  """The GPU description whose compile-only plan is ``limit_bytes``: XLA
  plans with 80% of the described memory when no client sets one.

  Example:
    >>> description_for('gpu_device_info { device_memory_size: 100 }', 60)
    'gpu_device_info { device_memory_size: 75 }'
  """
  described = math.ceil(limit_bytes / _COMPILE_ONLY_SHARE)
  return _MEMORY_FIELD.sub(lambda m: f'{m.group(1)}{described}', text, count=1)


def compile_for_memory(
  lowered: Any, limit_bytes: int, options: dict[str, Any] | None = None
) -> tuple[Any, bool, bool]:
  """Compiles ``lowered`` (for compile-only GPU devices) as if the client had
  handed XLA ``limit_bytes`` of device memory, with matmuls as a real run's
  autotuning may pick them; ``(compiled, retargeted, cublas_matmuls)``.

  jax offers no way to set the memory XLA plans with, so the same lowered
  program is compiled for devices of the same GPU and grid whose description
  makes XLA plan against ``limit_bytes``. That swaps jax's private lowering
  fields (its backend and device list) on a copy: when they are not there
  (another jax), the program is compiled for the mesh's own devices and
  ``retargeted`` is False (the report then says so). The described memory is
  also what XLA's collective-combiner heuristic reads (a real run's is the
  card's), so combined collectives may differ slightly from the run's.
  ``cublas_matmuls`` is False where this XLA no longer takes
  :data:`GPU_COMPILER_OPTIONS` (the program then keeps the Triton fusions).
  ``options`` are further compile options (a dump folder).
  """
  options = options or {}
  lowering: Any = getattr(lowered, '_lowering', None)
  args = getattr(lowering, 'compile_args', None)
  devices = getattr(lowering, '_device_list', None)
  if not isinstance(args, dict) or devices is None or 'backend' not in args:
    compiled, cublas = _compile_gpu(lowered, options)
    return compiled, False, cublas
  first = devices[0]
  text = gpu._TEXT_OF_KIND.get(first.device_kind)
  if text is None:
    compiled, cublas = _compile_gpu(lowered, options)
    return compiled, False, cublas
  nodes = host_count(devices)
  target = _devices(description_for(text, limit_bytes), nodes, len(devices) // nodes)
  by_id = {d.id: d for d in target}
  if any(d.id not in by_id for d in devices):
    compiled, cublas = _compile_gpu(lowered, options)
    return compiled, False, cublas
  from jax._src import lib as jax_lib

  device_list = getattr(jax_lib, 'xla_client').DeviceList  # noqa: B009 (private)
  moved = copy.copy(lowering)
  moved.compile_args = dict(args, backend=target[0].client)
  moved._device_list = device_list(tuple(by_id[d.id] for d in devices))
  moved._executable = None
  again = copy.copy(lowered)
  again._lowering = moved
  compiled, cublas = _compile_gpu(again, options)
  return compiled, True, cublas


def _compile_gpu(lowered: Any, options: dict[str, Any]) -> tuple[Any, bool]:
  """``lowered`` compiled with :data:`GPU_COMPILER_OPTIONS` (and ``options``),
  or without them where this XLA does not know them; ``(compiled,
  with_options)``."""
  try:
    return lowered.compile(compiler_options={**GPU_COMPILER_OPTIONS, **options}), True
  except Exception as e:  # jax's JaxRuntimeError: an option XLA dropped
    if not any(name in str(e) for name in GPU_COMPILER_OPTIONS):
      raise
  return lowered.compile(compiler_options=options or None), False


_TARGETS: dict[tuple[str, int, int], tuple[Any, ...]] = {}


def _devices(text: str, nodes: int, per_node: int) -> tuple[Any, ...]:
  """Compile-only devices of a description; not recorded as the GPU's own
  (its memory is the compiler's plan, not the card's)."""
  key = (text, nodes, per_node)
  if key not in _TARGETS:
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(
      platform='cuda', target_config=text, topology=f'{nodes}x1x{per_node}'
    )
    _TARGETS[key] = tuple(desc.devices)
  return _TARGETS[key]
