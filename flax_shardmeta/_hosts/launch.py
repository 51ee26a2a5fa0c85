"""Several local processes under ``jax.distributed``, on CPU devices.

What a pod does with one process per host, done on one machine: each process
gets its own CPU devices and joins the others through a coordinator on
127.0.0.1 with gloo collectives. Used by ``flax-shardmeta demo --processes N``
and by the multi-process tests. A process that fails ends the launch at once
(the others are killed rather than left waiting in a collective), and every
process is bounded by the same deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flax_shardmeta._devices.simulated import cpu_device_flags
from flax_shardmeta._errors import LaunchError

_COORDINATOR = 'FLAX_SHARDMETA_COORDINATOR'
_NUM_PROCESSES = 'FLAX_SHARDMETA_NUM_PROCESSES'
_PROCESS_ID = 'FLAX_SHARDMETA_PROCESS_ID'


@dataclasses.dataclass(frozen=True)
class ProcessResult:
  """How one launched process ended."""

  process_id: int
  pid: int
  coordinator: str
  returncode: int | None
  stdout: str
  stderr: str


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def launch(
  argv: Sequence[str],
  *,
  num_processes: int,
  devices_per_process: int,
  timeout: float = 300.0,
  env: Mapping[str, str] | None = None,
  cwd: str | None = None,
) -> list[ProcessResult]:
  """Runs ``python *argv`` in ``num_processes`` processes that form one job.

  Each process sees ``devices_per_process`` CPU devices and finds the job
  through environment variables that :func:`initialize` reads
  (``fsm.testing.join_launch``).

  Example (a script that joins the job, then uses the 8 devices of all)::

    # job.py
    import flax_shardmeta as fsm
    fsm.testing.join_launch()
    import jax
    print(jax.process_index(), jax.device_count())

    fsm.testing.launch(['job.py'], num_processes=2, devices_per_process=4)

  Returns:
    One :class:`ProcessResult` per process, when all exited with 0.

  Raises:
    LaunchError: a process failed or the deadline passed; the message holds
      each process's exit code and the end of its stderr.
  """
  base = dict(os.environ if env is None else env)
  flags = cpu_device_flags(base.get('XLA_FLAGS', ''), devices_per_process)
  port = free_port()
  with tempfile.TemporaryDirectory(prefix='fsm-launch-') as tmp:
    procs, files = [], []
    try:
      for i in range(num_processes):
        out = open(Path(tmp) / f'{i}.out', 'w+')  # noqa: SIM115 - closed below
        err = open(Path(tmp) / f'{i}.err', 'w+')  # noqa: SIM115
        files.append((out, err))
        child_env = {
          **base,
          'JAX_PLATFORMS': 'cpu',
          'XLA_FLAGS': flags,
          _COORDINATOR: f'127.0.0.1:{port}',
          _NUM_PROCESSES: str(num_processes),
          _PROCESS_ID: str(i),
        }
        procs.append(
          subprocess.Popen(
            [sys.executable, *argv],
            env=child_env,
            cwd=cwd,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
          )
        )
      failure = _wait(procs, time.monotonic() + timeout, timeout)
    finally:
      for p in procs:
        _kill(p)
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, files)):
      out.seek(0)
      err.seek(0)
      results.append(
        ProcessResult(
          i, p.pid, f'127.0.0.1:{port}', p.returncode, out.read(), err.read()
        )
      )
      out.close()
      err.close()
  if failure:
    details = '\n'.join(
      f'--- process {r.process_id}: exit code {r.returncode}; stderr ends:\n'
      + _tail(r.stderr)
      for r in results
    )
    raise LaunchError(
      f'{failure}\n{details}', [(r.returncode, r.stdout, r.stderr) for r in results]
    )
  return results


def _wait(procs: list[subprocess.Popen[bytes]], deadline: float, timeout: float) -> str:
  """'' when all exit with 0; else why the launch ends early."""
  while True:
    codes = [p.poll() for p in procs]
    bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
    if bad:
      return (
        f'process {bad[0]} exited with code {codes[bad[0]]}; the others were stopped'
      )
    if all(c == 0 for c in codes):
      return ''
    if time.monotonic() > deadline:
      late = [i for i, c in enumerate(codes) if c is None]
      return f'processes {late} still running after {timeout:.0f} s; stopped'
    time.sleep(0.05)


def _kill(p: subprocess.Popen[bytes]) -> None:
  if p.poll() is None:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(p.pid, signal.SIGKILL)  # the process and anything it started
  p.wait()


def _tail(text: str, lines: int = 25) -> str:
  return '\n'.join(text.rstrip().splitlines()[-lines:])


def initialize() -> tuple[int, int]:
  """Joins the job :func:`launch` started; returns (process id, processes).

  Outside a launch (the variables are not set) nothing is initialized and
  ``(0, 1)`` is returned, so the same script runs as one process too.
  """
  if _COORDINATOR not in os.environ:
    return 0, 1
  import jax

  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # jax.distributed's shutdown at exit waits for every process; one that dies
  # of an exception would hang there (its peers may wait for it in a
  # collective), so it leaves at once with its traceback printed.
  sys.excepthook = _exit_on_uncaught
  process_id = int(os.environ[_PROCESS_ID])
  num_processes = int(os.environ[_NUM_PROCESSES])
  jax.distributed.initialize(
    os.environ[_COORDINATOR], num_processes, process_id, initialization_timeout=120
  )
  return process_id, num_processes


def _exit_on_uncaught(
  kind: type[BaseException], error: BaseException, traceback: Any
) -> None:
  sys.__excepthook__(kind, error, traceback)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(1)
