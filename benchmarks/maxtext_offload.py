"""Host offload on a real client: MaxText's own llama3-8b step with its
offload options, through ``fsm.fit``, against MaxText's own compile.

The step is the one ``benchmarks/maxtext_why.py`` builds (MaxText 0.2.5's
``train_compile`` functions, v5p-128 as ``v5p:4x4x4``, ``ici_fsdp_parallelism=64``,
the state donated), in three configurations:

* no offload (``remat_policy=full``);
* ``optimizer_memory_host_offload=True``: the optimizer state on
  ``pinned_host``;
* ``remat_policy=custom`` with ``decoder_layer_input=offload``: each layer's
  input offloaded by name.

For each, ``fsm.fit`` and a compile the way MaxText's ``jit_and_compile``
compiles it (its compiler options, not through fsm) are compared field by
field: fit's device total against ``argument + output - alias + temp +
code`` of the device figures, and ``report.host_bytes`` against ``host
argument + host output - host alias + host temp``. The rows on the host and
the notes on offloads are printed.

Runs in MaxText's venv (see ``benchmarks/maxtext_why.py`` for making it)::

  PYTHONPATH=. ~/maxtext-venv/bin/python benchmarks/maxtext_offload.py [--no-write]

Each configuration compiles twice (fit's compile and MaxText's own), 2 to 4
minutes each on 2 cores; fit's is cached. Not part of CI.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from _common import machine, machine_line, publish
from maxtext_why import MODEL, TOPOLOGY, build_step, fit_report, maxtext_context

CONFIGS = {
  'no offload': ('remat_policy=full',),
  'optimizer state on the host': (
    'remat_policy=full',
    'optimizer_memory_host_offload=True',
  ),
  'layer inputs offloaded by the remat policy': (
    'remat_policy=custom',
    'decoder_layer_input=offload',
  ),
}
PER_DEVICE_BATCH, SEQ = 4, 2048


def _own_memory(built: Any) -> dict[str, int]:
  """XLA's memory analysis of the step compiled as MaxText compiles it."""
  with maxtext_context(built.config, built.mesh):
    lowered = built.jitted.lower(*built.args)
  compiled = lowered.compile(compiler_options=built.compiler_options)
  m = compiled.memory_analysis()
  return {k: int(getattr(m, k)) for k in dir(m) if k.endswith('_in_bytes')}


def _device(m: dict[str, int]) -> int:
  return (
    m['argument_size_in_bytes']
    + m['output_size_in_bytes']
    - m['alias_size_in_bytes']
    + m['temp_size_in_bytes']
    + m['generated_code_size_in_bytes']
  )


def _host(m: dict[str, int]) -> int:
  return (
    m['host_argument_size_in_bytes']
    + m['host_output_size_in_bytes']
    - m['host_alias_size_in_bytes']
    + m['host_temp_size_in_bytes']
  )


def main(write: bool) -> None:
  import flax_shardmeta as fsm

  fsm.cpu_only_jax()
  lines = [
    machine_line(machine()),
    f'Command: `python benchmarks/maxtext_offload.py` (MaxText 0.2.5, {MODEL}, '
    f'{TOPOLOGY}, per-device batch {PER_DEVICE_BATCH} x {SEQ}, ici_fsdp=64; '
    "MaxText's mesh: Auto axes)",
    '',
  ]
  for label, extra in CONFIGS.items():
    built = build_step(PER_DEVICE_BATCH, SEQ, extra)
    start = time.perf_counter()
    report = fit_report(built)
    fitted = time.perf_counter() - start
    own = _own_memory(built)
    host = report.host
    lines += [
      f'- {label} (`{" ".join(extra)}`): fit {fitted:.0f} s',
      f"  - device: fit {report.total_bytes:,} B, MaxText's compile "
      f'{_device(own):,} B ({report.total_bytes - _device(own):+,} B apart)',
      f"  - host: fit {report.host_bytes:,} B per chip, MaxText's compile "
      f'{_host(own):,} B ({report.host_bytes - _host(own):+,} B apart)',
    ]
    if host is not None:
      lines += [f'  - {line.strip()}' for line in host.lines()[:6]]
    lines += [f'  - note: {n}' for n in report.notes if 'OFFLOAD' in n]
  lines += [
    '',
    'Reading it:',
    "- fit's device total and its host figures equal MaxText's own compile of the same",
    '  step (its compiler options, not through fsm), byte for byte, with the optimizer',
    "  state on the host and with each layer's input offloaded by its remat policy.",
    '- The host rows name the optimizer slots by path, and the offloaded activations',
    "  by MaxText's checkpoint name and the line that gives it.",
    '- Google publishes no host link bandwidth for v5p, so the transfers are given in',
    '  bytes and their time is not estimated.',
  ]
  publish("## Host offload: MaxText's llama3-8b", lines, write)


if __name__ == '__main__':
  main(write='--no-write' not in sys.argv)
