"""why() on mixture-of-experts layers: tokens routed, or experts gathered.

A GShard-style layer (one-hot dispatch and combine einsums) on a data=2 x
expert=4 mesh of Auto axes, its experts laid over ``expert``. Without a
constraint on the routed tokens XLA keeps the tokens where they are and
gathers the experts to them: why() says the layer is not expert-parallel and
names the parameters. With the routed tokens' expert dimension constrained to
``expert``, XLA moves the tokens instead: why() lists those collectives as
``routing``, at the dispatch and combine lines of this file.
"""

from __future__ import annotations

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType

import flax_shardmeta as fsm
from flax_shardmeta._capacity.why.routing_lines import routing_roles
from flax_shardmeta._frames import import_path

EXPERTS, CAPACITY = 8, 4
RULES = [('batch', ('data', 'expert')), ('batch_no_exp', 'data'), ('expert', 'expert')]
# Many small tokens against small experts: left alone, XLA gathers the experts.
TOKENS = (64, 256, 32)


class Experts(nn.Module):
  """Top-1 routing with a fixed capacity, GShard's one-hot dispatch."""

  constrain: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d = x.shape[-1]
    router = self.param('router', nn.initializers.normal(0.02), (d, EXPERTS))
    names_in, names_out = ('expert', 'embed', 'mlp'), ('expert', 'mlp', 'embed')
    init = nn.initializers.normal(0.02)
    w_in = self.param(
      'w_in', fsm.with_logical_partitioning(init, names_in), (EXPERTS, d, 4 * d)
    )
    w_out = self.param(
      'w_out', fsm.with_logical_partitioning(init, names_out), (EXPERTS, 4 * d, d)
    )
    _, expert = jax.lax.top_k(x @ router, 1)
    chosen = jax.nn.one_hot(expert[..., 0], EXPERTS, dtype=jnp.int32)
    slot = jnp.cumsum(chosen, axis=1) - 1
    mask = (chosen[..., None] * jax.nn.one_hot(slot, CAPACITY)).astype(x.dtype)
    routed = jnp.einsum('btec,btd->becd', mask, x)  # dispatch
    if self.constrain:
      routed = fsm.with_logical_constraint(
        routed, ('batch_no_exp', 'expert', None, None)
      )
    hidden = jax.nn.relu(jnp.einsum('becd,edf->becf', routed, w_in))
    out = jnp.einsum('becf,efd->becd', hidden, w_out)
    if self.constrain:
      out = fsm.with_logical_constraint(out, ('batch_no_exp', 'expert', None, None))
    return jnp.einsum('becd,btec->btd', out, mask)  # combine


def _line(text: str) -> str:
  """This file's line holding ``text``, as why() names it."""
  source, first = inspect.getsourcelines(Experts.__call__)
  (k,) = [k for k, line in enumerate(source) if text in line]
  return f'{import_path(__file__)}:{first + k}'


DISPATCH, COMBINE = _line('# dispatch'), _line('# combine')
CONSTRAINT = _line('routed = fsm.with_logical_constraint(')
EXPERT_LINES = {_line("'becd,edf->becf'"), _line("'becf,efd->becd'")}


def _step(model: Experts):
  def step(params, x):
    grads = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, grads)

  return step


def _report(constrain: bool, mesh) -> fsm.FitReport:
  model = Experts(constrain)
  x = jax.ShapeDtypeStruct(TOKENS, jnp.float32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  batch = fsm.LogicalPartitioned(x, ('batch', None, None))
  with jax.set_mesh(mesh), fsm.logical_axis_rules(RULES):
    return fsm.fit(_step(model), params, batch, cache=False)


@pytest.fixture(scope='module')
def cpu_mesh():
  return jax.make_mesh((2, 4), ('data', 'expert'), axis_types=(AxisType.Auto,) * 2)


def test_the_routing_lines_are_the_dispatch_experts_and_combine():
  model = Experts()
  x = jnp.ones((2, 16, 8))
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  jaxpr = jax.make_jaxpr(_step(model))(params, x).jaxpr
  roles = routing_roles(jaxpr)
  assert roles[DISPATCH] == 'dispatch' and roles[COMBINE] == 'combine'
  assert {line for line, role in roles.items() if role == 'experts'} == EXPERT_LINES
  # The router and the masks made from its choice are routing, not tokens.
  assert _line('x @ router') not in roles and _line('mask = ') not in roles


def _check_gathered_experts(report: fsm.FitReport) -> None:
  paths = ('params/params/w_in', 'params/params/w_out')
  gathers = [r for r in report.collectives if r.reason == 'parameter']
  assert {p for r in gathers for p in r.parameters} == set(paths)
  for r in gathers:
    assert r.kind == 'all-gather' and 'expert' in r.axes
    assert r.change == 'batched dim 0 over expert -> whole', r
  why = report.why()
  finding = why.split('What looks unexpected:', 1)[1]
  text = ' '.join(finding.split())
  assert 'not expert-parallel: params/params/w_in, params/params/w_out are laid' in text
  assert 'XLA gathers them whole over expert for use' in text
  assert 'reduces the gradients over expert' in text
  assert "constrain the routed tokens' expert dimension to expert" in text
  assert not [r for r in report.collectives if r.reason == 'routing']
  # fit's notes say it as well, once.
  (note,) = [n for n in report.notes if n.startswith('not expert-parallel')]
  assert ' '.join(note.split()) in text
  assert ' '.join(note.split()) in ' '.join(str(report).split())


def _check_routed_tokens(report: fsm.FitReport) -> None:
  routing = [r for r in report.collectives if r.reason == 'routing']
  assert routing, report.why()
  sources = {s for r in routing for s in r.sources}
  assert DISPATCH in sources and COMBINE in sources
  assert sources <= {DISPATCH, COMBINE, *EXPERT_LINES}
  for r in routing:
    assert r.axes == ('expert',) and r.kind in ('all-to-all', 'all-gather'), r
    assert r.change.split(';')[0] in ('dispatch', 'experts', 'combine'), r
  # The experts stay: no gather of them, their gradients reduced over data only.
  assert not [r for r in report.collectives if r.reason == 'parameter']
  grads = [r for r in report.collectives if r.reason == 'gradient']
  assert grads and all(r.axes == ('data',) for r in grads)
  why = report.why()
  assert 'routing: ' in why and 'moving tokens to their experts and back' in why
  assert 'not expert-parallel' not in why
  assert not [n for n in report.notes if 'expert-parallel' in n]
  # The reason is the rows' in the JSON too.
  rows = report.to_dict()['collectives']
  assert {row['reason'] for row in rows} >= {'routing'}


@pytest.fixture(scope='module')
def routed(cpu_mesh) -> fsm.FitReport:
  return _report(True, cpu_mesh)


def test_gathered_experts_are_said_not_expert_parallel(cpu_mesh):
  _check_gathered_experts(_report(False, cpu_mesh))


def test_routed_tokens_are_routing_rows_at_dispatch_and_combine(routed):
  _check_routed_tokens(routed)


def test_the_masks_and_the_constrained_dispatch_buffer_are_told_apart(cpu_mesh):
  model = Experts(constrain=True)
  x = jnp.ones((2, 16, 8))
  params = jax.eval_shape(model.init, jax.random.key(0), x)
  masks: set[str] = set()
  with jax.set_mesh(cpu_mesh), fsm.logical_axis_rules(RULES):
    jaxpr = jax.make_jaxpr(_step(model))(params, x).jaxpr
  roles = routing_roles(jaxpr, masks)
  # The constraint on the routed tokens holds the dispatch buffer still.
  assert roles[CONSTRAINT] == 'dispatch' and roles[DISPATCH] == 'dispatch'
  assert {_line('top_k'), _line('mask = '), _line('slot = ')} <= masks
  assert not masks & set(roles) and '' not in masks


def test_peak_names_the_dispatch_and_combine_buffers_and_the_experts(routed):
  peak = routed.peak()
  lines = {r.role: set() for r in peak.rows if r.role}
  for r in peak.rows:
    if r.role:
      lines[r.role].add(r.where)
      assert r.kind in ('activation', 'backward', 'collective', 'offload'), r
  assert lines['dispatch'] <= {DISPATCH, CONSTRAINT} and lines['dispatch']
  assert lines['combine'] == {COMBINE}
  assert lines['experts'] and lines['experts'] <= EXPERT_LINES
  assert lines['mask'] <= {_line('top_k'), _line('mask = '), _line('slot = ')}
  assert _line('mask = ') in lines['mask']
  # Per layer: this layer is not scanned, one entry holding every role's bytes.
  (layer,) = peak.moe_layers()
  assert (layer.scope, layer.layers) == ('Experts', 1)
  assert layer.bytes == peak.by_role() and layer.per_layer == layer.total_bytes
  assert layer.total_bytes == sum(r.bytes for r in peak.rows if r.role)
  text = peak.format()
  assert 'mixture of experts, per layer' in text and '(dispatch buffer)' in text
  assert peak.to_dict()['by_role'] == peak.by_role()
  assert fsm.PeakMemory.from_dict(peak.to_dict()).by_role() == peak.by_role()


@pytest.mark.slow
@pytest.mark.libtpu
def test_the_same_on_a_tpu_topology():
  mesh = fsm.make_mesh(
    (2, 4), ('data', 'expert'), topology='v5p:2x2x2', axis_types=(AxisType.Auto,) * 2
  )
  _check_gathered_experts(_report(False, mesh))
  _check_routed_tokens(_report(True, mesh))


def _builtin_moe(rules, mesh) -> fsm.FitReport:
  from flax_shardmeta.examples import train

  build = train.builder(
    'moe-tiny', batch=8, seq=64, optimizer_name='sgd', dtype=jnp.float32
  )
  step, state, batch = build(mesh, rules, 'none')
  return fsm.fit(step, state, batch, cache=False)


def test_the_builtin_moe_under_ep_is_expert_parallel(cpu_mesh):
  from flax_shardmeta.examples import moe

  experts = {f'state/params/layers/{w}' for w in ('w1', 'w2', 'w3')}
  # The ep rules: the routed tokens' batch over data, their experts over expert.
  report = _builtin_moe(moe.MOE_RULES, cpu_mesh)
  gathered = {
    p for r in report.collectives if r.reason == 'parameter' for p in r.parameters
  }
  assert not gathered & experts, report.why()
  routing = [r for r in report.collectives if r.reason == 'routing']
  assert routing and {s.rsplit(':', 1)[0] for r in routing for s in r.sources} == {
    'flax_shardmeta/examples/moe.py'
  }
  assert {r.change.split(';')[0] for r in routing} <= {'dispatch', 'experts', 'combine'}
  assert 'not expert-parallel' not in report.why()
  # What the scan saves of each MoE layer, per layer: its stacked rows over 2.
  peak = report.peak()
  (stacked,) = [m for m in peak.moe_layers() if m.layers > 1]
  assert stacked.layers == 2 and stacked.scope == 'MoeTransformer/layers'
  dispatch = [r for r in peak.rows if r.role == 'dispatch' and r.layers == 2]
  assert dispatch and all(
    r.where.startswith('flax_shardmeta/examples/moe.py') for r in dispatch
  )
  assert stacked.bytes['dispatch'] == sum(r.bytes for r in dispatch) // 2
  assert stacked.bytes['experts'] > 0 and stacked.bytes['mask'] > 0
  # Without a batch for the routed tokens apart from the experts' axis, the
  # tokens stay on their batch shards and the experts are gathered to them.
  rules = [rule for rule in moe.MOE_RULES if rule[0] != 'batch_no_exp']
  report = _builtin_moe(rules, cpu_mesh)
  text = ' '.join(report.why().split())
  assert 'not expert-parallel: state/params/layers/w1, state/params/layers/w2,' in text
  gathered = {
    p for r in report.collectives if r.reason == 'parameter' for p in r.parameters
  }
  assert experts <= gathered


def _sorted_moe(x, router, w, dense):
  """Sort-based top-2 routing, as MaxText's sparse path does it, then a dense
  layer on the combined tokens."""
  gates, chosen = jax.lax.top_k(x @ router, 2)
  order = jnp.argsort(chosen.reshape(-1))
  grouped = jnp.repeat(x, 2, axis=0)[order]  # sorted dispatch
  hidden = jax.nn.relu(grouped @ w)  # sorted experts
  back = hidden[jnp.argsort(order)].reshape(x.shape[0], 2, -1)  # sorted combine
  out = jnp.einsum('tkd,tk->td', back, gates)  # weighted combine
  return jnp.tanh(out @ dense)  # after the layer


def test_the_gates_weighing_the_combined_tokens_end_the_routing():
  args = (jnp.ones((8, 4)), jnp.ones((4, 3)), jnp.ones((4, 4)), jnp.ones((4, 4)))
  roles = routing_roles(jax.make_jaxpr(_sorted_moe)(*args).jaxpr)
  source, first = inspect.getsourcelines(_sorted_moe)

  def line(text: str) -> str:
    (k,) = [k for k, s in enumerate(source) if text in s]
    return f'{import_path(__file__)}:{first + k}'

  assert roles[line('# sorted dispatch')] == 'dispatch'
  assert roles[line('# sorted experts')] == 'experts'
  assert roles[line('# sorted combine')] == 'combine'
  assert roles[line('# weighted combine')] == 'combine'
  # What follows the layer computes on plain activations: no role.
  assert line('# after the layer') not in roles


def test_a_windowed_einsum_ring_is_said_on_its_parameters_row():
  from flax_shardmeta._capacity.hlo.roofline import CollectiveRow
  from flax_shardmeta._capacity.why.readable import format_why

  ring = CollectiveRow(
    'collective-permute', ('fsdp', 'expert'), 1056, 2**30, reason='parameter',
    parameters=('params/query',), change='ring of 32 (windowed einsum)',
  )  # fmt: skip
  text = format_why([ring])
  assert 'params/query, ring of 32 (windowed einsum)' in text
