"""Reading jax's name stacks as XLA keeps them, the same on CPU, TPU and GPU.

The op_names below are copied from optimised programs XLA compiled for the
scanned T5 encoder-decoder and mixture-of-experts of benchmarks/_shapes.py,
the Llama example (Linen with remat, NNX) and an unrolled NNX
mixture-of-experts, on the CPU mesh, v5p:2x2x1 and h100:1x8, with jax 0.10
and 0.12.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._capacity.hlo import collectives as hlo_collectives
from flax_shardmeta._programs import (
  compiled_text,
  hlo_text,
  name_stacks as hlo_metadata,
)

# (op_name, scope, primitive)
REAL = [
  # Every backend: one name per instruction.
  (
    'jit(step)/transpose(jvp(MoE))/while/body/closed_call/layers/Experts_0/'
    'egcd,edf->egcf/dot_general',
    'MoE/layers/Experts_0',
    'dot_general',
  ),
  (
    'jit(step)/jvp(MoE)/while/body/closed_call/layers/Experts_0/jit(_one_hot)/eq',
    'MoE/layers/Experts_0',
    'eq',
  ),
  (
    'jit(step)/transpose(jvp(MoE))/while/body/closed_call/layers/Experts_0/scatter-add',
    'MoE/layers/Experts_0',
    'scatter-add',
  ),
  ('jit(step)/jvp(MoE)/jit(_take)/gather', 'MoE', 'gather'),
  ('jit(step)/jvp()/reduce_max', '', 'reduce_max'),
  ('jit(step)/jvp(MoE)/while', 'MoE', 'while'),
  # Constants jvp left alone lose the transformation and the model's name.
  ('jit(step)/layers/Experts_0/jit(_one_hot)/iota', 'layers/Experts_0', 'iota'),
  ('jit(step)/jit(tril)/ge', '', 'ge'),
  ('jit(step)/jit(tree_bias_correction)/pow', 'tree_bias_correction', 'pow'),
  # jax 0.12: eval_jaxpr where 0.10 wrote closed_call; the slice of a scanned
  # parameter is made outside the layer's scope.
  (
    'jit(step)/jvp(MoE)/while/body/eval_jaxpr/layers/Experts_0/jit(_one_hot)/eq',
    'MoE/layers/Experts_0',
    'eq',
  ),
  ('jit(step)/jvp(MoE)/while/body/jit(dynamic_index_in_dim)/squeeze', 'MoE', 'squeeze'),
  # Linen with remat; flax's constraint on a scanned parameter (jax 0.12).
  (
    'jit(step)/transpose(jvp(Llama))/while/body/eval_jaxpr/checkpoint/'
    'rematted_computation/layers/layers._param/sharding_constraint',
    'Llama/layers/layers._param',
    'sharding_constraint',
  ),
  (
    'jit(step)/transpose(jvp(T5))/while/body/closed_call/checkpoint/decoder/'
    'self/bqhd,bkhd->bhqk/dot_general',
    'T5/decoder/self',
    'dot_general',
  ),
  # NNX: no module scopes; the einsum spec is the scope jvp entered.
  ('jit(step)/transpose(jvp(gse,egsd->gsd))/dot_general', '', 'dot_general'),
  # Reducers' instructions carry a name relative to their caller.
  ('layers/Attention_0/reduce_max', 'layers/Attention_0', 'reduce_max'),
  # Instructions XLA made, and arguments' paths (unescaped).
  ('broadcast.114', '', 'broadcast'),
  ('p.0.lhs.1', '', ''),  # a sort's comparator (h100:1x8)
  ('state.step', '', ''),
  ("state.params['layers']['Experts_0']['router'].value", '', ''),
  # Older jax (0.4) on GPU, as published: jit(main), shard_map's body, and a
  # primitive's parameters.
  (
    'jit(do_fft)/jit(main)/jit(do_fft)/jit(fft3d)/jit(shmap_body)/all_to_all['
    "axis_name=('z',) split_axis=2 concat_axis=1 axis_index_groups=None tiled=True]",
    'do_fft/fft3d',
    'all_to_all',
  ),
  # Two operations folded into one (every backend, the unrolled NNX MoE).
  (
    'jit(step)/transpose(jvp())/mul;jit(step)/transpose(jvp())/broadcast_in_dim',
    '',
    'mul',
  ),
  # CPU: merged names, '/' inside parentheses.
  (
    'jit(step)/jvp(MoE)/while/body/closed_call/layers/Experts_0/'
    '(gsec,egcd->gsd/dot_general:reduce_sum)',
    'MoE/layers/Experts_0',
    'dot_general',
  ),
  (
    'jit(step)/(transpose(jvp(MoE))/dot_general:jvp(jit(take_along_axis))/gather)',
    '',
    'dot_general',
  ),
  (
    'jit(step)/(transpose(jvp(T5))/decoder_norm/reduce_sum:transpose(jvp(T5))/'
    'encoder_norm/reduce_sum:transpose(jvp(T5))/dot_general:jvp()/reduce_sum)',
    '',
    'reduce_sum',
  ),
  (
    'jit(step)/transpose(jvp(T5))/while/body/eval_jaxpr/decoder/self/'
    '(bqe,ehd->bqhd/dot_general:bke,ehd->bkhd/dot_general:bke,ehd->bkhd/dot_general)',
    'T5/decoder/self',
    'dot_general',
  ),
  # GPU: combined collectives and fusions.
  ('jit(step)/jvp(MoE)/(jit(_take)/gather:norm/mul:dot_general)', 'MoE', 'gather'),
  (
    'jit(step)/transpose(jvp(MoE))/(dot_general:jit(_take)/scatter-add)',
    'MoE',
    'dot_general',
  ),
  (
    'jit(step)/transpose(jvp(MoE))/while/body/closed_call/layers/(mlp_norm/mul:'
    'Experts_0/egcf,efd->egcd/dot_general:Experts_0/egcd,edf->egcf/dot_general)',
    'MoE/layers',
    'mul',
  ),
  (
    'jit(step)/jvp(MoE)/while/body/(eval_jaxpr/layers/Experts_0/top_k:'
    'jit(dynamic_index_in_dim)/squeeze:jit(dynamic_index_in_dim)/squeeze)',
    'MoE',
    'top_k',
  ),
  (
    'jit(step)/transpose(jvp(T5))/while/body/eval_jaxpr/decoder/'
    '(cross_attention_norm/reduce_sum:mlp_norm/reduce_sum:self_attention_norm/'
    'reduce_sum)',
    'T5/decoder',
    'reduce_sum',
  ),
  # Not copied: the form of the GPU name that, read by '/' alone, gave the
  # scope '(jvp(jit(_one_hot))' and the primitive 'dot_general)'.
  (
    'jit(step)/jvp(MoE)/(jvp(jit(_one_hot))/eq:layers/dot_general)',
    'MoE',
    'eq',
  ),
]


@pytest.mark.parametrize('op_name, scope, primitive', REAL)
def test_scope_and_primitive_of_real_names(op_name, scope, primitive):
  assert hlo_metadata.scope_of(op_name) == scope
  assert hlo_metadata.primitive_of(op_name) == primitive


def test_the_scope_of_merged_names_is_what_each_shares():
  op_name = (
    'jit(step)/transpose(jvp(MoE))/while/body/closed_call/layers/(mlp_norm/mul:'
    'Experts_0/egcf,efd->egcd/dot_general:Experts_0/egcd,edf->egcf/dot_general)'
  )
  names = hlo_metadata.merged_names(op_name)
  assert [hlo_metadata.scope_of(n) for n in names] == [
    'MoE/layers/mlp_norm',
    'MoE/layers/Experts_0',
    'MoE/layers/Experts_0',
  ]
  assert [hlo_metadata.primitive_of(n) for n in names] == ['mul'] + ['dot_general'] * 2
  assert hlo_metadata.name_stack(op_name)[-2:] == [
    'layers',
    '(mlp_norm/mul:Experts_0/egcf,efd->egcd/dot_general:Experts_0/egcd,edf->egcf/'
    'dot_general)',
  ]


def test_a_name_cut_short_splits_at_every_slash():
  assert hlo_metadata.name_stack('jit(step)/(jvp(M)/mul:layers/dot') == [
    'jit(step)',
    '(jvp(M)',
    'mul:layers',
    'dot',
  ]
  assert hlo_metadata.scope_of('jit(step)/(jvp(M)/mul:layers/dot') == ''


@pytest.mark.parametrize(
  'line, op_name, frame',
  [
    (  # a scope with a quote and a backslash (jax.named_scope)
      r'  ROOT %sin.0 = f32[3]{0} sine(%param_0), metadata={op_name="jit(f)/say '
      r'\"hi\"\\there/sin" stack_frame_id=2}',
      'jit(f)/say "hi"\\there/sin',
      2,
    ),
    (  # an argument's path (h100:1x8)
      r'  %dynamic-slice.194.3 = s32[1]{0} dynamic-slice(%param_1.1770, '
      r'%param_2.1245), dynamic_slice_sizes={1}, metadata={op_name="state.params['
      r'\'layers\'][\'Experts_0\'][\'router\'].value'
      r'" scheduling_name="dynamic-slice.194.3"}',
      "state.params['layers']['Experts_0']['router'].value",
      None,
    ),
    (  # older XLA: the file and line in the metadata
      '  %m = f32[4]{0} multiply(%a, %b), metadata={op_type="mul" '
      'op_name="jit(f)/mul" source_file="/w/m.py" source_line=12}',
      'jit(f)/mul',
      '/w/m.py:12',
    ),
  ],
)
def test_metadata_of_real_lines(line, op_name, frame):
  inst = hlo_text.parse_instruction(line)
  assert inst is not None
  assert inst.op_name() == op_name
  assert inst.frame() == frame


def test_hlo_text_still_offers_the_metadata_readers():
  assert hlo_text.stack_frames is hlo_metadata.stack_frames
  assert hlo_text.read_op_name is hlo_metadata.read_op_name


# One scanned program on three backends
# ------------------------------------------------------------------------------


class Mix(nn.Module):
  @nn.compact
  def __call__(self, x):
    w = self.param('w', nn.initializers.normal(), (64, 64))
    return jnp.einsum('bd,de->be', x, w)


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    w1 = self.param('w1', nn.initializers.normal(), (64, 256))
    w2 = self.param('w2', nn.initializers.normal(), (256, 64))
    return jnp.tanh(x @ w1) @ w2


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    x = x + Mix(name='mix')(x)
    return x + Mlp(name='mlp')(x), None


class Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    layers = nn.scan(
      Block, length=3, variable_axes={'params': 0}, split_rngs={'params': True}
    )
    return layers(name='layers')(x, None)[0]


def _collective_names(mesh) -> list[str]:
  """The op_names of the collectives of a scanned model's training step,
  its parameters over both axes (FSDP and tensor parallel)."""
  model = Model()
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((8, 64))))
  specs = {
    'w': P(None, 'data', 'model'),
    'w1': P(None, 'data', 'model'),
    'w2': P(None, 'model', 'data'),
  }
  params = jax.tree_util.tree_map_with_path(
    lambda path, v: jax.ShapeDtypeStruct(
      v.shape, v.dtype, sharding=NamedSharding(mesh, specs[path[-1].key])
    ),
    shapes['params'],
  )
  x = jax.ShapeDtypeStruct(
    (16, 64), jnp.float32, sharding=NamedSharding(mesh, P('data'))
  )

  def step(p, x):
    grads = jax.grad(lambda p: (model.apply({'params': p}, x) ** 2).mean())(p)
    return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)

  compiled = jax.jit(step).lower(params, x).compile()
  computations = hlo_text.parse(compiled_text.program_text(compiled))
  assert compiled_text.disagreements(computations, compiled) == []
  kinds = hlo_collectives.COLLECTIVE_KINDS
  return [
    i.op_name()
    for c in computations.values()
    for i in c.instructions
    if i.opcode.removesuffix('-start') in kinds
  ]


def _mesh(topology):
  if topology is None:
    return jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
  sizes = (2, 2) if topology.startswith('v5p') else (2, 4)
  return fsm.make_mesh(sizes, ('data', 'model'), topology=topology)


def _scopes(names: list[str]) -> set[str]:
  """The scopes of the collectives, each merged name read on its own."""
  return {hlo_metadata.scope_of(m) for n in names for m in hlo_metadata.merged_names(n)}


@pytest.fixture(scope='module')
def cpu_names():
  return [n for n in _collective_names(_mesh(None)) if n]


@pytest.mark.parametrize(
  'topology',
  [
    None,
    pytest.param('v5p:2x2x1', marks=pytest.mark.libtpu),
    pytest.param('h100:1x8', marks=pytest.mark.cuda),
  ],
)
def test_collectives_read_the_same_scopes_on_every_backend(topology, cpu_names):
  """The GPU and CPU compilers combine collectives of several layers into one
  (its name merges theirs), the TPU one does not: each merged name still
  reads as the scope it came from, the combined one as what they share."""
  names = cpu_names if topology is None else _collective_names(_mesh(topology))
  names = [n for n in names if n]  # XLA drops some combined ones' metadata
  scopes = _scopes(names)
  assert scopes == _scopes(cpu_names)
  assert {'Model/layers/mix', 'Model/layers/mlp'} <= scopes
  for name in names:
    scope = hlo_metadata.scope_of(name)
    assert any(f'{s}/'.startswith(f'{scope}/') for s in scopes), name
    assert re.fullmatch(r'[a-z_\-]+', hlo_metadata.primitive_of(name)), name
