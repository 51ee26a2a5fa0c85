"""The host side of a compiled fit: what the step keeps in host memory, by
argument path and offloaded name, judged against each host's RAM, and what
it asked to offload that the compiled program does not."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flax_shardmeta._capacity.fit.host_side import (
  HOST_LINK,
  HostMemory,
  host_capacity,
  host_rows,
  transfers,
)
from flax_shardmeta._capacity.fit.offload import offload_notes
from flax_shardmeta._capacity.hlo.attribution import plan_path
from flax_shardmeta._programs.hosts import devices_per_host, host_count


def host_side(
  found: Any,
  arguments: Any,
  names: Sequence[str],
  mesh: Any,
  chip: Any,
  host_ram: int | None,
) -> tuple[HostMemory | None, tuple[str, ...]]:
  """The :class:`HostMemory` of a compiled step (None when it keeps nothing
  in host memory and asked for nothing there) and the notes on offloads
  that did nothing.

  ``found``: the compiled figures; ``arguments``: the step's prepared
  arguments (their layouts' memory kinds); ``names``: its argument names.
  """
  memory = found.device_memory
  asks = found.offload
  inputs = [
    (plan_path(leaf[0], names), int(leaf[1]), len(leaf) > 4 and bool(leaf[4]))
    for leaf in found.input_bytes
  ]
  asked_on_host = [
    (path, hosted)
    for (path, _, hosted), asked in zip(inputs, arguments.on_host or ())
    if asked
  ]
  temps = memory.host_temporaries if memory is not None else 0
  notes = offload_notes(asks, temps, asked_on_host) + early_arrivals(found.attributor)
  if memory is None:
    return None, notes
  per_chip = memory.host_arguments + memory.host_outputs - memory.host_aliased + temps
  if not per_chip and not (asks is not None and asks.asked) and not asked_on_host:
    return None, notes
  chips = devices_per_host(mesh.devices)
  capacity, source = host_capacity(getattr(chip, 'name', None), chips, host_ram)
  offloaded = asks.offloaded if asks is not None else ()
  rows = host_rows(memory, inputs, found.output_bytes, found.aliases, offloaded)
  # fsm split the host arguments off XLA's device figures where XLA counted
  # none apart (the CPU compiler): the host figures are then fsm's.
  xla = found.memory
  split = bool(memory.host_arguments or memory.host_outputs) and not (
    xla is not None and (xla.host_arguments or xla.host_outputs)
  )
  method = (
    "the arguments' memory kinds, split off XLA's device figures by fsm"
    if split
    else "XLA's host figures (memory_analysis)"
  )
  to_device, to_host = transfers(memory)
  bandwidth, link = HOST_LINK.get(getattr(chip, 'name', None) or '', (None, ''))
  host = HostMemory(
    per_chip, rows, chips, host_count(mesh.devices), capacity, source, method,
    to_device, to_host, bandwidth, link, _overlapped(found.attributor),
  )  # fmt: skip
  return host, notes


def early_arrivals(attributor: Any) -> tuple[str, ...]:
  """A note naming the arguments laid out in host memory whose copy to
  the chip XLA's schedule starts before a loop of the step (a scan: the
  forward or backward pass) and finishes after it: their device buffer is
  held across it, on the chip while the passes run. Empty when none is."""
  entry = getattr(attributor, 'entry', None)
  if entry is None:
    return ()
  order = {inst.name: i for i, inst in enumerate(entry.instructions)}
  by_name = attributor.flow.by_name[entry.name]
  loops = [i for i, inst in enumerate(entry.instructions) if inst.opcode == 'while']
  held: dict[str, int] = {}
  for inst in entry.instructions:
    if inst.opcode != 'copy-done' or not inst.operands:
      continue
    start = by_name.get(inst.operands[0])
    source = by_name.get(start.operands[0]) if start and start.operands else None
    if source is None or source.opcode != 'parameter' or 'S(5)' not in source.shape:
      continue
    begin, end = order[start.name], order[inst.name]
    across = sum(1 for i in loops if begin < i < end)
    leaf = attributor.leaf(attributor.flow.origin(entry, source.name))
    if across and leaf is not None:
      held[leaf[0]] = max(held.get(leaf[0], 0), across)
  if not held:
    return ()
  names = ', '.join(list(held)[:4]) + (
    f' (+{len(held) - 4} more)' if len(held) > 4 else ''
  )
  most = max(held.values())
  return (
    f"OFFLOAD ARRIVES EARLY: XLA's schedule starts copying {names} from host "
    f'memory to the chip before {most} loop(s) of the step (the forward or '
    'backward pass) and holds the copy across them, so that memory is on the chip '
    'while they run and the offload spares the chip less than it holds on the '
    "host (peak() shows the 'offload' rows at the peak)",
  )


def _overlapped(attributor: Any) -> bool | None:
  """Whether XLA's schedule runs the program's host transfers
  asynchronously (a ``-start`` / ``-done`` pair on a host buffer), so that
  they can overlap compute; None where the program is not at hand or moves
  nothing to or from host memory (memory space 5)."""
  computations = getattr(attributor, 'computations', None)
  if not computations:
    return None
  hosted = [
    i.opcode
    for c in computations.values()
    for i in c.instructions
    if 'S(5)' in i.shape and i.opcode not in _PASSIVE
  ]
  if not hosted:
    return None
  return any(op.endswith(('-start', '-done')) for op in hosted)


# What holds or passes a host buffer without moving it.
_PASSIVE = frozenset(
  {'parameter', 'get-tuple-element', 'tuple', 'while', 'bitcast', 'conditional', 'call'}
)
