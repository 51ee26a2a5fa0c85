"""why() and peak() on a shard_map routing with ragged all-to-alls, compiled
for H100 and B200 nodes by jax's CUDA plugin (no GPU needed).

Each chip holds one expert and its own tokens; a ``top_k`` picks each token's
expert, the tokens are sorted by it and sent to their experts' chips with
``jax.lax.ragged_all_to_all``, the experts run, and a second ragged all-to-all
brings them back. XLA keeps both exchanges as ragged all-to-alls, without a
name of their own: why() puts them at the two exchange lines of this file as
``routing``, and says which link they cross: NVLink with the experts inside a
node, the network with them spread over two. The meshes have Explicit axes
(fsm.make_mesh's default); the routing is all inside ``shard_map``.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._frames import import_path

pytestmark = pytest.mark.cuda

D, F, T = 256, 1024, 512  # model dim, expert hidden dim, tokens per chip


def route(x, router, w_in, w_out):
  """One chip's tokens ``x`` (T, D) to their experts (one per chip) and back."""
  n = jax.lax.axis_size('expert')
  _, chosen = jax.lax.top_k(x @ router, 1)
  expert = chosen[:, 0]
  order = jnp.argsort(expert)
  grouped = x[order]
  sizes = jnp.bincount(expert, length=n).astype(jnp.int32)
  offsets = jnp.cumsum(sizes) - sizes
  table = jax.lax.all_gather(sizes, 'expert')  # senders x receivers
  me = jax.lax.axis_index('expert')
  placed = (jnp.cumsum(table, axis=0) - table)[me]
  received = table[:, me]
  buffer = jnp.zeros((n * T, D), x.dtype)
  arrived = jax.lax.ragged_all_to_all(
    grouped, buffer, offsets, sizes, placed, received, axis_name='expert'
  )
  y = jax.nn.relu(arrived @ w_in[0]) @ w_out[0]
  back = (jnp.cumsum(table.T, axis=0) - table.T)[me]
  home = jnp.zeros((T, D), x.dtype)
  returned = jax.lax.ragged_all_to_all(
    y, home, jnp.cumsum(received) - received, received, back, sizes, axis_name='expert'
  )
  return returned[jnp.argsort(order)]


def _line(text: str) -> str:
  source, first = inspect.getsourcelines(route)
  (k,) = [k for k, line in enumerate(source) if text in line]
  return f'{import_path(__file__)}:{first + k}'


DISPATCH, COMBINE = _line('arrived = '), _line('returned = ')
EXPERTS = _line('y = jax.nn.relu')


def _report(topology: str, shape: tuple[int, ...], names: tuple[str, ...]):
  mesh = fsm.make_mesh(shape, names, topology=topology)
  n = mesh.shape['expert']
  tokens = P(names)  # every chip its own tokens
  ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
  params = {
    'router': jax.ShapeDtypeStruct((D, n), jnp.float32, sharding=ns()),
    'w_in': jax.ShapeDtypeStruct((n, D, F), jnp.float32, sharding=ns('expert')),
    'w_out': jax.ShapeDtypeStruct((n, F, D), jnp.float32, sharding=ns('expert')),
  }
  x = jax.ShapeDtypeStruct((mesh.size * T, D), jnp.float32, sharding=ns(names))
  moe = jax.shard_map(
    route,
    mesh=mesh,
    in_specs=(tokens, P(), P('expert'), P('expert')),
    out_specs=tokens,
  )

  def step(p, x):
    loss = lambda p: jnp.mean(moe(x, p['router'], p['w_in'], p['w_out']) ** 2)  # noqa: E731
    grads = jax.grad(loss)(p)
    return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)

  with jax.set_mesh(mesh):
    return fsm.fit(jax.jit(step), params, x, cache=False)


@pytest.mark.parametrize(
  'topology, shape, names, link',
  [
    ('h100:2x8', (2, 8), ('data', 'expert'), 'nvlink'),
    ('h100:2x8', (16,), ('expert',), 'network'),
    ('b200:2x8', (16,), ('expert',), 'network'),
  ],
  ids=[
    'h100-experts-inside-a-node',
    'h100-experts-over-two-nodes',
    'b200-over-two-nodes',
  ],
)
def test_ragged_all_to_alls_are_routing_at_the_exchange_lines(
  topology, shape, names, link
):
  report = _report(topology, shape, names)
  routing = [r for r in report.collectives if r.reason == 'routing']
  ragged = {r.change.split(';')[0]: r for r in routing if 'ragged' in r.change}
  assert set(ragged) == {'dispatch', 'combine'}, routing
  assert ragged['dispatch'].sources == (DISPATCH,)
  assert ragged['combine'].sources == (COMBINE,)
  assert all(r.kind in ('all-to-all', 'all-gather') for r in routing)
  # Where XLA splits an exchange, parts sit at the sort and unsort lines.
  near = {_line('grouped = '), _line('return returned')}
  assert {s for r in routing for s in r.sources} <= {DISPATCH, COMBINE, EXPERTS, *near}
  # Which link the tokens cross: NVLink inside a node; with the experts over
  # two nodes, the network (newer XLAs split the exchange: its part inside a
  # node on NVLink, the rest across).
  links = {r.link for r in routing}
  assert links == {'nvlink'} if link == 'nvlink' else 'network' in links
  block = report.why().split('routing:', 1)[1].split('\n\n', 1)[0]
  assert link in block
  assert 'not expert-parallel' not in report.why()
  # The experts stay: no parameter moves over expert.
  assert not [
    r for r in report.collectives if r.reason == 'parameter' and 'expert' in r.axes
  ]
  # peak(): what the experts compute on the tokens that arrived.
  peak = report.peak()
  assert {r.where for r in peak.rows if r.role == 'experts'} <= {EXPERTS, COMBINE}
  assert peak.by_role().get('experts', 0) > 0


def test_a_ragged_dispatch_moves_at_most_its_send_buffer():
  report = _report('h100:2x8', (2, 8), ('data', 'expert'))
  (dispatch,) = [
    r for r in report.collectives if r.change.startswith('dispatch; ragged')
  ]
  assert dispatch.bytes == T * D * 4 and dispatch.link == 'nvlink'
