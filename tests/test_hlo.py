"""Reading compiled HLO: loop trip counts, collectives and their mesh axes, work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._capacity.hlo import (
  collectives as hlo_collectives,
  summary as hlo,
  work as hlo_work,
)
from flax_shardmeta._capacity.hlo.flow import Flow
from flax_shardmeta._programs import compiled_text, hlo_text

ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def loop(limit: int, step: int, start: int = 0, body_op: str = '') -> str:
  """A module with one while loop ``for i in range(start, limit, step)``."""
  return (
    ADD
    + f"""
%cond (p: (s32[], f32[8])) -> pred[] {{
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant({limit})
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8] get-tuple-element(%p), index=1
  %r = f32[8] {body_op or 'all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add'}
  %k = s32[] constant({step})
  %j = s32[] add(%i, %k)
  ROOT %t = (s32[], f32[8]) tuple(%j, %r)
}}
ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {{
  %x = f32[8] parameter(0)
  %z = s32[] constant({start})
  %c = s32[] copy(%z)
  %t = (s32[], f32[8]) tuple(%c, %x)
  ROOT %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body
}}
"""
  )


@pytest.mark.parametrize(
  'limit, step, start, trips',
  [(32, 1, 0, 32), (16, 2, 0, 8), (10, 3, 1, 3), (5, 1, 5, 0)],
)
def test_trip_count_from_the_loop_condition_and_step(limit, step, start, trips):
  summary = hlo.summarize(loop(limit, step, start))
  assert summary.loops == (('w', trips),)
  ops = [(o.kind, o.runs, o.bytes, o.group_size) for o in summary.collectives]
  assert ops == ([('all-reduce', trips, 32, 2)] if trips else [])  # 0 trips: never


def test_known_trip_count_wins():
  text = loop(4, 1).replace(
    'body=%body', 'body=%body, backend_config={"known_trip_count":{"n":"7"}}'
  )
  assert hlo.summarize(text).loops == (('w', 7),)


def test_unknown_trip_counts_count_once():
  text = loop(4, 1).replace('direction=LT', 'direction=NE')
  summary = hlo.summarize(text)
  assert summary.loops == (('w', None),)
  assert summary.collectives[0].runs == 1


def test_nested_loops_multiply():
  inner = loop(3, 1)
  # The outer body runs the inner loop: rename the inner module's pieces.
  text = inner.replace('ENTRY %main', '%inner_main')
  outer = """
%ocond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
%obody (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8] get-tuple-element(%p), index=1
  %r = (s32[], f32[8]) call(%x), to_apply=%inner_main
  %y = f32[8] get-tuple-element(%r), index=1
  %k = s32[] constant(1)
  %j = s32[] add(%i, %k)
  ROOT %t = (s32[], f32[8]) tuple(%j, %y)
}
ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {
  %x = f32[8] parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8]) tuple(%z, %x)
  ROOT %w = (s32[], f32[8]) while(%t), condition=%ocond, body=%obody
}
"""
  summary = hlo.summarize(text + outer)
  assert summary.collectives[0].runs == 15


@pytest.mark.parametrize(
  'groups, axes',
  [
    ('replica_groups={{0,1,2,3},{4,5,6,7}}', ('model',)),
    ('replica_groups={{0,4},{1,5},{2,6},{3,7}}', ('data',)),
    ('replica_groups=[2,4]<=[8]', ('model',)),
    ('replica_groups=[4,2]<=[2,4]T(1,0)', ('data',)),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ('data',)),
    # As XLA writes it since jax 0.12: the mesh's own axis names.
    ("replica_groups=mesh['data'=2,'model'=4] {'model'}", ('model',)),
    # As libtpu writes it when the devices are not in iota order over its axes.
    (
      "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], "
      "device_ids=([2,4]T(1,0)) {'axis_0'}",
      ('model',),
    ),
    (
      "replica_groups=mesh['axis_0'=4,'axis_1'=2], "
      "device_ids=([4,2]<=[2,4]T(1,0)) {'axis_1'}",
      ('data',),
    ),
    ('replica_groups={{0,1,2,3,4,5,6,7}}', ('data', 'model')),
  ],
)
def test_collective_axes_from_every_replica_group_form(groups, axes):
  text = loop(2, 1, body_op=f'all-reduce(%x), {groups}, to_apply=%add')
  grid = np.arange(8).reshape(2, 4)
  (op,) = hlo.summarize(text, grid, ('data', 'model')).collectives
  assert op.axes == axes
  assert op.group_size == (8 if len(axes) == 2 else 2 if axes == ('data',) else 4)


def test_a_ring_of_permutes_is_over_every_axis_it_joins():
  # XLA's windowed einsum passes shards around a ring of all 8 devices: the
  # ring spans both axes, though each pair of neighbours differs in one.
  ring = ','.join(f'{{{i},{(i + 1) % 8}}}' for i in range(8))
  body = (
    f'collective-permute-start(%x), source_target_pairs={{{ring}}}, '
    'frontend_attributes={is_spmd_generated="true"}'
    '\n  %rd = f32[8] collective-permute-done(%r)'
  )
  text = loop(2, 1, body_op=body).replace('tuple(%j, %r)', 'tuple(%j, %rd)')
  grid = np.arange(8).reshape(2, 4)
  (op,) = hlo.summarize(text, grid, ('data', 'model')).collectives
  assert (op.kind, op.axes, op.group_size) == (
    'collective-permute',
    ('data', 'model'),
    8,
  )
  # Two rings of four, one per row: each over model alone.
  rows = ','.join(
    f'{{{r * 4 + i},{r * 4 + (i + 1) % 4}}}' for r in (0, 1) for i in range(4)
  )
  text = text.replace(ring, rows)
  (op,) = hlo.summarize(text, grid, ('data', 'model')).collectives
  assert (op.axes, op.group_size) == (('model',), 4)


def test_async_collectives_count_once_and_permute_pairs_name_their_axis():
  body = (
    'collective-permute-start(%x), source_target_pairs={{0,4},{4,0}}'
    '\n  %rd = f32[8] collective-permute-done(%r)'
  )
  text = loop(2, 1, body_op=body).replace('tuple(%j, %r)', 'tuple(%j, %rd)')
  grid = np.arange(8).reshape(2, 4)
  ops = hlo.summarize(text, grid, ('data', 'model')).collectives
  assert [(o.kind, o.runs, o.axes) for o in ops] == [
    ('collective-permute', 2, ('data',))
  ]


def test_parser_reads_tuples_layouts_and_comments():
  shape = (
    '(s32[]{:T(128)}, bf16[2,128,512]{2,1,0:T(8,128)(2,1)S(1)}, /*index=2*/f32[4])'
  )
  assert hlo_text.shape_bytes(shape) == 4 + 2 * 128 * 512 * 2 + 16
  line = f'  %w = {shape} while(%t), condition=%c, body=%b, metadata={{op_name="x"}}'
  inst = hlo_text.parse_instruction(line)
  assert inst is not None
  assert (inst.opcode, inst.operands, inst.called()) == (
    'while',
    ['t'],
    [('condition', 'c'), ('body', 'b')],
  )


# XLA's dumps under jax 0.12 leave get-tuple-element out: `%w#1` is element 1.
# A loop whose state goes round through such operands once looped the flow
# reader's tuple index forever.
DUMPED = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %n = f32[8]{0} negate(%p#1)
  ROOT %t = (s32[], f32[8]{0}) tuple(%p#0, %n)
}
%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] compare(%p#0, %p#0), direction=LT
}
ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %z = s32[] constant(0)
  %s = (s32[], f32[8]{0}) tuple(%z, %x)
  %w = (s32[], f32[8]{0}) while(%s), condition=%cond, body=%body
  ROOT %r = f32[8]{0} exp(%w#1)
}
"""


def test_a_dumps_element_operands_are_get_tuple_elements():
  comps = hlo_text.parse(DUMPED)
  body = {i.name: i for i in comps['body'].instructions}
  assert body['n'].operands == ['p#1']
  element = body['p#1']
  assert (element.opcode, element.operands, element.int_attribute('index')) == (
    'get-tuple-element',
    ['p'],
    1,
  )
  assert element.shape == 'f32[8]{0}'
  # The element comes before its first use, as XLA's own would.
  names = [i.name for i in comps['body'].instructions]
  assert names.index('p#1') < names.index('n')
  flow = Flow(comps)
  reach = flow.reach(comps['main'], 'x')
  assert reach.complete and reach.outputs == {0}
  assert flow.origin(comps['main'], 'r') is None  # exp does not move x


@pytest.mark.parametrize('length', [3, 5])
def test_real_scan_collectives_count_every_trip(length):
  """On XLA's own CPU program: per-step runs = outside + length x inside."""
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)

  def f(ws, x):
    def body(h, w):
      return jnp.tanh(h @ w), None

    return jax.lax.scan(body, x, ws)[0].sum()

  ws = jax.ShapeDtypeStruct(
    (length, 64, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, 'model'))
  )
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
  text = jax.jit(f).lower(ws, x).compile().as_text()
  summary = hlo.summarize(text, mesh.devices, mesh.axis_names)
  assert length in [n for _, n in summary.loops]
  in_text = sum(
    text.count(f' {kind}(') + text.count(f' {kind}-start(')
    for kind in hlo_collectives.COLLECTIVE_KINDS
  )
  runs = sum(op.runs for op in summary.collectives)
  inside = sum(1 for op in summary.collectives if op.runs == length)
  assert inside >= 1
  assert runs == (in_text - inside) + length * inside


def test_dot_and_convolution_flops_count_valid_window_positions():
  # A padded window over a size-1 spatial dimension: half its positions touch
  # input, as XLA's TPU programs express batched weight gradients.
  text = (
    'ENTRY %main (a: bf16[2048,100,1], b: bf16[2048,2,128]) -> bf16[2,128,100] {\n'
    '  %a = bf16[2048,100,1] parameter(0)\n'
    '  %b = bf16[2048,2,128] parameter(1)\n'
    '  ROOT %c = bf16[2,128,100] convolution(%a, %b), '
    'window={size=2 pad=1_1 rhs_reversal=1}, dim_labels=fb0_i0o->0fb\n'
    '}\n'
  )
  comp = hlo_text.parse(text)['main']
  conv = comp.instructions[-1]
  assert hlo_work.dot_flops(conv, comp) == 2 * 100 * 2048 * 128 * 2


def test_xlas_text_format_is_still_what_the_reader_reads():
  """Fails loudly when XLA changes how it prints a compiled program.

  A real compiled program with a known loop (7 trips) and a known collective
  (an all-reduce over 'data' inside the loop): the reader must find both, and
  read every computation, instruction, opcode and operand as XLA's own module
  objects have them.
  """
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)

  def f(x):
    def body(i, h):
      return (
        jnp.tanh(h)
        + jax.lax.with_sharding_constraint(
          h.sum(0, keepdims=True), NamedSharding(mesh, P())
        )
        * i
      )

    return jax.lax.fori_loop(0, 7, body, x)

  x = jax.ShapeDtypeStruct(
    (64, 32), jnp.float32, sharding=NamedSharding(mesh, P('data'))
  )
  compiled = jax.jit(f).lower(x).compile()
  text = compiled_text.program_text(compiled)
  computations = hlo_text.parse(text)
  assert compiled_text.disagreements(computations, compiled) == []
  summary = hlo.summarize_computations(computations, mesh.devices, mesh.axis_names)
  assert 7 in [n for _, n in summary.loops], summary.loops
  reduces = [c for c in summary.collectives if c.kind == 'all-reduce']
  assert reduces and all(c.runs == 7 and c.axes == ('data',) for c in reduces)


def test_disagreements_name_what_the_reader_got_wrong():
  compiled = jax.jit(lambda x: -x).lower(jnp.ones(4)).compile()
  computations = hlo_text.parse(compiled_text.program_text(compiled))
  entry = hlo_text.entry(computations)
  assert entry is not None
  root = entry.instructions[-1]
  root.opcode, root.operands = 'while', ['nothing']
  (found,) = compiled_text.disagreements(computations, compiled)
  assert f"{root.name}: opcode 'while'" in found


def test_attributes_are_read_at_the_top_level_only():
  line = (
    '  %r = f32[8] all-reduce(%x), channel_id=3, replica_groups={{0,1},{2,3}}, '
    'to_apply=%add, metadata={op_name="jit(f)/body=%fake index=9" source_line=1}'
  )
  inst = hlo_text.parse_instruction(line)
  assert inst is not None
  assert inst.called() == [('to_apply', 'add')]
  assert inst.int_attribute('index') is None
  assert inst.int_attribute('channel_id') == 3
  assert inst.attribute('replica_groups') == '{{0,1},{2,3}}'
  assert inst.first_group(4) == [0, 1]


def test_computations_of_another_execution_thread_close_where_they_end():
  """A TPU's SparseCore computations end with their thread's name: the reader
  must not read the next computation's instructions into them."""
  text = (
    '%region (a: f32[], b: f32[]) -> f32[] {\n'
    '  %a = f32[] parameter(0)\n'
    '  %b = f32[] parameter(1)\n'
    '  ROOT %s = f32[] add(%a, %b)\n'
    '}, execution_thread="sparsecore"\n'
    '\n'
    '%called (p: f32[8]) -> f32[8] {\n'
    '  ROOT %p = f32[8]{0} parameter(0)\n'
    '}, execution_thread="sparsecore"\n'
    '\n'
    'ENTRY %main (x: f32[8]) -> f32[8] {\n'
    '  %x = f32[8]{0} parameter(0)\n'
    '  %st = ((f32[8]{0}), f32[8]{0}) call-start(%x), '
    'async_execution_thread="sparsecore", to_apply=%called\n'
    '  ROOT %d = f32[8]{0} call-done(%st)\n'
    '}\n'
  )
  computations = hlo_text.parse(text)
  assert {n: len(c.instructions) for n, c in computations.items()} == {
    'region': 3,
    'called': 1,
    'main': 3,
  }
  assert [c.thread for c in computations.values()] == ['sparsecore'] * 2 + ['main']
  assert computations['main'].instructions[1].called() == [('to_apply', 'called')]


@pytest.mark.libtpu
def test_reader_agrees_with_xla_on_an_unrolled_nnx_mixture_of_experts():
  """On v5p the backward pass of top-k routing scatters on the SparseCore:
  computations of another execution thread, called asynchronously."""
  experts, dim, ffn = 4, 64, 128

  class Experts(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.normal(0.02)
      self.router = nnx.Param(init(rngs.params(), (dim, experts)))
      self.w_in = nnx.Param(init(rngs.params(), (experts, dim, ffn)))
      self.w_out = nnx.Param(init(rngs.params(), (experts, ffn, dim)))

    def __call__(self, x):
      probs = jax.nn.softmax(x @ self.router[...], axis=-1)
      gates, index = jax.lax.top_k(probs, 2)
      chosen = jax.nn.one_hot(index, experts)
      dispatch, combine = chosen.sum(2), (chosen * gates[..., None]).sum(2)
      tokens = jnp.einsum('gse,gsd->egsd', dispatch, x)
      h = jax.nn.gelu(jnp.einsum('egsd,edf->egsf', tokens, self.w_in[...]))
      out = jnp.einsum('egsf,efd->egsd', h, self.w_out[...])
      return jnp.einsum('gse,egsd->gsd', combine, out)

  class MoE(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([Experts(rngs) for _ in range(2)])

    def __call__(self, x):
      for layer in self.layers:  # unrolled: no scan
        x = x + layer(x)
      return x

  mesh = fsm.make_mesh((2, 2), ('data', 'model'), topology='v5p:2x2x1')
  graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(nnx.Rngs(0))))
  state = jax.tree.map(
    lambda v: jax.ShapeDtypeStruct(
      v.shape,
      v.dtype,
      sharding=NamedSharding(mesh, P('model' if v.ndim == 3 else None)),
    ),
    state,
  )
  x = jax.ShapeDtypeStruct(
    (8, 32, dim), jnp.float32, sharding=NamedSharding(mesh, P('data'))
  )

  def step(state, x):
    grads = jax.grad(lambda s: (nnx.merge(graphdef, s)(x) ** 2).mean())(state)
    return jax.tree.map(lambda w, g: w - 0.1 * g, state, grads)

  compiled = jax.jit(step).lower(state, x).compile()
  computations = hlo_text.parse(compiled_text.program_text(compiled))
  assert any(c.thread == 'sparsecore' for c in computations.values())
  assert compiled_text.disagreements(computations, compiled) == []
