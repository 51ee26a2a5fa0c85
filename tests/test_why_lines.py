"""``report.why()`` names the user's line that calls each layer.

Models a new user writes (two ``nn.Dense`` or ``nnx.Linear`` layers, blocks
unrolled or under ``nn.scan``, a ``shard_map`` with a ``ppermute``), each
row's ``where`` checked against the lines of this file: a layer's forward
collectives and its parameter's gradient name the line calling that layer,
not the loss, the ``relu`` between the layers or the other layer. On the 8
simulated CPU devices (tests/conftest.py), and on a TPU topology where
libtpu is installed; the axis types are stated at each mesh.
"""

import inspect
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._programs import name_stacks

S = jax.ShapeDtypeStruct
_INIT = nn.initializers.lecun_normal()


def _line(obj, marker):
  """The line number of ``obj``'s source holding ``marker``."""
  lines, start = inspect.getsourcelines(obj)
  return start + next(i for i, text in enumerate(lines) if marker in text)


def _at(sources, line):
  """Whether every source is this file's ``line``."""
  return bool(sources) and all(s.endswith(f'test_why_lines.py:{line}') for s in sources)


class TwoDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    up = fsm.with_partitioning(_INIT, (None, 'model'))
    down = fsm.with_partitioning(_INIT, ('model', None))
    h = nn.Dense(512, use_bias=False, kernel_init=up, name='up')(x)  # up
    h = nn.relu(h)
    return nn.Dense(128, use_bias=False, kernel_init=down, name='down')(h)  # down


def _mesh():
  return fsm.make_mesh((4, 2), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)


def _linen_step(model, mesh, features=128):
  def loss(params, x):
    return jnp.mean(model.apply(params, x) ** 2)  # the loss

  def step(params, x):
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((8, features)))
  x = fsm.Partitioned(S((64, features), jnp.float32), ('data', None))
  return fsm.jit(step, mesh=mesh, donate_argnums=0), params, x


def _check_two_layers(report, up_path, down_path, up_line, down_line):
  rows = report.collectives
  grads = {p: r.sources for r in rows if r.reason == 'gradient' for p in r.parameters}
  # Each gradient names the line that uses its parameter: not the loss's.
  assert set(grads) == {up_path, down_path}, rows
  assert _at(grads[up_path], up_line), grads
  assert _at(grads[down_path], down_line), grads
  # The down layer's partial sums (h sharded over 'model' times a kernel
  # sharded over 'model') are summed at the down layer's line, not the relu's.
  partial = [r for r in rows if r.reason == 'activation' and r.axes == ('model',)]
  assert partial and all(_at(r.sources, down_line) for r in partial), rows
  why = report.why()
  for path, line in ((up_path, up_line), (down_path, down_line)):
    shown = [text for text in why.splitlines() if f' {path} ' in text]
    assert shown and all(f'test_why_lines.py:{line}' in t for t in shown), why


def test_two_dense_layers_each_name_their_own_line():
  report = fsm.fit(*_linen_step(TwoDense(), _mesh()), cache=False)
  _check_two_layers(
    report,
    'params/params/up/kernel',
    'params/params/down/kernel',
    _line(TwoDense, '# up'),
    _line(TwoDense, '# down'),
  )


class TwoLinear(nnx.Module):
  def __init__(self, rngs):
    up = nnx.with_partitioning(_INIT, (None, 'model'))
    down = nnx.with_partitioning(_INIT, ('model', None))
    self.up = nnx.Linear(128, 512, use_bias=False, kernel_init=up, rngs=rngs)
    self.down = nnx.Linear(512, 128, use_bias=False, kernel_init=down, rngs=rngs)

  def __call__(self, x):
    h = self.up(x)  # up
    h = nnx.relu(h)
    return self.down(h)  # down


def test_two_nnx_linear_layers_each_name_their_own_line():
  mesh = _mesh()
  with jax.set_mesh(mesh):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TwoLinear(nnx.Rngs(0))))

  def loss(state, x):
    return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

  def step(state, x):
    grads = jax.grad(loss)(state, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)

  x = fsm.Partitioned(S((64, 128), jnp.float32), ('data', None))
  report = fsm.fit(fsm.jit(step, mesh=mesh, donate_argnums=0), state, x, cache=False)
  _check_two_layers(
    report,
    'state/up/kernel',
    'state/down/kernel',
    _line(TwoLinear.__call__, '# up'),
    _line(TwoLinear.__call__, '# down'),
  )


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    up = fsm.with_partitioning(_INIT, (None, 'model'))
    down = fsm.with_partitioning(_INIT, ('model', None))
    h = nn.relu(nn.Dense(256, use_bias=False, kernel_init=up)(x))  # block up
    return x + nn.Dense(128, use_bias=False, kernel_init=down)(h), None  # block down


class Unrolled(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(6):
      x, _ = Block(name=f'block_{i}')(x)
    return x


class Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    scan = nn.scan(
      Block,
      length=4,
      variable_axes={'params': 0},
      split_rngs={'params': True},
      metadata_params={fsm.PARTITION_NAME: None},
    )
    return scan(name='layers')(x)[0]


def test_a_row_over_six_unrolled_layers_says_six_layers():
  report = fsm.fit(*_linen_step(Unrolled(), _mesh()), cache=False)
  up, down = _line(Block, '# block up'), _line(Block, '# block down')
  rows = report.collectives
  for i in range(6):
    for name, line in (('Dense_0', up), ('Dense_1', down)):
      path = f'params/params/block_{i}/{name}/kernel'
      grad = [r for r in rows if r.reason == 'gradient' and path in r.parameters]
      assert grad and all(_at(r.sources, line) for r in grad), (path, rows)
  # One row sums the six down layers' partial sums: it says so.
  summed = [r for r in rows if r.reason == 'activation' and _at(r.sources, down)]
  assert [r.count for r in summed] == [6], rows
  assert len(summed[0].scopes) == 6
  shown = [t for t in report.why().splitlines() if f'test_why_lines.py:{down}' in t]
  assert any('6 layers' in t for t in shown), shown
  assert not any('6 layers' in t for t in shown if 'gradient' in t or '/kernel' in t)


def test_scanned_layers_name_the_lines_of_the_block():
  report = fsm.fit(*_linen_step(Scanned(), _mesh()), cache=False)
  up, down = _line(Block, '# block up'), _line(Block, '# block down')
  grads = {
    p: r.sources
    for r in report.collectives
    if r.reason == 'gradient'
    for p in r.parameters
  }
  assert _at(grads['params/params/layers/Dense_0/kernel'], up), grads
  assert _at(grads['params/params/layers/Dense_1/kernel'], down), grads
  partial = [
    r for r in report.collectives if r.reason == 'activation' and r.axes == ('model',)
  ]
  assert partial and all(_at(r.sources, up) or _at(r.sources, down) for r in partial)
  assert any(_at(r.sources, down) for r in partial), partial


def _stage(w1, w2, x):
  h = jnp.tanh(x @ w1)  # first matmul
  h = jax.lax.ppermute(h, 'stage', [(0, 1), (1, 0)])  # to the next stage
  return h @ w2  # second matmul


def test_a_ppermute_the_step_calls_is_explicit_and_its_weights_gradients_gradients():
  mesh = fsm.make_mesh((4, 2), ('data', 'stage'), axis_types=(AxisType.Explicit,) * 2)
  rows = P('data', 'stage')

  def loss(p, x):
    f = jax.shard_map(_stage, mesh=mesh, in_specs=(P(), P(), rows), out_specs=rows)
    return jnp.mean(f(p['w1'], p['w2'], x) ** 2)

  def step(p, x):
    grads = jax.grad(loss)(p, x)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

  w = S((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
  x = S((64, 512), jnp.float32, sharding=NamedSharding(mesh, rows))
  with jax.set_mesh(mesh):
    report = fsm.fit(
      jax.jit(step, donate_argnums=0), {'w1': w, 'w2': w}, x, cache=False
    )
  moved = [r for r in report.collectives if r.kind == 'collective-permute']
  assert moved and all(r.reason == 'explicit' for r in moved), report.collectives
  assert all(r.asked_by == 'ppermute' for r in moved)
  assert all(_at(r.sources, _line(_stage, '# to the next stage')) for r in moved)
  # The weights (replicated into the shard_map) have their gradients summed
  # over every device: gradients, naming their weight, at the matmul's line.
  grads = {
    p: r.sources
    for r in report.collectives
    if r.reason == 'gradient'
    for p in r.parameters
  }
  assert set(grads) == {'p/w1', 'p/w2'}, report.collectives
  assert _at(grads['p/w1'], _line(_stage, '# first matmul'))
  assert _at(grads['p/w2'], _line(_stage, '# second matmul'))
  assert not [r for r in report.collectives if r.reason == 'other']
  why = report.why()
  assert 'explicit:' in why and 'ppermute' in why
  unexpected = why.split('What looks unexpected:')[1]
  assert 'nothing' in unexpected and 'collective-permute' not in unexpected, why


def test_golden_file_sources_of_two_dense_layers_are_each_layers_line():
  snap = fsm.snapshot(*_linen_step(TwoDense(), _mesh()), cache=False)
  up, down = _line(TwoDense, '# up'), _line(TwoDense, '# down')
  by_parameter = {}
  for row in snap['collectives']:
    for p in row['parameters']:
      by_parameter.setdefault(p, set()).update(row['sources'])
  assert _at(by_parameter['params/params/up/kernel'], up), snap['collectives']
  assert _at(by_parameter['params/params/down/kernel'], down), snap['collectives']
  summed = [r for r in snap['collectives'] if r['reason'] == 'activation']
  assert summed and all(_at(r['sources'], down) for r in summed)


def test_the_compiled_programs_own_frames_reach_the_line_calling_the_layer():
  # XLA keeps frames innermost first, the layer's (flax's linear.py) before
  # the user's: read whole, the chain of the down layer's matmul reaches it.
  mesh = _mesh()
  model = TwoDense()
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((8, 128)))
  specs = jax.tree.map(lambda s: NamedSharding(mesh, s), fsm.get_partition_spec(params))
  x = S((64, 128), jnp.float32, sharding=NamedSharding(mesh, P('data', None)))
  params = jax.tree.map(
    lambda a, s: S(a.shape, a.dtype, sharding=s), fsm.unbox(params), specs
  )
  text = jax.jit(model.apply).trace(params, x).lower().compile().as_text()
  assert text is not None
  frames = name_stacks.stack_frames(text)
  down = _line(TwoDense, '# down')
  found = re.findall(r'op_name="[^"]*/down/dot_general" stack_frame_id=(\d+)', text)
  ids = {int(f) for f in found}
  assert ids, text[-2000:]
  for frame in ids:
    chain = frames[frame]
    assert any(
      file.endswith('test_why_lines.py') and line == down for file, line in chain
    ), chain


@pytest.mark.libtpu
@pytest.mark.slow
def test_two_dense_layers_each_name_their_own_line_on_a_tpu_topology():
  mesh = fsm.make_mesh(
    (2, 2), ('data', 'model'), topology='v5p:2x2x1', axis_types=(AxisType.Auto,) * 2
  )
  report = fsm.fit(*_linen_step(TwoDense(), mesh), cache=False)
  _check_two_layers(
    report,
    'params/params/up/kernel',
    'params/params/down/kernel',
    _line(TwoDense, '# up'),
    _line(TwoDense, '# down'),
  )
