"""fsm.audit_explicit: every site a step written for Auto axes needs for
Explicit ones, the fix that keeps its layout, and the fixed step.

The models (``explicit_models.py``) are written for Auto axes and mark each
line jax refuses under Explicit ones with ``# refused``. Meshes are
``jax.make_mesh`` over the 8 CPU devices with Auto axes: the audit makes them
Explicit itself.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import explicit_models as em  # noqa: E402

AUTO = AxisType.Auto
MODELS = pathlib.Path(em.__file__)
REFUSED = {
  i for i, line in enumerate(MODELS.read_text().splitlines(), 1)
  if line.endswith('# refused')
}  # fmt: skip


def auto_mesh(shape=(2, 4), names=('data', 'model')):
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(names))


def linen_case(mesh):
  with fsm.logical_axis_rules(em.RULES):
    x = jnp.ones((8, 16, em.EMBED))
    abstract = jax.eval_shape(lambda: em.LinenBlock().init(jax.random.key(0), x))
    params = fsm.as_abstract(abstract['params'], mesh)
  batch = jax.ShapeDtypeStruct((8, 16, em.EMBED), jnp.float32,
                               sharding=NamedSharding(mesh, P('data')))  # fmt: skip

  def step(params, x):
    loss, grads = jax.value_and_grad(em.linen_loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

  return step, params, batch


def nnx_case(mesh):
  with fsm.logical_axis_rules(em.RULES):
    abstract = nnx.eval_shape(lambda: em.NnxBlock(nnx.Rngs(0)))
    graphdef, state = nnx.split(fsm.nnx.as_abstract(abstract, mesh))
  batch = jax.ShapeDtypeStruct((8, 16, em.EMBED), jnp.float32,
                               sharding=NamedSharding(mesh, P('data')))  # fmt: skip

  def step(state, x):
    def loss(state):
      return nnx.merge(graphdef, state)(x)

    value, grads = jax.value_and_grad(loss)(state)
    return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), value

  return step, state, batch


@pytest.fixture(scope='module')
def linen_audit():
  step, params, batch = linen_case(auto_mesh())
  return fsm.audit_explicit(step, params, batch, rules=em.RULES), (step, params, batch)


@pytest.fixture(scope='module')
def nnx_audit():
  step, state, batch = nnx_case(auto_mesh())
  return fsm.audit_explicit(step, state, batch, rules=em.RULES), (step, state, batch)


def lines_of(report):
  out = set()
  for site in report.sites:
    file, line = site.where.rsplit(':', 1)
    assert file.endswith('explicit_models.py'), site.where  # never a library frame
    out.add(int(line))
  return out


def test_linen_sites_all_listed_in_one_run(linen_audit):
  report, _ = linen_audit
  linen_lines = {n for n in REFUSED if n < 55}
  assert lines_of(report) == linen_lines
  by_line = {int(s.where.rsplit(':', 1)[1]): s for s in report.sites}
  dense, matmul = (by_line[n] for n in sorted(linen_lines))
  # The Linen layer takes the contraction it runs, at the line making it (the
  # one before its call); a bare @ takes out_sharding.
  assert dense.op == 'dot_general' and dense.from_auto
  made = int(dense.where.rsplit(':', 1)[1]) - 1
  assert dense.replaces == (made, made)
  assert dense.fix == (
    "mlp_in = nn.Dense(MLP, kernel_init=logical(('embed', 'mlp')), use_bias=False, "
    'dot_general=functools.partial('
    f'jax.lax.dot_general, out_sharding={fsm._specs.format_spec(dense.spec)}))'
  )
  assert matmul.fix.startswith('return x + jnp.matmul(h, w, out_sharding=P(')
  assert 'ambiguous' in matmul.reason and matmul.operands[0].startswith(
    'float32[8@data'
  )
  assert report.compiles, report.error


def test_nnx_layer_gets_out_sharding(nnx_audit):
  report, _ = nnx_audit
  assert lines_of(report) == {n for n in REFUSED if n >= 55}
  (site,) = report.sites
  assert site.fix.startswith('y = self.down(h, out_sharding=P(')
  assert report.compiles, report.error


def concrete(tree, seed):
  rng = np.random.default_rng(seed)

  def fill(x):
    values = rng.standard_normal(x.shape).astype(x.dtype) * 0.1
    return jax.device_put(values, x.sharding)

  return jax.tree.map(fill, tree)


@pytest.mark.parametrize('case', ['linen_audit', 'nnx_audit'])
def test_fixed_step_trains_like_auto(case, request):
  report, (step, state, batch) = request.getfixturevalue(case)
  state, x = concrete(state, 0), concrete(batch, 1)
  auto_state, fixed_state = state, state
  auto_step = jax.jit(step)
  for _ in range(3):
    auto_state, auto_loss = auto_step(auto_state, x)
    fixed_state, fixed_loss = report.fixed_step(fixed_state, x)
    np.testing.assert_allclose(float(fixed_loss), float(auto_loss), rtol=1e-5)
  # It ran on Explicit axes.
  leaf = jax.tree.leaves(fixed_state)[0]
  assert set(leaf.sharding.mesh.axis_types) == {AxisType.Explicit}


@pytest.mark.parametrize('case', ['linen_audit', 'nnx_audit'])
def test_collectives_within_ten_percent_or_listed(case, request):
  report, _ = request.getfixturevalue(case)
  listed = ' '.join(report.costs_more())
  for key in set(report.auto.collectives) | set(report.explicit.collectives):
    auto = report.auto.collectives.get(key, 0)
    explicit = report.explicit.collectives.get(key, 0)
    if explicit > auto * 1.1:
      assert f'{key[0]} over {",".join(key[1])}' in listed


def test_report_text_and_json(linen_audit):
  report, _ = linen_audit
  text = str(report)
  assert text.startswith('Explicit axes audit on data=2 x model=4: 2 sites')
  assert 'With every fix the step compiles under Explicit axes' in text
  d = report.to_dict()
  assert len(d['sites']) == 2 and d['compiles'] is True
  assert {'where', 'op', 'operands', 'reason', 'spec', 'fix'} <= set(d['sites'][0])
  import json

  json.dumps(d)
  # Largest value first.
  sizes = [s.value_bytes for s in report.sites]
  assert sizes == sorted(sizes, reverse=True)


def test_size_one_axis_is_named(tmp_path):
  # maxtext#4208: a spec keeps a mesh axis of size 1.
  mesh = auto_mesh((2, 4, 1), ('data', 'model', 'seq'))
  spec = P('data', 'seq', 'model')
  x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32, sharding=NamedSharding(mesh, spec))

  def f(x):
    return jnp.sum(jnp.sin(x.reshape(8 * 16, 32)))

  report = fsm.audit_explicit(f, x)
  (note,) = [n for n in report.notes if n.kind == 'size-1 axis']
  assert "'seq'" in note.where and 'leave' in note.fix
  assert report.compiles


def test_custom_call_is_named_with_its_wrapper():
  from jax.experimental.custom_partitioning import custom_partitioning

  @custom_partitioning
  def double(x):
    return 2 * x

  def partition(mesh, arg_shapes, result_shape):
    s = arg_shapes[0].sharding
    return mesh, (lambda x: 2 * x), s, (s,)

  double.def_partition(
    partition=partition,
    infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
    sharding_rule='i j -> i j',
  )
  mesh = auto_mesh()
  z = jax.ShapeDtypeStruct(
    (8, 32), jnp.float32, sharding=NamedSharding(mesh, P('data', 'model'))
  )

  def g(z):
    return jnp.sum(double(z))

  report = fsm.audit_explicit(g, z)
  (note,) = [n for n in report.notes if n.kind == 'cannot see Explicit axes']
  assert note.where.endswith(f'test_audit.py:{g.__code__.co_firstlineno + 1}')
  assert "auto_axes(f, out_sharding=P('data', 'model'))" in note.fix


def test_two_names_on_one_axis_are_named():
  mesh = auto_mesh()
  tree = {'w': fsm.LogicalPartitioned(jax.ShapeDtypeStruct((8, 16), jnp.float32),
                                      ('embed', 'mlp'))}  # fmt: skip
  rules = [('embed', 'model'), ('mlp', 'model')]
  with fsm.logical_axis_rules(rules):
    params = fsm.as_abstract(tree, mesh)
  report = fsm.audit_explicit(lambda p: jnp.sum(p['w'].value), params, rules=rules)
  (note,) = [n for n in report.notes if n.kind == 'rule maps two names to one axis']
  # Paths start at the step's argument: the first is 0.
  assert note.where == '0/w' and 'already used by' in note.what


def test_audit_leaves_no_fixed_trace_behind():
  # The audit's fixes live in its own traces: the step still fails as
  # written under Explicit axes afterwards.
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AUTO, AUTO))
  x = jax.ShapeDtypeStruct(
    (8, 16), jnp.float32, sharding=NamedSharding(mesh, P('data', 'model'))
  )
  w = jax.ShapeDtypeStruct(
    (16, 4), jnp.float32, sharding=NamedSharding(mesh, P('model'))
  )
  f = jax.jit(lambda x, w: x @ w)
  assert len(fsm.audit_explicit(f, x, w).sites) == 1
  explicit = jax.make_mesh(
    (2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2
  )
  xs = jax.ShapeDtypeStruct(
    (8, 16), jnp.float32, sharding=NamedSharding(explicit, P('data', 'model'))
  )
  ws = jax.ShapeDtypeStruct(
    (16, 4), jnp.float32, sharding=NamedSharding(explicit, P('model'))
  )
  with jax.set_mesh(explicit), pytest.raises(Exception, match='ambiguous'):
    f.trace(xs, ws)


@pytest.mark.libtpu
@pytest.mark.parametrize('case', [linen_case, nnx_case], ids=['linen', 'nnx'])
def test_sites_on_a_tpu_topology(case):
  # A v5p pod's 8 chips, compiled for by libtpu on this machine.
  mesh = fsm.make_mesh((4, 2), ('data', 'model'), topology='v5p:2x2x2',
                       axis_types=(AUTO, AUTO))  # fmt: skip
  step, params, batch = case(mesh)
  report = fsm.audit_explicit(step, params, batch, rules=em.RULES)
  linen = case is linen_case
  assert lines_of(report) == {n for n in REFUSED if (n < 55) == linen}
  assert report.compiles, report.error
  assert report.mesh.devices.flat[0].platform == 'tpu'
  # Every collective of the Auto program is there, within 10%, or listed.
  listed = ' '.join(report.costs_more())
  assert report.auto is not None and report.explicit is not None
  for key, auto in report.auto.collectives.items():
    explicit = report.explicit.collectives.get(key, 0)
    assert abs(explicit - auto) <= 0.1 * auto or f'{key[0]} over' in listed


def test_command_line_audit(capsys):
  from flax_shardmeta import cli

  code = cli.main(
    ['audit', '--model', 'mlp', '--mesh', 'data=2,model=4', '--batch', '16']
  )
  out, err = capsys.readouterr()
  # The built-in MLP is written for both axis types: nothing to change.
  assert code == 0, err
  assert out.startswith('Explicit axes audit on data=2 x model=4: 0 sites')
  assert 'With every fix the step compiles under Explicit axes' in out
  code = cli.main(['audit', '--model', 'mlp', '--mesh', 'data=3,model=4'])
  assert code == 2
