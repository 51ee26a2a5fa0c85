"""Reading XLA's memory analysis of compiled programs (_program_memory)."""

import types

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from flax_shardmeta._programs.memory import (
  MEMORY_FIELDS,
  ProgramMemory,
  memory_fields,
  program_memory,
)


def test_bytes_are_per_device(mesh):
  # 64x64 float32 over 8 devices: 2 KiB in, 2 KiB out on each.
  sharding = NamedSharding(mesh, P('data', 'model'))
  x = jax.device_put(jnp.zeros((64, 64)), sharding)
  compiled = jax.jit(lambda a: a + 1, out_shardings=sharding).lower(x).compile()
  m = program_memory(compiled)
  assert m is not None
  assert m.arguments == m.outputs == 64 * 64 * 4 // 8
  assert m.peak == m.arguments + m.outputs + m.temporaries - m.aliased


def test_donated_inputs_are_counted_once():
  x = jnp.zeros((256,))
  compiled = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile()
  m = program_memory(compiled)
  assert m is not None and m.aliased == 1024
  assert m.peak == 1024 + m.temporaries


class _Compiled:
  def __init__(self, analysis):
    self._analysis = analysis

  def memory_analysis(self):
    if isinstance(self._analysis, Exception):
      raise self._analysis
    return self._analysis


@pytest.mark.parametrize(
  'analysis',
  [
    NotImplementedError('memory analysis unsupported on current XLA backend'),
    None,
    types.SimpleNamespace(output_size_in_bytes=8),  # another structure
  ],
  ids=['unsupported', 'none', 'other-structure'],
)
def test_unavailable_analysis_gives_none(analysis):
  assert program_memory(_Compiled(analysis)) is None


def test_missing_optional_fields_read_as_zero():
  stats = types.SimpleNamespace(
    argument_size_in_bytes=4, output_size_in_bytes=8, temp_size_in_bytes=16
  )
  assert program_memory(_Compiled(stats)) == ProgramMemory(4, 8, 16, 0, 0)


def test_memory_fields_are_xlas_unaltered():
  compiled = jax.jit(lambda a: a * 2, donate_argnums=0).lower(jnp.zeros(256)).compile()
  fields = memory_fields(compiled)
  assert fields is not None and set(fields) == set(MEMORY_FIELDS)
  stats = compiled.memory_analysis()
  assert fields['alias_size_in_bytes'] == stats.alias_size_in_bytes == 1024
  assert memory_fields(_Compiled(None)) is None
