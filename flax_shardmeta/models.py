"""Reference models used by the demo, the CLI and the tests."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from flax_shardmeta.boxes import PARTITION_NAME, with_logical_partitioning
from flax_shardmeta.constraints import context_mesh, with_logical_constraint
from flax_shardmeta.rules import logical_to_mesh_axes

MLP_RULES = (('batch', 'data'), ('hidden', 'model'), ('embed', None),
             ('layers', None))
"""Rules for the notebook MLP over a ('data', 'model') mesh."""


def _out_sharding(names):
  # Under Explicit axes a matmul whose contracting dimension is sharded needs
  # its output sharding spelled out; under Auto axes the compiler chooses.
  mesh = context_mesh()
  if mesh is not None and all(
      t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return logical_to_mesh_axes(names)
  return None


class DotReluDot(nn.Module):
  """The Flax scale-up notebook's layer, with logical annotations."""

  depth: int
  dense_init: nn.initializers.Initializer = nn.initializers.xavier_normal()
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(
        self.depth,
        kernel_init=with_logical_partitioning(self.dense_init, ('embed', 'hidden')),
        use_bias=False,
        param_dtype=self.param_dtype,
    )(x)
    y = jax.nn.relu(y)
    y = with_logical_constraint(y, ('batch', 'hidden'))
    w2 = self.param(
        'W2',
        with_logical_partitioning(self.dense_init, ('hidden', 'embed')),
        (self.depth, x.shape[-1]),
        self.param_dtype,
    )
    z = jnp.dot(y, w2, out_sharding=_out_sharding(('batch', 'embed')))
    z = with_logical_constraint(z, ('batch', 'embed'))
    return z, None


class MLP(nn.Module):
  """A stack of DotReluDot layers, unrolled or with ``nn.scan``."""

  num_layers: int = 4
  depth: int = 1024
  use_scan: bool = True
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    if self.use_scan:
      x, _ = nn.scan(
          DotReluDot,
          length=self.num_layers,
          variable_axes={'params': 0},
          split_rngs={'params': True},
          metadata_params={PARTITION_NAME: 'layers'},
      )(self.depth, param_dtype=self.param_dtype)(x)
    else:
      for _ in range(self.num_layers):
        x, _ = DotReluDot(self.depth, param_dtype=self.param_dtype)(x)
    return x


# Llama 3
# ------------------------------------------------------------------------------

LLAMA_RULES = (
    ('batch', 'data'),
    ('vocab', 'model'),
    ('heads', 'model'),
    ('kv_heads', 'model'),
    ('mlp', 'model'),
    ('embed', 'data'),
    ('head_dim', None),
    ('length', None),
    ('layers', None),
    ('norm', None),
)
"""Rules for the Llama models over a ('data', 'model') mesh: tensor parallelism
over 'model' for heads and MLP, parameters' embed dimension sharded over
'data' (FSDP)."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shapes of a Llama-3 model (grouped-query attention, untied embeddings).

  Example:
    >>> LLAMA_CONFIGS['llama3-70b'].num_params
    70553706496
  """

  vocab_size: int
  dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  norm_eps: float = 1e-5
  rope_theta: float = 500_000.0

  @property
  def num_params(self) -> int:
    """Parameter count implied by the shapes."""
    attention = self.dim * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    layer = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
    return self.num_layers * layer + 2 * self.vocab_size * self.dim + self.dim


LLAMA_CONFIGS = {
    'llama3-8b': LlamaConfig(128256, 4096, 32, 32, 8, 128, 14336),
    'llama3-70b': LlamaConfig(128256, 8192, 80, 64, 8, 128, 28672),
    'llama3-405b': LlamaConfig(128256, 16384, 126, 128, 8, 128, 53248),
}
"""The published Llama-3 / 3.1 shapes."""

_init = nn.initializers.normal(0.02)


def _rope(x: jax.Array, theta: float) -> jax.Array:
  # x: (batch, length, heads, head_dim); rotates pairs of the last dimension.
  half = x.shape[-1] // 2
  freqs = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs
  cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal grouped-query attention; k and v have fewer heads than q."""
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
  length = q.shape[1]
  causal = jnp.tril(jnp.ones((length, length), dtype=bool))
  scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
  weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
  return jnp.einsum('bhqk,bkhd->bqhd', weights, v)


def _rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale).astype(x.dtype)


class RMSNorm(nn.Module):
  """RMSNorm with a learned scale named 'norm' (replicated by the rules)."""

  eps: float = 1e-5
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param(
        'scale', with_logical_partitioning(nn.initializers.ones, ('norm',)),
        (x.shape[-1],), self.param_dtype)
    return _rms_norm(x, scale, self.eps)


class LlamaBlock(nn.Module):
  """One Llama decoder layer: pre-norm GQA attention and a SwiGLU MLP."""

  config: LlamaConfig
  param_dtype: Any = jnp.float32

  def _param(self, name: str, shape: tuple[int, ...], names: tuple[str, ...]):
    return self.param(
        name, with_logical_partitioning(_init, names), shape, self.param_dtype)

  @nn.compact
  def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
    c = self.config
    wq = self._param('wq', (c.dim, c.num_heads, c.head_dim),
                     ('embed', 'heads', 'head_dim'))
    wk = self._param('wk', (c.dim, c.num_kv_heads, c.head_dim),
                     ('embed', 'kv_heads', 'head_dim'))
    wv = self._param('wv', (c.dim, c.num_kv_heads, c.head_dim),
                     ('embed', 'kv_heads', 'head_dim'))
    wo = self._param('wo', (c.num_heads, c.head_dim, c.dim),
                     ('heads', 'head_dim', 'embed'))
    h = RMSNorm(c.norm_eps, self.param_dtype, name='attention_norm')(x)
    q = _rope(jnp.einsum('bse,ehd->bshd', h, wq), c.rope_theta)
    k = _rope(jnp.einsum('bse,ehd->bshd', h, wk), c.rope_theta)
    v = jnp.einsum('bse,ehd->bshd', h, wv)
    x = x + jnp.einsum('bshd,hde->bse', _attend(q, k, v), wo)
    w1 = self._param('w1', (c.dim, c.ffn_dim), ('embed', 'mlp'))
    w3 = self._param('w3', (c.dim, c.ffn_dim), ('embed', 'mlp'))
    w2 = self._param('w2', (c.ffn_dim, c.dim), ('mlp', 'embed'))
    h = RMSNorm(c.norm_eps, self.param_dtype, name='ffn_norm')(x)
    x = x + (jax.nn.silu(h @ w1) * (h @ w3)) @ w2
    x = with_logical_constraint(x, ('batch', 'length', 'embed'))
    return x, None


class Llama(nn.Module):
  """Llama-3 decoder with its layers stacked by ``nn.scan`` on a 'layers' axis."""

  config: LlamaConfig
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    c = self.config
    embedding = self.param(
        'embedding', with_logical_partitioning(_init, ('vocab', 'embed')),
        (c.vocab_size, c.dim), self.param_dtype)
    x = jnp.take(embedding, tokens, axis=0)
    x, _ = nn.scan(
        LlamaBlock,
        length=c.num_layers,
        variable_axes={'params': 0},
        split_rngs={'params': True},
        metadata_params={PARTITION_NAME: 'layers'},
    )(c, self.param_dtype, name='layers')(x, None)
    x = RMSNorm(c.norm_eps, self.param_dtype, name='norm')(x)
    lm_head = self.param(
        'lm_head', with_logical_partitioning(_init, ('embed', 'vocab')),
        (c.dim, c.vocab_size), self.param_dtype)
    return x @ lm_head


# Registry: abstract parameters and optimizer state of the built-in models
# ------------------------------------------------------------------------------

MODEL_NAMES = ('mlp', *LLAMA_CONFIGS)
"""Names the CLI's ``--model`` accepts."""

OPTIMIZERS = ('adam', 'adafactor', 'none')
"""Names the CLI's ``--optimizer`` accepts."""


def default_rules(name: str) -> tuple[tuple[str, Any], ...]:
  """The logical axis rules a built-in model is meant to be planned with."""
  return MLP_RULES if name == 'mlp' else LLAMA_RULES


def linen_model(name: str, dtype: Any = jnp.float32) -> tuple[nn.Module, Any]:
  """A built-in Linen model and an abstract example input for its ``init``.

  Example:
    >>> model, x = linen_model('llama3-8b')
    >>> model.config.num_layers, x.shape
    (32, (1, 1))
  """
  if name == 'mlp':
    # The notebook's sizes: 4 layers of depth 1024 on a batch of 8.
    return MLP(num_layers=4, depth=1024, use_scan=True, param_dtype=dtype), \
        jax.ShapeDtypeStruct((8, 1024), jnp.float32)
  if name not in LLAMA_CONFIGS:
    raise ValueError(f'Unknown model {name!r}; choose from {", ".join(MODEL_NAMES)}.')
  return Llama(LLAMA_CONFIGS[name], dtype), jax.ShapeDtypeStruct((1, 1), jnp.int32)


def abstract_linen_params(module: nn.Module, *inputs: Any) -> Any:
  """``module``'s annotated parameters as ShapeDtypeStructs; nothing is allocated.

  Example:
    >>> params = abstract_linen_params(*linen_model('mlp'))
    >>> params['ScanDotReluDot_0']['W2'].value.shape
    (4, 1024, 1024)
  """
  def init(*xs: Any) -> Any:
    return module.init(jax.random.key(0), *xs)['params']

  return jax.eval_shape(init, *inputs)


def optimizer(name: str) -> Any:
  """The optax transformation behind an ``--optimizer`` name (None for 'none')."""
  import optax  # only when an optimizer is planned

  if name == 'adam':
    return optax.adam(1e-3)
  if name == 'adafactor':
    return optax.adafactor(1e-3)
  if name == 'none':
    return None
  raise ValueError(f'Unknown optimizer {name!r}; choose from {", ".join(OPTIMIZERS)}.')


def abstract_train_state(params: Any, optimizer_name: str = 'adam') -> dict[str, Any]:
  """``{'params': params, 'opt_state': ...}`` with the optimizer state abstract.

  Optax moments keep their parameter's box, so they are planned like it.
  """
  tx = optimizer(optimizer_name)
  if tx is None:
    return {'params': params}
  return {'params': params, 'opt_state': jax.eval_shape(tx.init, params)}


def abstract_state(
    name: str, api: str = 'linen', optimizer_name: str = 'adam',
    dtype: Any = jnp.float32,
) -> dict[str, Any]:
  """A built-in model's abstract parameters (and optimizer state) for planning.

  Args:
    name: one of :data:`MODEL_NAMES`.
    api: 'linen' or 'nnx'.
    optimizer_name: one of :data:`OPTIMIZERS`.
    dtype: the parameters' dtype.

  Returns:
    ``{'params': ..., 'opt_state': ...}`` (no 'opt_state' for 'none').

  Example:
    >>> state = abstract_state('mlp', optimizer_name='none')
    >>> sorted(state)
    ['params']
  """
  if api == 'linen':
    return abstract_train_state(abstract_linen_params(*linen_model(name, dtype)),
                                optimizer_name)
  if api == 'nnx':
    from flax_shardmeta import models_nnx  # the NNX stack loads only when asked

    return models_nnx.abstract_state(name, optimizer_name, dtype)
  raise ValueError(f"Unknown api {api!r}; choose 'linen' or 'nnx'.")
