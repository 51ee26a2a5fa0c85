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
  from flax_shardmeta._devices import topology

  return topology.libtpu_available()


# Combined reductions, constraints that asked, rings, every backend
# ------------------------------------------------------------------------------


def _mlp_loss(p, x):
  p = fsm.unbox(p)['params']
  h = jnp.tanh(x @ p['w1'])  # uses w1
  return jnp.mean((h @ p['w2']) ** 2)  # uses w2


def _mlp_step(p, x):
  loss, grads = jax.value_and_grad(_mlp_loss)(p, x)
  return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss


def _mlp(mesh):
  """Two FSDP weights with 'embed' over 'data', the batch over 'data', SGD:
  XLA sums both weights' gradients and the loss in one collective."""
  rules = [('batch', 'data'), ('embed', 'data'), ('mlp', None)]
  params = {
    'params': {
      'w1': fsm.LogicalPartitioned(S((256, 1024), jnp.float32), ('embed', 'mlp')),
      'w2': fsm.LogicalPartitioned(S((1024, 256), jnp.float32), ('mlp', 'embed')),
    }
  }
  x = fsm.LogicalPartitioned(S((512, 256), jnp.float32), ('batch', None))
  step = fsm.jit(_mlp_step, mesh=mesh, rules=rules, donate_argnums=0)
  return step, params, x


@pytest.fixture
def program_texts(monkeypatch):
  """The optimised HLO text of every program fit compiles in the test."""
  from flax_shardmeta._capacity.fit import compiled

  texts = []
  real = compiled._compiled_figures

  def keep(lowered, limit):
    found, text, parsed, peak_text = real(lowered, limit)
    texts.append(text)
    return found, text, parsed, peak_text

  monkeypatch.setattr(compiled, '_compiled_figures', keep)
  return texts


def _check_combined(report, text):
  from flax_shardmeta._programs import hlo_text

  rows = report.collectives
  grads = [r for r in rows if r.reason == 'gradient']
  assert {p for r in grads for p in r.parameters} == {'p/params/w1', 'p/params/w2'}
  assert all(len(r.parameters) == 1 for r in grads)
  assert not [r for r in rows if r.reason == 'activation'], rows
  assert [r.bytes for r in rows if r.reason == 'other'] == [4]  # the loss
  full = 256 * 1024 * 4
  assert sorted(r.bytes for r in grads) == [full, full]
  combined = [
    i
    for c in hlo_text.parse(text).values()
    for i in c.instructions
    if i.opcode.startswith('all-reduce') and len(i.operands) > 1
  ]
  for inst in combined:  # where XLA combined them: one row per value it sums
    assert hlo_text.shape_bytes(inst.shape) - 4 == sum(r.bytes for r in grads)
  text = report.why()
  assert 'p/params/w1' in text and 'p/params/w2' in text and 'activation' not in text


def test_a_combined_gradient_reduction_names_each_parameter(program_texts):
  mesh = fsm.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
  report = fsm.fit(*_mlp(mesh), cache=False)
  (text,) = program_texts
  assert 'all-reduce(' in text and ') all-reduce(' in text  # combined on CPU
  _check_combined(report, text)


@pytest.mark.libtpu
def test_gradient_reductions_name_each_parameter_on_a_tpu_topology(program_texts):
  mesh = fsm.make_mesh(
    (4,), ('data',), topology='v5p:2x2x1', axis_types=(AxisType.Auto,)
  )
  _check_combined(fsm.fit(*_mlp(mesh), cache=False), program_texts[-1])


def _two_constraints(p, x):
  p = fsm.unbox(p)['params']
  h = fsm.with_logical_constraint(jnp.tanh(x @ p['w1']), ('batch', None, 'mlp'))
  h = fsm.with_logical_constraint(h, (None, 'length', 'mlp'))  # second
  return jnp.mean((h @ p['w2']) ** 2)


def _two_constraint_step(p, x):
  loss, grads = jax.value_and_grad(_two_constraints)(p, x)
  return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss


def _check_constraints_asked(mesh):
  rules = [('batch', 'data'), ('length', 'data'), ('embed', None), ('mlp', None)]
  params = {
    'params': {
      'w1': fsm.LogicalPartitioned(S((128, 256), jnp.float32), ('embed', 'mlp')),
      'w2': fsm.LogicalPartitioned(S((256, 128), jnp.float32), ('mlp', 'embed')),
    }
  }
  x = fsm.LogicalPartitioned(S((16, 64, 128), jnp.float32), ('batch', None, 'embed'))
  step = fsm.jit(_two_constraint_step, mesh=mesh, rules=rules, donate_argnums=0)
  report = fsm.fit(step, params, x, cache=False)
  second = _line(_two_constraints, '# second')
  first = _line(_two_constraints, "('batch', None, 'mlp')")
  moves = [r for r in report.collectives if r.kind == 'all-to-all']
  assert moves, report.collectives
  # The forward pass's all-to-all is the second constraint's, at its line
  # (XLA places it at the next line's matmul); the backward pass's is asked
  # by the first constraint, whose layout the gradient goes back to.
  assert all(r.asked_by == 'constraint' for r in moves), moves
  assert any(s.endswith(second) for r in moves for s in r.sources), moves
  assert {s.rsplit('/', 1)[-1] for r in moves for s in r.sources} <= {first, second}
  assert report.why().endswith('nothing: every reshard was asked for.')


def test_a_constraint_that_changes_a_layout_asks_for_its_reshard():
  _check_constraints_asked(fsm.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,)))


@pytest.mark.libtpu
def test_a_constraint_asks_for_its_reshard_on_a_tpu_topology():
  mesh = fsm.make_mesh(
    (4,), ('data',), topology='v5p:2x2x1', axis_types=(AxisType.Auto,)
  )
  _check_constraints_asked(mesh)


_RING = 8


def _ring_local(w, x):
  """FSDP by hand: the weight gathered for use, its gradient's shards summed
  by a ring of permutes (what XLA's windowed einsums make of a reduce-scatter)."""
  whole = jax.lax.all_gather(w, 'data', axis=0, tiled=True)
  grad = jax.grad(lambda full: jnp.mean((x @ full.T) ** 2))(whole)
  rows, me = w.shape[0], jax.lax.axis_index('data')

  def chunk(k):
    return jax.lax.dynamic_slice_in_dim(grad, (k % _RING) * rows, rows)

  def hop(s, acc):  # each device ends with the sum of its own rows
    peers = [(j, (j - 1) % _RING) for j in range(_RING)]
    return jax.lax.ppermute(acc, 'data', peers) + chunk(me + s + 1)  # ring

  return w - 0.1 * jax.lax.fori_loop(1, _RING, hop, chunk(me + 1))


def test_a_permute_ring_over_a_gradient_is_that_gradient():
  mesh = fsm.make_mesh((_RING,), ('data',), axis_types=(AxisType.Explicit,))
  rows = P('data', None)

  def step(p, x):
    ring = jax.shard_map(_ring_local, mesh=mesh, in_specs=(rows, rows), out_specs=rows)
    return {'params': {'w': ring(p['params']['w'], x)}}

  w = S((1024, 256), jnp.float32, sharding=NamedSharding(mesh, rows))
  x = S((512, 256), jnp.float32, sharding=NamedSharding(mesh, rows))
  with jax.set_mesh(mesh):
    report = fsm.fit(jax.jit(step, donate_argnums=0), {'params': {'w': w}}, x)
  ring = [r for r in report.collectives if r.kind == 'collective-permute']
  assert ring and all(r.reason == 'gradient' for r in ring), report.collectives
  assert {p for r in ring for p in r.parameters} == {'p/params/w'}
  assert any(s.endswith(_line(_ring_local, '# ring')) for r in ring for s in r.sources)
  gathers = [r for r in report.collectives if r.kind == 'all-gather']
  assert [r.reason for r in gathers] == ['parameter']


def _small_t5(mesh):
  """A scanned encoder-decoder (T5 v1.1's layers, small widths), T5X's rules,
  adamw, the state donated."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  from benchmarks import _shapes

  config = _shapes.T5Config(
    vocab_size=512,
    dim=128,
    num_heads=4,
    head_dim=32,
    ffn_dim=256,
    encoder_layers=2,
    decoder_layers=2,
  )
  return _shapes.train_step('t5', mesh, batch=16, seq=64, config=config)


def _reasons(report):
  """Per parameter (or '-'), the reasons its collectives run for."""
  found = {}
  for r in report.collectives:
    for p in r.parameters or ('-',):
      found.setdefault(p, set()).add(r.reason)
  return found


_CPU_REASONS = {}


def _cpu_reasons():
  if not _CPU_REASONS:
    mesh = fsm.make_mesh((4, 2), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
    report = fsm.fit(*_small_t5(mesh), cache=False)
    _CPU_REASONS.update(_reasons(report))
  return _CPU_REASONS


def _check_same_reasons(topology):
  mesh = fsm.make_mesh(
    (4, 2), ('data', 'model'), topology=topology, axis_types=(AxisType.Auto,) * 2
  )
  report = fsm.fit(*_small_t5(mesh), cache=False)
  reasons, cpu = _reasons(report), _cpu_reasons()
  params = {p for p in cpu if p != '-'}
  assert len(params) >= 20
  assert {p: reasons.get(p) for p in params} == {p: cpu[p] for p in params}
  # Every weight is gathered for use and has its gradient reduced (FSDP; the
  # embedding is looked up where it lies); the rest reshards activations,
  # with the loss summed as 'other'.
  assert cpu['state/params/embedding'] == {'gradient'}
  weights = params - {'state/params/embedding'}
  assert all(cpu[p] == {'parameter', 'gradient'} for p in weights), cpu
  assert reasons['-'] <= {'activation', 'other'} and cpu['-'] <= {'activation', 'other'}


@pytest.mark.libtpu
def test_a_scanned_encoder_decoder_gets_the_same_reasons_on_tpu_as_on_cpu():
  _check_same_reasons('v5p:2x2x2')


@pytest.mark.cuda
def test_a_scanned_encoder_decoder_gets_the_same_reasons_on_gpu_as_on_cpu():
  _check_same_reasons('h100:1x8')


def test_an_estimate_says_its_collectives_are_unknown():
  mesh = jax.sharding.AbstractMesh((8,), ('data',), axis_types=(AxisType.Auto,))
  step, params, x = _mlp(mesh)
  report = fsm.fit(step, params, x)
  assert report.source == 'estimate'
  why = report.why()
  assert why.startswith('Why each collective is there: unknown without compiling.')
  assert 'topology=' in why and 'runs none' not in why
