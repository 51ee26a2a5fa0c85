"""Model shapes the fit benchmarks measure besides the built-in ones.

Two Linen models with logical-name annotations (``nn.with_logical_partitioning``
on every parameter, ``fsm.with_logical_constraint`` on the residual stream),
their layers stacked by ``nn.scan`` on a ``'layers'`` axis:

* ``'t5'``: a T5-style encoder-decoder (pre-norm, bidirectional
  self-attention in the encoder; causal self-attention, cross-attention to
  the encoder's output and a gated-GELU MLP in the decoder), untied
  embedding and output projection;
* ``'moe'``: a decoder-only mixture-of-experts transformer: every layer's MLP
  is ``num_experts`` gated-GELU experts with top-k routing, tokens sent to
  their experts and back by dense dispatch and combine einsums over a
  per-expert capacity (GShard style), and a load-balancing loss.

``train_step(name, mesh, ...)`` returns ``(step, state, batch)`` as
``flax_shardmeta.examples.train.train_step`` does: an ``fsm.jit`` training
step (cross-entropy, adamw, the state donated) and its arguments as
``jax.eval_shape`` trees. The mesh is a ``('data', 'model')`` one, concrete
(compile-only devices of a topology) or an ``AbstractMesh``, with Auto axes
(under Explicit axes some of the einsums would need their output shardings
spelled out). ``remat='full'`` wraps each scanned layer in ``nn.remat`` with
``jax.checkpoint_policies.nothing_saveable``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state

import flax_shardmeta as fsm
from flax_shardmeta.examples._common import remat_policy, rms_norm

NAMES = ('t5', 'moe')

T5_RULES = fsm.standard_logical_axis_rules(1, 2)
"""T5X's rules: batch over 'data'; heads, MLP and vocabulary over 'model';
parameters' embed dimension over 'data' (FSDP); 'kv', 'length' and 'layers'
replicated."""

MOE_RULES = (('expert', 'model'), *T5_RULES)
"""T5_RULES with the experts over 'model' (expert parallelism; an expert's own
MLP dimension is then replicated, as 'model' is taken)."""

_init = nn.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Shapes of the encoder-decoder (T5 v1.1-large widths, few layers)."""

  vocab_size: int = 32128
  dim: int = 1024
  num_heads: int = 16
  head_dim: int = 64
  ffn_dim: int = 2816
  encoder_layers: int = 4
  decoder_layers: int = 4


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Shapes of the mixture-of-experts decoder."""

  vocab_size: int = 32000
  dim: int = 1024
  num_heads: int = 16
  head_dim: int = 64
  ffn_dim: int = 2816
  num_experts: int = 8
  top_k: int = 2
  capacity_factor: float = 1.25
  num_layers: int = 4


def _param(
  module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str, ...]
) -> jax.Array:
  init = nn.with_logical_partitioning(_init, names)
  return module.param(name, init, shape, module.param_dtype)  # pyright: ignore


class Norm(nn.Module):
  """RMS normalisation (T5's layer norm) with a scale over 'embed'."""

  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.with_logical_partitioning(nn.initializers.ones, ('embed',))
    scale = self.param('scale', init, (x.shape[-1],), self.param_dtype)
    return rms_norm(x, scale, 1e-6)


class Attention(nn.Module):
  """Multi-head attention of ``x`` to ``context`` (itself when None)."""

  num_heads: int
  head_dim: int
  causal: bool = False
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, context: jax.Array | None = None) -> jax.Array:
    context = x if context is None else context
    dim, shape = x.shape[-1], (x.shape[-1], self.num_heads, self.head_dim)
    wq = _param(self, 'query', shape, ('embed', 'heads', 'kv'))
    wk = _param(self, 'key', shape, ('embed', 'heads', 'kv'))
    wv = _param(self, 'value', shape, ('embed', 'heads', 'kv'))
    wo = _param(
      self, 'out', (self.num_heads, self.head_dim, dim), ('heads', 'kv', 'embed')
    )
    q = jnp.einsum('bqe,ehd->bqhd', x, wq)
    k = jnp.einsum('bke,ehd->bkhd', context, wk)
    v = jnp.einsum('bke,ehd->bkhd', context, wv)
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k).astype(jnp.float32)
    scores = scores / math.sqrt(self.head_dim)
    if self.causal:
      mask = jnp.tril(jnp.ones((x.shape[1], context.shape[1]), dtype=bool))
      scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    return jnp.einsum('bqhd,hde->bqe', jnp.einsum('bhqk,bkhd->bqhd', weights, v), wo)


class GatedMLP(nn.Module):
  """T5 v1.1's gated-GELU MLP."""

  ffn_dim: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dim = x.shape[-1]
    wi_0 = _param(self, 'wi_0', (dim, self.ffn_dim), ('embed', 'mlp'))
    wi_1 = _param(self, 'wi_1', (dim, self.ffn_dim), ('embed', 'mlp'))
    wo = _param(self, 'wo', (self.ffn_dim, dim), ('mlp', 'embed'))
    return (jax.nn.gelu(x @ wi_0) * (x @ wi_1)) @ wo


def _residual(x: jax.Array) -> jax.Array:
  return fsm.with_logical_constraint(x, ('batch', 'length', 'embed'))


class EncoderLayer(nn.Module):
  config: T5Config
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
    c, dtype = self.config, self.param_dtype
    h = Norm(dtype, name='attention_norm')(x)
    x = _residual(x + Attention(c.num_heads, c.head_dim, False, dtype)(h))
    h = Norm(dtype, name='mlp_norm')(x)
    return _residual(x + GatedMLP(c.ffn_dim, dtype)(h)), None


class DecoderLayer(nn.Module):
  config: T5Config
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, y: jax.Array, encoded: jax.Array) -> tuple[jax.Array, None]:
    c, dtype = self.config, self.param_dtype
    h = Norm(dtype, name='self_attention_norm')(y)
    y = _residual(y + Attention(c.num_heads, c.head_dim, True, dtype, name='self')(h))
    h = Norm(dtype, name='cross_attention_norm')(y)
    cross = Attention(c.num_heads, c.head_dim, False, dtype, name='cross')
    y = _residual(y + cross(h, encoded))
    h = Norm(dtype, name='mlp_norm')(y)
    return _residual(y + GatedMLP(c.ffn_dim, dtype)(h)), None


def _rematted(layer: type[nn.Module], remat: str) -> Any:
  on, policy = remat_policy(remat)
  return nn.remat(layer, policy=policy, prevent_cse=False) if on else layer


def _scan(layer: Any, length: int, broadcast: bool = False) -> Any:
  return nn.scan(
    layer,
    length=length,
    variable_axes={'params': 0},
    split_rngs={'params': True},
    in_axes=(nn.broadcast,) if broadcast else 0,
    metadata_params={nn.PARTITION_NAME: 'layers'},
  )


class T5(nn.Module):
  """The encoder-decoder: ``(inputs, decoder_inputs) -> logits``."""

  config: T5Config
  param_dtype: Any = jnp.float32
  remat: str = 'none'

  @nn.compact
  def __call__(self, inputs: jax.Array, decoder_inputs: jax.Array) -> jax.Array:
    c, dtype = self.config, self.param_dtype
    embedding = _param(self, 'embedding', (c.vocab_size, c.dim), ('vocab', 'embed'))
    x = _residual(jnp.take(embedding, inputs, axis=0))
    x, _ = _scan(_rematted(EncoderLayer, self.remat), c.encoder_layers)(
      c, dtype, name='encoder'
    )(x, None)
    encoded = Norm(dtype, name='encoder_norm')(x)
    y = _residual(jnp.take(embedding, decoder_inputs, axis=0))
    y, _ = _scan(_rematted(DecoderLayer, self.remat), c.decoder_layers, True)(
      c, dtype, name='decoder'
    )(y, encoded)
    y = Norm(dtype, name='decoder_norm')(y)
    head = _param(self, 'logits', (c.dim, c.vocab_size), ('embed', 'vocab'))
    return y @ head


class Experts(nn.Module):
  """Top-k routed gated-GELU experts with dense dispatch and combine.

  Returns the layer's output and its load-balancing loss. Each sequence is a
  routing group; an expert takes at most ``capacity`` tokens of a group,
  first choices before second ones, and drops the rest.
  """

  config: MoEConfig
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    c = self.config
    groups, length, dim = x.shape
    e, k = c.num_experts, c.top_k
    capacity = math.ceil(k * length * c.capacity_factor / e)
    router = _param(self, 'router', (dim, e), ('embed', None))
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)  # g s e
    gates, index = jax.lax.top_k(probs, k)  # g s k
    chosen = jax.nn.one_hot(index, e, dtype=jnp.float32)  # g s k e
    # Position of each (token, choice) in its expert's buffer: all first
    # choices of the group in order, then all second ones, ...
    order = jnp.swapaxes(chosen, 1, 2).reshape(groups, k * length, e)
    position = (jnp.cumsum(order, axis=1) - 1.0) * order
    position = jnp.swapaxes(position.reshape(groups, k, length, e), 1, 2)
    kept = chosen * (position < capacity)  # g s k e
    slots = jax.nn.one_hot(position, capacity, dtype=jnp.float32) * kept[..., None]
    dispatch = slots.sum(axis=2).astype(x.dtype)  # g s e c
    combine = (slots * gates[..., None, None]).sum(axis=2).astype(x.dtype)
    dispatch = fsm.with_logical_constraint(dispatch, ('batch', None, 'expert', None))
    combine = fsm.with_logical_constraint(combine, ('batch', None, 'expert', None))

    names = ('expert', 'batch', None, 'embed')
    wi_0 = _param(self, 'wi_0', (e, dim, c.ffn_dim), ('expert', 'embed', 'mlp'))
    wi_1 = _param(self, 'wi_1', (e, dim, c.ffn_dim), ('expert', 'embed', 'mlp'))
    wo = _param(self, 'wo', (e, c.ffn_dim, dim), ('expert', 'mlp', 'embed'))
    tokens = fsm.with_logical_constraint(
      jnp.einsum('gsec,gsd->egcd', dispatch, x), names
    )
    h = jax.nn.gelu(jnp.einsum('egcd,edf->egcf', tokens, wi_0)) * jnp.einsum(
      'egcd,edf->egcf', tokens, wi_1
    )
    out = fsm.with_logical_constraint(jnp.einsum('egcf,efd->egcd', h, wo), names)
    y = jnp.einsum('gsec,egcd->gsd', combine, out)
    # Switch Transformer's balance: fraction of first choices x mean probability.
    density = chosen[:, :, 0, :].mean(axis=1)
    balance = (density * probs.mean(axis=1)).mean() * e * e
    return y, balance


class MoELayer(nn.Module):
  config: MoEConfig
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, jax.Array]:
    c, dtype = self.config, self.param_dtype
    h = Norm(dtype, name='attention_norm')(x)
    x = _residual(x + Attention(c.num_heads, c.head_dim, True, dtype)(h))
    h = Norm(dtype, name='mlp_norm')(x)
    y, balance = Experts(c, dtype)(h)
    return _residual(x + y), balance


class MoE(nn.Module):
  """The mixture-of-experts decoder: ``tokens -> (logits, balance loss)``."""

  config: MoEConfig
  param_dtype: Any = jnp.float32
  remat: str = 'none'

  @nn.compact
  def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    c, dtype = self.config, self.param_dtype
    embedding = _param(self, 'embedding', (c.vocab_size, c.dim), ('vocab', 'embed'))
    x = _residual(jnp.take(embedding, tokens, axis=0))
    x, balance = _scan(_rematted(MoELayer, self.remat), c.num_layers)(
      c, dtype, name='layers'
    )(x, None)
    x = Norm(dtype, name='norm')(x)
    head = _param(self, 'logits', (c.dim, c.vocab_size), ('embed', 'vocab'))
    return x @ head, balance.mean()


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def model(
  name: str,
  dtype: Any = jnp.bfloat16,
  *,
  remat: str = 'none',
  num_layers: int | None = None,
  config: Any = None,
) -> nn.Module:
  """Model ``name`` (``NAMES``); ``num_layers`` sets the depth (of the encoder
  and of the decoder, for ``'t5'``), ``config`` other widths (a ``T5Config``
  or ``MoEConfig``)."""
  remat_policy(remat)
  if name == 't5':
    config = config or T5Config()
    if num_layers is not None:
      config = dataclasses.replace(
        config, encoder_layers=num_layers, decoder_layers=num_layers
      )
    return T5(config, dtype, remat)
  if name == 'moe':
    config = config or MoEConfig()
    if num_layers is not None:
      config = dataclasses.replace(config, num_layers=num_layers)
    return MoE(config, dtype, remat)
  raise ValueError(f'unknown model {name!r}; choose from {", ".join(NAMES)}')


def model_rules(name: str) -> tuple[tuple[str, Any], ...]:
  """The logical axis rules model ``name`` is planned with."""
  return MOE_RULES if name == 'moe' else T5_RULES


def abstract_batch(name: str, batch: int, seq: int) -> dict[str, Any]:
  """Token batches: ``inputs`` (``seq`` tokens) and ``targets`` (``seq // 4``
  tokens and the next-token target) for ``'t5'``; ``tokens`` (``seq`` and the
  target) for ``'moe'``."""
  if name == 't5':
    return {
      'inputs': jax.ShapeDtypeStruct((batch, seq), jnp.int32),
      'targets': jax.ShapeDtypeStruct((batch, seq // 4 + 1), jnp.int32),
    }
  return {'tokens': jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)}


def _loss(name: str, apply: Any, batch: dict[str, jax.Array]) -> jax.Array:
  if name == 't5':
    targets = batch['targets']
    return _cross_entropy(apply(batch['inputs'], targets[:, :-1]), targets[:, 1:])
  tokens = batch['tokens']
  logits, balance = apply(tokens[:, :-1])
  return _cross_entropy(logits, tokens[:, 1:]) + 0.01 * balance


def train_step(
  name: str,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
  *,
  rules: Sequence[tuple[str, Any]] | None = None,
  batch: int = 16,
  seq: int = 1024,
  remat: str = 'none',
  dtype: Any = jnp.bfloat16,
  num_layers: int | None = None,
  config: Any = None,
) -> tuple[fsm.JitWithContext, Any, Any]:
  """Model ``name``'s training step on ``mesh``, with abstract arguments.

  Args:
    name: ``'t5'`` or ``'moe'``.
    mesh: a ``('data', 'model')`` mesh with Auto axes, concrete or abstract.
    rules: logical axis rules (``model_rules(name)`` by default).
    batch: global batch size (sequences).
    seq: tokens per sequence (the encoder's, for ``'t5'``).
    remat: ``'none'`` or ``'full'`` (or another ``REMAT_POLICIES`` name).
    dtype: the parameters' dtype.
    num_layers: another depth than the config's.
    config: other widths than the model's (``T5Config``, ``MoEConfig``).

  Returns:
    ``(step, state, batch)``: ``step(state, batch) -> (state, loss)`` from
    ``fsm.jit`` (adamw, state donated, shardings by the rules), and the
    abstract arguments.
  """
  rules = model_rules(name) if rules is None else tuple(rules)
  module = model(name, dtype, remat=remat, num_layers=num_layers, config=config)
  tokens = abstract_batch(name, batch, seq)
  tx = optax.adamw(1e-4)

  def init(key: jax.Array) -> train_state.TrainState:
    small = {k: jnp.zeros((1, 4), jnp.int32) for k in tokens}
    args = (small['inputs'], small['targets']) if name == 't5' else (small['tokens'],)
    params = module.init(key, *args)['params']
    return train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)

  def step(state: Any, data: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
    def loss_fn(params: Any) -> jax.Array:
      return _loss(name, lambda *x: state.apply_fn({'params': params}, *x), data)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  with fsm.logical_axis_rules(rules):
    state = jax.eval_shape(init, jax.random.key(0))
  jitted = fsm.jit(
    step,
    mesh=mesh,  # pyright: ignore[reportArgumentType]
    rules=rules,
    in_shardings=(state, {k: ('batch', None) for k in tokens}),
    out_shardings=(state, None),
    donate_argnums=0,
  )
  return jitted, state, tokens


def builder(name: str, **kwargs: Any) -> Any:
  """``build(mesh, rules, remat) -> (step, state, batch)`` for ``fsm.suggest``."""

  def build(
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    rules: Sequence[tuple[str, Any]],
    remat: str,
  ) -> Any:
    return train_step(name, mesh, rules=rules, remat=remat, **kwargs)

  return build
