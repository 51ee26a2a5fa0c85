"""Why each collective is there: ``FitReport`` rows carry their reason,
parameters and source line, and ``report.why()`` explains them.

On the 8 simulated CPU devices (tests/conftest.py) and on a TPU topology;
every mesh here has Auto axes. The models are written for the test, so the
answer is known: which parameter is gathered, whose gradient is reduced,
which line asked for a reshard.
"""

import inspect
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm

S = jax.ShapeDtypeStruct


def _line(fn, marker):
  """The line of ``fn``'s source holding ``marker`` (file:line)."""
  lines, start = inspect.getsourcelines(fn)
  offset = next(i for i, text in enumerate(lines) if marker in text)
  return f'{pathlib.Path(inspect.getsourcefile(fn)).name}:{start + offset}'


def _fsdp_loss(p, x):
  p = fsm.unbox(p)['params']
  h = jnp.tanh(x @ p['w_in'])  # uses w_in
  return jnp.mean((h @ p['w_out']) ** 2)  # uses w_out


def _fsdp_step(p, x):
  grads = jax.grad(_fsdp_loss)(p, x)
  return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)


def _fsdp(mesh):
  params = {
    'params': {
      'w_in': fsm.Partitioned(S((512, 2048), jnp.float32), ('data', None)),
      'w_out': fsm.Partitioned(S((2048, 512), jnp.float32), ('data', None)),
    }
  }
  x = fsm.Partitioned(S((64, 512), jnp.float32), ('data', None))
  return fsm.jit(_fsdp_step, mesh=mesh, donate_argnums=0), params, x


def _check_fsdp(report):
  rows = report.collectives
  gathered = {p for r in rows if r.reason == 'parameter' for p in r.parameters}
  reduced = {p for r in rows if r.reason == 'gradient' for p in r.parameters}
  assert gathered == {'p/params/w_in', 'p/params/w_out'}
  # Where XLA reduces a gradient (it may instead gather the activations and
  # compute a gradient's shard locally), the buffer is that parameter's:
  # whole for an all-reduce, its shard after a reduce-scatter.
  assert reduced and reduced <= gathered
  full = 512 * 2048 * 4
  for r in rows:
    if r.reason == 'gradient':
      per_run = r.bytes / r.count
      assert per_run in (full, full / 8, full / 4), r
  lines = {_line(_fsdp_loss, 'uses w_in'), _line(_fsdp_loss, 'uses w_out')}
  for r in rows:
    if r.reason == 'parameter':
      assert r.axes == ('data',)
      assert {s.rsplit('/', 1)[-1] for s in r.sources} <= lines, r
  for name in ('w_in', 'w_out'):  # the forward gather is at the line using it
    use = _line(_fsdp_loss, f'uses {name}')
    assert any(
      f'p/params/{name}' in r.parameters and any(s.endswith(use) for s in r.sources)
      for r in rows
    ), (name, use)
  assert {row['reason'] for row in report.to_dict()['collectives']} >= {
    'parameter',
    'gradient',
  }
  text = report.why()
  assert 'p/params/w_in' in text and 'gradient:' in text and 'parameter:' in text


def test_fsdp_gathers_and_gradient_reductions_name_their_parameters():
  mesh = fsm.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  _check_fsdp(fsm.fit(*_fsdp(mesh), cache=False))


@pytest.mark.libtpu
def test_fsdp_attribution_on_a_tpu_topology():
  mesh = fsm.make_mesh(
    (4,), ('data',), topology='v5p:2x2x1', axis_types=(AxisType.Auto,)
  )
  _check_fsdp(fsm.fit(*_fsdp(mesh), cache=False))


def _contradicting(x, w, mesh):
  h = jnp.tanh(x @ w)
  h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P('data', None)))
  h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P(None, 'data')))  # 2nd
  return jnp.sin(h) @ w.T


def test_a_reshard_two_constraints_ask_for_is_attributed_to_the_second():
  mesh = fsm.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  x = S((256, 1024), jnp.float32, sharding=NamedSharding(mesh, P('data', None)))
  w = S((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P()))
  step = jax.jit(lambda x, w: _contradicting(x, w, mesh))
  with jax.set_mesh(mesh):
    report = fsm.fit(step, x, w, cache=False)
  second = _line(_contradicting, '# 2nd')
  asked = [r for r in report.collectives if r.asked_by == 'constraint']
  assert asked, report.collectives
  assert all(r.reason == 'activation' for r in asked)
  assert any(s.endswith(second) for r in asked for s in r.sources)
  assert 'no constraint asked for' not in ''.join(
    line for line in report.why().splitlines() if second in line
  )


def test_a_dimension_that_does_not_divide_is_named_with_the_fix():
  mesh = fsm.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  rules = [('rows', 'data'), ('cols', None)]

  def step(x):
    y = fsm.with_logical_constraint(
      jnp.tanh(x), ('rows', 'cols'), mesh=mesh, rules=rules, replicate_indivisible=True
    )
    return y.sum()

  x = S((12, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(step), x, cache=False)
  assert report.replicated and '12' in report.replicated[0]
  why = report.why()
  assert 'does not divide' in why and 'data' in why


def test_lines_survive_the_cache_for_the_same_program_in_two_files(
  tmp_path, monkeypatch
):
  monkeypatch.setenv('FLAX_SHARDMETA_CACHE', str(tmp_path / 'cache'))
  source = textwrap.dedent(inspect.getsource(_fsdp_loss))
  sources = {}
  for name, padding in (('model_a', 0), ('model_b', 7)):
    (tmp_path / f'{name}.py').write_text(
      'import jax, jax.numpy as jnp\nimport flax_shardmeta as fsm\n'
      + '\n' * padding
      + source
    )
  monkeypatch.syspath_prepend(str(tmp_path))
  mesh = fsm.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  _, params, x = _fsdp(mesh)
  for name in ('model_a', 'model_b'):
    module = __import__(name)

    def step(p, x, loss=module._fsdp_loss):
      grads = jax.grad(loss)(p, x)
      return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

    report = fsm.fit(fsm.jit(step, mesh=mesh, donate_argnums=0), params, x)
    sources[name] = {s for r in report.collectives for s in r.sources}
  assert any(
    s.startswith(str(tmp_path / 'model_a.py')) or 'model_a.py' in s
    for s in sources['model_a']
  )
  assert all('model_a.py' not in s for s in sources['model_b'])
  assert any('model_b.py' in s for s in sources['model_b'])


def test_fit_why_from_the_command_line():
  done = (
    subprocess.run(
      [
        sys.executable,
        '-m',
        'flax_shardmeta',
        'fit',
        '--model',
        'mlp',
        '--topology',
        'v5p:2x2x1',
        '--mesh',
        'data=2,model=2',
        '--batch',
        '64',
        '--why',
        '--no-cache',
      ],
      capture_output=True,
      text=True,
      timeout=600,
      check=False,
    )
    if _has_libtpu()
    else None
  )
  if done is None:
    pytest.skip('libtpu is not installed (the tpu extra; CI has it)')
  assert done.returncode == 0, done.stderr
  assert 'Why each collective is there' in done.stdout
  assert 'What looks unexpected' in done.stdout


def _has_libtpu():
  from flax_shardmeta._capacity import topology

  return topology.libtpu_available()
