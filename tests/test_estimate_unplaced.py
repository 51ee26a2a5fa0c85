"""The estimate names the values it could not lay out.

On a ``jax.sharding.AbstractMesh`` with Auto axes (no compiler asked; the 8
simulated CPU devices of conftest.py serve the compiled check) a value nothing
lays out is counted replicated: ``report.unplaced`` lists each with its shape,
bytes, scope and the user's ``file:line``, largest first, and the line under
the verdict says how much of the total rests on them.
"""

import inspect
import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._capacity.estimate.unplaced import UnplacedValue, report_lines
from flax_shardmeta._units import signed_bytes

AUTO = (AxisType.Auto,) * 2
MESH = AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
RULES = (('batch', 'data'), ('embed', 'model'))
B, T, D = 16, 64, 512
PAIR_BYTES = B * D * D * 4  # float32[16,512,512], whole on every chip
SPEC = P('data', None, 'model')


def loss(x):
  cls = x[:, 0]  # a squeeze: the estimate carries no layout through it
  pair = jnp.einsum('bi,bj->bij', cls, cls)  # the large value nothing lays out
  return (jnp.tanh(pair) * pair).sum()


def constrained_by_jax(x):
  cls = x[:, 0]
  pair = jnp.einsum('bi,bj->bij', cls, cls)
  pair = jax.lax.with_sharding_constraint(pair, NamedSharding(MESH, SPEC))
  return (jnp.tanh(pair) * pair).sum()


def constrained_by_fsm(x):
  cls = x[:, 0]
  pair = jnp.einsum('bi,bj->bij', cls, cls)
  pair = fsm.with_logical_constraint(pair, ('batch', None, 'embed'), RULES, MESH)
  return (jnp.tanh(pair) * pair).sum()


def twice(x):
  cls = x[:, 0]
  pairs = [jnp.einsum('bi,bj->bij', c, c) for c in (cls, cls + 1)]  # one line, two
  return sum((jnp.tanh(p) * p).sum() for p in pairs)


def line_of(fn, marker):
  """``file:line`` of the line of ``fn`` holding ``marker``, as a traceback
  names it."""
  lines, start = inspect.getsourcelines(fn)
  (i,) = [i for i, text in enumerate(lines) if marker in text]
  return f'{fn.__code__.co_filename}:{start + i}'


def estimate(fn, mesh=MESH):
  """``fsm.fit`` of ``fn`` on ``x`` laid out over ``mesh``: an estimate on an
  abstract mesh, XLA's figures on a concrete one."""
  x = jax.ShapeDtypeStruct((B, T, D), jnp.float32, sharding=NamedSharding(mesh, SPEC))
  context = (
    jax.sharding.use_abstract_mesh(mesh)
    if isinstance(mesh, AbstractMesh)
    else jax.set_mesh(mesh)
  )
  with context:
    return fsm.fit(jax.jit(fn), x, hbm='1GiB', cache=False)


def test_the_value_nothing_lays_out_is_named_with_its_line():
  report = estimate(loss)
  assert report.source == 'estimate'
  first = report.unplaced[0]
  assert first.source == line_of(loss, 'the large value nothing lays out')
  assert (first.shape, first.dtype, first.bytes) == ((B, D, D), 'float32', PAIR_BYTES)
  assert (first.primitive, first.count, first.at_peak) == ('dot_general', 1, 1)
  # Largest first; the small squeeze that feeds it is listed after it.
  sizes = [v.bytes for v in report.unplaced]
  assert sizes == sorted(sizes, reverse=True) and len(sizes) > 1
  assert report.unplaced[1].source == line_of(loss, 'cls = x[:, 0]')
  data = json.loads(json.dumps(report.to_dict()))['unplaced'][0]
  assert data['source'] == first.source and data['shape'] == [B, D, D]
  assert data['bytes'] == PAIR_BYTES and data['at_peak'] == 1


def test_values_made_by_one_line_in_one_scope_are_one_entry():
  report = estimate(twice)
  where = line_of(twice, 'one line, two')
  (entry,) = [v for v in report.unplaced if v.source == where and v.shape[1:] == (D, D)]
  assert entry.count == 2 and entry.shape == (B, D, D) and entry.bytes == PAIR_BYTES


@pytest.mark.parametrize('constrained', [constrained_by_jax, constrained_by_fsm])
def test_a_constraint_where_it_is_made_takes_it_off_the_list(constrained):
  free, held = estimate(loss), estimate(constrained)
  assert not [v for v in held.unplaced if v.shape == (B, D, D)]
  assert held.total_bytes < free.total_bytes - PAIR_BYTES // 2
  assert held.unplaced_bytes < free.unplaced_bytes


def test_the_verdict_says_how_much_of_the_total_rests_on_them():
  report = estimate(loss)
  rest = report.unplaced_bytes
  assert PAIR_BYTES <= rest <= report.total_bytes
  lines = str(report).splitlines()
  i = next(i for i, line in enumerate(lines) if line.startswith('verdict: FITS'))
  share = f'{rest / report.total_bytes:.1%}'
  assert lines[i + 1].startswith(f'of which {signed_bytes(rest)} ({share}) are ')
  assert 'fsm.with_logical_constraint' in ' '.join(lines[i + 1 : i + 3])
  text = '\n'.join(lines)
  assert 'values without a layout (counted replicated)' in text
  assert 'float32[16,512,512]' in text and 'test_estimate_unplaced.py:' in text
  assert max(len(line) for line in lines) <= 100


def test_long_scopes_and_paths_stay_within_100_columns():
  deep = UnplacedValue(
    (8, 4096, 4096),
    'bfloat16',
    8 * 4096 * 4096 * 2,
    'transpose(jvp(Transformer))/layers_11/attention/' * 3,
    '/a/very/long/path/to/somebody/s/project/src/models/transformer/attention.py:123',
    'dot_general',
    at_peak=1,
  )
  lines = report_lines((deep,) * 12, 2**40)
  assert max(len(line) for line in lines) <= 100
  assert any(line.strip().endswith('attention.py:123') for line in lines)
  assert lines[-1].strip() == '... and 2 more in report.unplaced'


def test_compiled_reports_list_nothing():
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  report = estimate(loss, mesh)
  assert report.source == 'compiled' and report.unplaced == ()
  assert report.to_dict()['unplaced'] == [] and report.unplaced_bytes == 0
  assert 'values without a layout' not in str(report)
