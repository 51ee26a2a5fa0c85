"""The fit cache across scripts: the same program fitted from a second file is
a cache hit, and its collectives name the second file's lines.

On the 8 simulated CPU devices (tests/conftest.py), FSDP parameters on an Auto
``data`` axis: the forward pass gathers each weight at the line that uses it.
"""

import importlib.util
import os
import pathlib

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._capacity.fit import figure_cache as cache_lib
from flax_shardmeta._programs import source_map

S = jax.ShapeDtypeStruct

# One model, written into two files at different lines: {before} and
# {between} are blank lines.
_MODEL = """\
import jax
import jax.numpy as jnp

import flax_shardmeta as fsm
{before}
def loss(p, x):
  p = fsm.unbox(p)['params']
  h = jnp.tanh(x @ p['w_in'])  # uses w_in
  return jnp.mean((h @ p['w_out']) ** 2)  # uses w_out
{between}
def step(p, x):
  grads = jax.grad(loss)(p, x)
  return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)


def drive(mesh, params, x):
  return fsm.fit(fsm.jit(step, mesh=mesh, donate_argnums=0), params, x)
"""


def _module(tmp_path, name, before, between):
  """``name``.py written to ``tmp_path`` and imported (not on sys.path)."""
  path = tmp_path / f'{name}.py'
  path.write_text(_MODEL.format(before='\n' * before, between='\n' * between))
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _line(module, marker):
  """``(file, line)`` of the line of ``module``'s file holding ``marker``."""
  with open(module.__file__) as f:
    return module.__file__, next(n for n, text in enumerate(f, 1) if marker in text)


def _names(source, module, line=None):
  """Whether a report's source (``'file:line'``, the file as the report
  writes it: a path ending in the file's name) is in ``module``'s file, at
  ``line`` when given."""
  file, _, at = source.rpartition(':')
  name = pathlib.Path(module.__file__).name
  in_file = file == name or file.endswith(('/' + name, os.sep + name))
  return in_file and (line is None or at == str(line))


def _inputs():
  mesh = fsm.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  params = {
    'params': {
      'w_in': fsm.Partitioned(S((512, 2048), jnp.float32), ('data', None)),
      'w_out': fsm.Partitioned(S((2048, 512), jnp.float32), ('data', None)),
    }
  }
  x = fsm.Partitioned(S((64, 512), jnp.float32), ('data', None))
  return mesh, params, x


def _gathers(report):
  """Each weight's gathers' source lines."""
  out = {}
  for r in report.collectives:
    if r.reason == 'parameter':
      for p in r.parameters:
        out.setdefault(p.rsplit('/', 1)[-1], set()).update(r.sources)
  return out


def test_a_second_file_hits_the_cache_with_its_own_lines(tmp_path, monkeypatch):
  monkeypatch.setenv('FLAX_SHARDMETA_CACHE', str(tmp_path / 'cache'))
  cache_lib.clear()
  first = _module(tmp_path, 'fit_cache_lines_a', before=1, between=1)
  second = _module(tmp_path, 'fit_cache_lines_b', before=9, between=4)
  mesh, params, x = _inputs()
  a = first.drive(mesh, params, x)
  cache_lib.clear()  # only the disk copy is left, as for a new script
  b = second.drive(mesh, params, x)
  assert not a.cached and b.cached and b.compile_seconds == 0
  assert b.rows == a.rows and len(b.collectives) == len(a.collectives)
  for report, module in ((a, first), (b, second)):
    gathers = _gathers(report)
    assert set(gathers) == {'w_in', 'w_out'}
    for name in ('w_in', 'w_out'):  # the forward gather is at the line using it
      _, line = _line(module, f'uses {name}')
      assert any(_names(s, module, line) for s in gathers[name]), (name, gathers)
  sources = {s for r in b.collectives for s in r.sources if s}
  assert sources and all(_names(s, second) for s in sources), sources
  assert not any(_names(s, first) for s in sources), sources


def test_the_key_is_the_program_without_its_lines(tmp_path):
  mesh = fsm.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  first = _module(tmp_path, 'fit_cache_key_a', before=0, between=1)
  second = _module(tmp_path, 'fit_cache_key_b', before=5, between=2)
  rows = S((512, 2048), jnp.float32, sharding=NamedSharding(mesh, P('data', None)))
  params = {'params': {'w_in': rows, 'w_out': S((2048, 512), jnp.float32)}}
  x = S((64, 512), jnp.float32)

  def read(step):
    lowered = jax.jit(step).lower(params, x)
    return source_map.read(lowered.as_text(debug_info=True))

  def scoped(p, x):  # the same operations under another name stack
    with jax.named_scope('block'):
      return second.step(p, x)

  program_a, lines_a = read(first.step)
  program_b, lines_b = read(second.step)
  program_c, _ = read(scoped)
  assert program_a == program_b and 'loc("jit(step)' in program_a
  assert first.__file__ not in program_a and program_a != program_c
  moves = source_map.mapping(lines_a, lines_b)
  for marker in ('uses w_in', 'uses w_out'):
    assert moves[_line(first, marker)] == _line(second, marker), marker
