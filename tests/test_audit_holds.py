"""fsm.audit_explicit holds on inputs beyond its first tests: every refused
line listed, the printed fixes compiling when pasted, custom_vjp under grad,
the user's shard_map mesh, arguments that are not arrays, a step that stops
on its own, and bad input from the command line.

Every mesh is ``jax.make_mesh`` over the 8 CPU devices with Auto axes (the
step as it runs today); the audit makes the axes Explicit itself.
"""

import importlib.util
import inspect
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm

AUTO, EXPLICIT = AxisType.Auto, AxisType.Explicit


def auto_mesh():
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AUTO, AUTO))


def arg(mesh, shape, spec):
  return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def concrete(tree, seed=0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda x: jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding),
    tree,
  )


# Two MLP blocks written for Auto axes. With the rules mlp -> model and
# embed -> data, w1/w3 are ('embed', 'mlp') and w2/w4 ('mlp', 'embed'): jax
# refuses both down-projections under Explicit axes.
TWO_BLOCKS = """\
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def loss(p, x):
  h = jax.nn.relu(x @ p['w1'])
  y = h @ p['w2']
  a = y @ p['w3']
  g = jax.nn.relu(a)
  out = g @ p['w4']
  return jnp.mean(out ** 2)


def step(p, x):
  value, grads = jax.value_and_grad(loss)(p, x)
  return jax.tree.map(lambda w, d: w - 0.1 * d, p, grads), value
"""


def load(path, name):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def two_block_args(mesh):
  embed_mlp, mlp_embed = P('data', 'model'), P('model', 'data')
  params = {
    'w1': arg(mesh, (16, 32), embed_mlp),
    'w2': arg(mesh, (32, 16), mlp_embed),
    'w3': arg(mesh, (16, 32), embed_mlp),
    'w4': arg(mesh, (32, 16), mlp_embed),
  }
  return params, arg(mesh, (8, 16), P())


def line_of(source, text):
  return next(i for i, line in enumerate(source.splitlines(), 1) if text in line)


def test_every_refused_down_projection_is_listed_and_pasted_fixes_compile(tmp_path):
  path = tmp_path / 'two_blocks.py'
  path.write_text(TWO_BLOCKS)
  model = load(path, 'two_blocks')
  params, x = two_block_args(auto_mesh())
  report = fsm.audit_explicit(model.step, params, x)
  lines = {int(s.where.rsplit(':', 1)[1]): s for s in report.sites}
  first = line_of(TWO_BLOCKS, "y = h @ p['w2']")
  second = line_of(TWO_BLOCKS, "out = g @ p['w4']")
  assert {first, second} <= set(lines), [s.where for s in report.sites]
  assert report.compiles, report.error
  # The claim holds of the code as printed: every fix pasted at its line,
  # traced by jax on Explicit axes, lowered and compiled.
  source = TWO_BLOCKS.splitlines()
  # Bottom up, so that a fix spanning other lines moves none still to come.
  for n, site in sorted(lines.items(), reverse=True):
    first_line, last_line = getattr(site, 'replaces', None) or (n, n)
    old = source[first_line - 1]
    indent = old[: len(old) - len(old.lstrip())]
    new = [indent + text for text in site.fix.splitlines()]
    source[first_line - 1 : last_line] = new
  imports = sorted({i for s in report.sites for i in getattr(s, 'imports', ())})
  fixed_path = tmp_path / 'two_blocks_fixed.py'
  fixed_path.write_text('\n'.join([*imports, *source]) + '\n')
  fixed = load(fixed_path, 'two_blocks_fixed')
  explicit = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(EXPLICIT,) * 2)
  params, x = two_block_args(explicit)
  with jax.set_mesh(explicit):
    jax.jit(fixed.step).trace(params, x).lower().compile()
  # As written, jax refuses the second down-projection too once the first is
  # fixed: only the fixed copy compiles.
  with jax.set_mesh(explicit), pytest.raises(Exception, match='ambiguous'):
    jax.jit(model.step).trace(params, x)


@jax.custom_vjp
def project(x, w):
  return x @ w  # the forward contraction


def _project_fwd(x, w):
  return project(x, w), (x, w)


def _project_bwd(res, g):
  x, w = res
  return g @ w.T, x.T @ g


project.defvjp(_project_fwd, _project_bwd)


def test_custom_vjp_under_grad_is_audited():
  mesh = auto_mesh()
  x, w = arg(mesh, (8, 16), P('data', 'model')), arg(mesh, (16, 4), P('model', None))
  step = jax.grad(lambda x, w: project(x, w).sum())
  report = fsm.audit_explicit(step, x, w)
  forward = line_of(inspect.getsource(sys.modules[__name__]), '# the forward contr')
  assert any(s.where.endswith(f'test_audit_holds.py:{forward}') for s in report.sites)
  assert 'custom' not in report.error.lower(), report.error
  assert report.compiles, report.error
  xs, ws = concrete(x, 1), concrete(w, 2)
  np.testing.assert_allclose(
    np.asarray(report.fixed_step(xs, ws)), np.asarray(jax.jit(step)(xs, ws)), rtol=1e-5
  )


def test_shard_map_given_the_users_mesh_runs_on_the_audits():
  mesh = auto_mesh()

  def step(x, w):
    y = jax.shard_map(
      lambda a, b: jax.lax.psum(a @ b, 'model'), mesh=mesh,
      in_specs=(P('data', 'model'), P('model')), out_specs=P('data'),
    )(x, w)  # fmt: skip
    return y.sum()

  x, w = arg(mesh, (8, 16), P('data', 'model')), arg(mesh, (16, 4), P('model'))
  report = fsm.audit_explicit(step, x, w)
  assert report.compiles, report.error
  assert report.sites == ()
  xs, ws = concrete(x, 1), concrete(w, 2)
  np.testing.assert_allclose(
    float(report.fixed_step(xs, ws)), float(jax.jit(step)(xs, ws)), rtol=1e-5
  )


def test_arguments_that_are_not_arrays_pass_through():
  mesh = auto_mesh()

  def step(x, w, scale, mode):
    y = x @ w
    return (y * scale).sum() if mode == 'scaled' else y.sum()

  x, w = arg(mesh, (8, 16), P('data', 'model')), arg(mesh, (16, 4), P('model'))
  report = fsm.audit_explicit(step, x, w, 2.0, 'scaled')
  (site,) = report.sites
  assert site.where.endswith(f':{step.__code__.co_firstlineno + 1}')
  assert report.compiles, report.error
  xs, ws = concrete(x, 1), concrete(w, 2)
  expected = jax.jit(step, static_argnums=3)(xs, ws, 2.0, 'scaled')
  got = report.fixed_step(xs, ws, 2.0, 'scaled')
  np.testing.assert_allclose(float(got), float(expected), rtol=1e-5)


def test_step_that_stops_on_its_own_keeps_the_sites_before():
  mesh = auto_mesh()

  def step(x, w):
    y = x @ w
    return y.reshape(3, -1).sum()  # 32 values: its own error, on any axes

  x, w = arg(mesh, (8, 16), P('data', 'model')), arg(mesh, (16, 4), P('model'))
  report = fsm.audit_explicit(step, x, w)
  first = step.__code__.co_firstlineno
  assert [s.where.rsplit(':', 1)[1] for s in report.sites] == [str(first + 1)]
  assert not report.compiles
  assert f'test_audit_holds.py:{first + 2}' in report.error
  text = str(report)
  assert 'compiles under Explicit' not in text
  assert 'found before that point' in text and 'reshape' in text


def test_out_sharding_fixes_say_they_need_a_mesh_in_context():
  mesh = auto_mesh()
  x, w = arg(mesh, (8, 16), P('data', 'model')), arg(mesh, (16, 4), P('model'))
  report = fsm.audit_explicit(lambda x, w: (x @ w).sum(), x, w)
  (note,) = [n for n in report.notes if n.kind == 'fixes need a mesh in context']
  assert 'jax.set_mesh(mesh)' in note.fix and 'initialization' in note.fix
  assert 'Explicit' in note.fix
  assert 'jax.set_mesh(mesh)' in str(report)
  # The note is true: the fixed line, run outside a mesh, is refused.
  xs, ws = jnp.ones((8, 16)), jnp.ones((16, 4))
  with pytest.raises(ValueError, match='mesh context'):
    jax.eval_shape(lambda x, w: jnp.matmul(x, w, out_sharding=P('data')), xs, ws)
  # No fix, no note.
  plain = fsm.audit_explicit(jnp.sum, x)
  assert not [n for n in plain.notes if n.kind == 'fixes need a mesh in context']


def test_mesh_from_context_and_none_at_all():
  mesh = auto_mesh()
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  with jax.set_mesh(mesh):
    assert fsm.audit_explicit(jnp.sum, x).compiles
  with pytest.raises(fsm.NoMeshError, match='jax.set_mesh'):
    fsm.audit_explicit(jnp.sum, x)


def test_jitted_step_with_static_arguments():
  mesh = auto_mesh()

  def step(x, w, n):
    for _ in range(n):  # a Python loop: n must stay a number
      x = x * 2
    return (x @ w).sum()

  jitted = jax.jit(step, static_argnums=2)
  x, w = arg(mesh, (8, 16), P('data', 'model')), arg(mesh, (16, 4), P('model'))
  report = fsm.audit_explicit(jitted, x, w, 3)
  assert len(report.sites) == 1 and report.compiles, report.error


def test_indivisible_argument_is_named():
  mesh = auto_mesh()
  x = arg(mesh, (6, 16), P('model'))
  with pytest.raises(fsm.ShardingError, match=r"dimension 0 of size 6 .*'model'"):
    fsm.audit_explicit(jnp.sum, x)


def test_command_line_indivisible_batch_is_bad_input(capsys):
  from flax_shardmeta import cli

  code = cli.main(
    ['audit', '--model', 'mlp', '--mesh', 'data=4,model=2', '--batch', '3']
  )
  _, err = capsys.readouterr()
  assert code == 2
  assert err.startswith('flax-shardmeta: error:') and 'Traceback' not in err
  assert 'not divisible' in err and 'IndivisibleError' not in err


def test_python_dash_m_audit_simulates_its_devices():
  # 16 devices: more than a plain process has; the command simulates them.
  done = subprocess.run(
    [sys.executable, '-m', 'flax_shardmeta', 'audit', '--model', 'mlp', '--mesh',
     'data=4,model=4', '--batch', '16'],
    capture_output=True, text=True, timeout=300,
    env={k: v for k, v in __import__('os').environ.items() if k != 'XLA_FLAGS'},
  )  # fmt: skip
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.startswith('Explicit axes audit on data=4 x model=4')


def test_a_mesh_that_is_not_one_or_not_the_arguments():
  x = arg(auto_mesh(), (8, 16), P('data', 'model'))
  with pytest.raises(fsm.NoMeshError, match=r"mesh='data' \(str\)"):
    fsm.audit_explicit(jnp.sum, x, mesh='data')
  other = jax.make_mesh((2, 4), ('x', 'y'), axis_types=(AUTO, AUTO))
  with pytest.raises(fsm.ShardingError, match="mesh axis 'data' .* not in the mesh"):
    fsm.audit_explicit(jnp.sum, x, mesh=other)


def test_a_step_that_is_not_callable_or_keywords_for_it_are_bad_input(
  tmp_path, monkeypatch, capsys
):
  x = arg(auto_mesh(), (8, 16), P('data', 'model'))
  # Once reported as the step stopping: "'NoneType' object is not callable".
  with pytest.raises(fsm.FlaxShardmetaError, match=r'step=None \(NoneType\) is not'):
    fsm.audit_explicit(None, x)
  with pytest.raises(fsm.FlaxShardmetaError, match='positional arguments only') as e:
    fsm.audit_explicit(lambda x, *, scale: x * scale, x, scale=2.0)
  assert 'scale=' in str(e.value) and 'functools.partial' in str(e.value)
  # From the command line, a factory returning no step is bad input: exit 2.
  (tmp_path / 'nostep.py').write_text(
    'import jax, jax.numpy as jnp\n'
    'def make(mesh, rules):\n'
    '  return None, jax.ShapeDtypeStruct((8, 16), jnp.float32)\n'
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  from flax_shardmeta import cli

  code = cli.main(['audit', '--module', 'nostep:make', '--mesh', 'data=2,model=4'])
  _, err = capsys.readouterr()
  assert code == 2 and 'Traceback' not in err and 'nostep:make' in err, err


def test_a_refusal_inside_a_flax_layer_without_out_sharding_is_said_in_words():
  import flax.linen as nn

  # nn.Embed's gather is refused under Explicit axes; Embed takes no
  # dot_general (it was once told to), so the fix names the layer's code.
  mesh = auto_mesh()
  table = arg(mesh, (64, 16), P('model', 'data'))
  tokens = jax.ShapeDtypeStruct(
    (8, 4), jnp.int32, sharding=NamedSharding(mesh, P('data'))
  )

  def loss(table, tokens):
    return jnp.mean(
      nn.Embed(64, 16).apply({'params': {'embedding': table}}, tokens) ** 2
    )

  report = fsm.audit_explicit(jax.grad(loss), table, tokens)
  (site,) = [s for s in report.sites if not s.gradient_only]
  assert site.replaces is None and 'dot_general=' not in site.fix, site.fix
  assert 'Embed.__call__ (flax/linen/linear.py:' in site.fix, site.fix
  assert 'out_sharding=P(' in site.fix and report.compiles
  # What was compiled for it is said: the operation's own fix, not the words.
  assert '(a fix in words): the refused operation given the layout' in str(report)


def test_the_report_says_what_was_compiled_for_an_auto_axes_fix():
  mesh = auto_mesh()
  table = arg(mesh, (64, 16), P('model', 'data'))
  tokens = jax.ShapeDtypeStruct(
    (8, 4), jnp.int32, sharding=NamedSharding(mesh, P('data'))
  )
  report = fsm.audit_explicit(lambda t, i: jnp.take(t, i, axis=0).sum(), table, tokens)
  (site,) = report.sites
  assert site.how == 'auto_axes' and report.compiles
  assert 'Compiled for site 1: jax.sharding.auto_axes around the refused operation' in (
    str(report)
  )
  x, w = arg(mesh, (8, 16), P(None, 'model')), arg(mesh, (16, 4), P('model'))
  plain = fsm.audit_explicit(lambda x, w: x @ w, x, w)
  assert plain.sites and 'Compiled for site' not in str(plain)
