"""The programs jax traces and XLA compiles, read in one place (_programs).

XLA's memory analysis is read once, as one record that the cache, fit and the
Explicit audit share; hosts are counted by one function; the jaxpr walker
knows both scan parameter layouts; a model whose layers are scanned is
audited. Meshes: ``jax.make_mesh`` over the 8 CPU devices, Auto axes (the
audit makes its own Explicit copy).
"""

import ast
import json
import pathlib
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._programs import compiled_text, hosts, jaxprs
from flax_shardmeta._programs.memory import MEMORY_FIELDS, ProgramMemory, program_memory

PACKAGE = pathlib.Path(fsm.__file__).parent
RULES = [('batch', 'data'), ('embed', None), ('mlp', 'model')]


def auto_mesh():
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)


class Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    init = nn.initializers.lecun_normal()
    w1 = self.param(
      'w1', nn.with_logical_partitioning(init, ('embed', 'mlp')), (64, 128)
    )
    w2 = self.param(
      'w2', nn.with_logical_partitioning(init, ('mlp', 'embed')), (128, 64)
    )
    return h + jnp.tanh(h @ w1) @ w2, None  # refused


class Stack(nn.Module):
  """Four Blocks under nn.scan: one body, its parameters stacked over 'layers'."""

  @nn.compact
  def __call__(self, x):
    scanned = nn.scan(
      Block,
      variable_axes={'params': 0},
      split_rngs={'params': True},
      length=4,
      metadata_params={nn.PARTITION_NAME: 'layers'},
    )
    return scanned()(x, None)[0]


def scanned_case(mesh):
  with fsm.logical_axis_rules(RULES):
    x = jnp.ones((8, 64))
    abstract = jax.eval_shape(lambda: Stack().init(jax.random.key(0), x))
    params = fsm.as_abstract(abstract['params'], mesh)
  batch = jax.ShapeDtypeStruct(
    (8, 64), jnp.float32, sharding=NamedSharding(mesh, P('data'))
  )

  def loss(params, x):
    return jnp.mean(Stack().apply({'params': params}, x) ** 2)

  def step(params, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

  return step, params, batch


@pytest.fixture(scope='module')
def scanned_audit():
  step, params, batch = scanned_case(auto_mesh())
  return fsm.audit_explicit(step, params, batch, rules=RULES), (step, params, batch)


def test_a_scanned_model_is_audited_inside_its_scan_body(scanned_audit):
  report, _ = scanned_audit
  refused = [
    i
    for i, line in enumerate(pathlib.Path(__file__).read_text().splitlines(), 1)
    if line.endswith('# refused')
  ]
  (site,) = report.sites
  assert site.where.endswith(f'test_programs.py:{refused[0]}')
  assert site.op == 'dot_general' and site.count == 2  # forward and backward
  assert "out_sharding=P('data')" in site.fix
  assert report.compiles and report.error == ''


def test_the_audits_memory_is_fits_total_for_the_same_program(scanned_audit):
  report, (step, params, batch) = scanned_audit
  with fsm.logical_axis_rules(RULES), jax.set_mesh(auto_mesh()):
    fitted = fsm.fit(jax.jit(step), params, batch, cache=False)
  assert report.auto.memory == fitted.total_bytes


def test_the_audit_counts_generated_code_as_fit_does():
  # The CPU backend reports no generated code; TPU programs do (the audit
  # left it out before, and differed from fit's total by it).
  from flax_shardmeta._audit import figures

  stats = types.SimpleNamespace(
    argument_size_in_bytes=400,
    output_size_in_bytes=100,
    alias_size_in_bytes=100,
    temp_size_in_bytes=50,
    generated_code_size_in_bytes=7,
  )
  compiled = types.SimpleNamespace(memory_analysis=lambda: stats)
  assert figures._memory(compiled) == 400 + 100 - 100 + 50 + 7
  assert program_memory(compiled).step_total == 457


def test_the_memory_record_round_trips_through_json():
  x = jnp.ones((64, 64))
  compiled = jax.jit(lambda a: a @ a, donate_argnums=0).lower(x).compile()
  memory = program_memory(compiled)
  fields = json.loads(json.dumps(memory.to_dict()))
  assert list(fields) == list(MEMORY_FIELDS)
  assert ProgramMemory.from_dict(fields) == memory
  assert memory.step_total == memory.peak + memory.generated_code
  assert fields['argument_size_in_bytes'] == 64 * 64 * 4
  assert fields['alias_size_in_bytes'] == 64 * 64 * 4  # donated, counted once


def test_only_the_memory_reader_asks_xla_for_its_memory_analysis():
  callers = []
  for path in PACKAGE.rglob('*.py'):
    for node in ast.walk(ast.parse(path.read_text())):
      func = getattr(node, 'func', None) if isinstance(node, ast.Call) else None
      if isinstance(func, ast.Attribute) and func.attr == 'memory_analysis':
        callers.append(str(path.relative_to(PACKAGE)))
  assert set(callers) == {'_programs/memory.py'}, callers


def test_hosts_are_counted_from_any_device_set():
  gpus = [types.SimpleNamespace(process_index=i // 4) for i in range(8)]
  assert hosts.host_indices(gpus) == [0, 1]
  assert hosts.host_count(gpus) == 2 and hosts.devices_per_host(gpus) == 4
  # A numpy grid of devices, a mesh, and stand-ins without a process index.
  grid = np.array(gpus, dtype=object).reshape(2, 4)
  assert hosts.host_count(grid) == 2
  mesh = auto_mesh()
  assert hosts.host_count(mesh) == 1 and hosts.devices_per_host(mesh) == 8
  assert hosts.host_of(types.SimpleNamespace()) == 0


def test_the_walker_reads_a_scan_calls_and_sub_programs():
  def f(c, xs):
    @jax.checkpoint
    def body(c, x):
      return c + jnp.sin(x), c * x

    return jax.lax.scan(body, c, xs)

  (eqn,) = jax.make_jaxpr(f)(0.0, jnp.ones(3)).jaxpr.eqns
  body, consts, carry = jaxprs.scan_parts(eqn.params)
  assert (consts, carry) == (0, 1)
  assert [how for _, how in jaxprs.sub_jaxprs(eqn)] == ['scan']
  (inner,) = [e for e in body.jaxpr.eqns if jaxprs.inlined_body(e) is not None]
  assert inner.primitive.name in jaxprs.INLINED_CALLS
  with pytest.raises(jaxprs.UnknownParameters):
    jaxprs.scan_parts({'jaxpr': body})


def test_counts_read_off_program_text():
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
  layout = NamedSharding(auto_mesh(), P('data'))
  lowered = jax.jit(lambda a: jax.lax.with_sharding_constraint(a, layout)).lower(x)
  assert compiled_text.sharding_annotations(lowered.as_text()) >= 1
  text = 'ENTRY %m {\n  %a.remat = f32[4] copy(%b)\n  %t = f32[4,2] transpose(%c)\n}'
  assert compiled_text.rematerialized(text) == 1
  assert compiled_text.transposes(text) == 1
