"""Runs every benchmark and rewrites its section of BENCHMARKS.md.

Usage: ``python benchmarks/run.py`` (``make bench``). Exits 1 if any target is
missed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = (
  'speed.py',
  'nnx_speed.py',
  'plan_speed.py',
  'startup.py',
  'memory.py',
  'plan_405b.py',
  'restore_memory.py',
  'explicit_audit.py',
  'fit.py',
  'suggest.py',
  'fit_gpu.py',
)


def main() -> int:
  failed = []
  for script in SCRIPTS:
    print(f'== {script}', flush=True)
    if subprocess.run([sys.executable, str(HERE / script)], cwd=HERE.parent).returncode:
      failed.append(script)
  if failed:
    print(f'targets missed in: {", ".join(failed)}')
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
