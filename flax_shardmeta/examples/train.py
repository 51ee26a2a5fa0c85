"""Training steps of the built-in models, abstract, for ``fsm.fit``.

``train_step(name, mesh, ...)`` returns ``(step, state, batch)``: an
``fsm.jit`` training step (forward, backward, optimizer update, the state
donated) and its arguments as ``jax.eval_shape`` trees. Nothing is allocated,
so the mesh may be a pod's: ``fsm.fit(*train_step('llama3-8b', mesh,
batch=256, seq=2048))``. Besides the built-in models (``MODEL_NAMES``), the
mixture-of-experts examples of ``examples.moe`` (``'mixtral-8x7b'``,
``'moe-tiny'``; Linen only) train the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import flax_shardmeta as fsm
from flax_shardmeta.examples._common import llama_config
from flax_shardmeta.examples.state import (
  TRAINING_OPTIMIZERS,
  UnknownNameError,
  model_rules,
  optimizer as state_optimizer,
)

OPTIMIZERS = TRAINING_OPTIMIZERS

BATCH, SEQ = 8, 2048
"""The built-in models' default global batch and sequence length (the command
line's too)."""


def tokens_per_example(name: str, seq: int) -> int:
  """Tokens one example of model ``name`` holds: ``seq`` for the language
  models, 1 for the MLP (one vector an example).

  Example:
    >>> tokens_per_example('mlp', 2048), tokens_per_example('llama3-8b', 2048)
    (1, 2048)
  """
  return 1 if name == 'mlp' else seq


"""Optimizers the built-in steps take (optax, learning rate 1e-4)."""


def optimizer(name: str) -> optax.GradientTransformation:
  """The optax transformation behind an optimizer name.

  Example:
    >>> type(optimizer('adamw')).__name__
    'GradientTransformationExtraArgs'
  """
  if name not in OPTIMIZERS:
    raise UnknownNameError(
      f'unknown optimizer {name!r}; choose from {", ".join(OPTIMIZERS)}'
    )
  return state_optimizer(name)


def num_layers(name: str) -> int:
  """The depth of built-in model ``name``: what ``fit --extrapolate`` reports on.

  Example:
    >>> num_layers('mlp'), num_layers('llama3-8b'), num_layers('moe-tiny')
    (4, 32, 2)
  """
  if name == 'mlp':
    return 4  # the notebook's depth, as examples.linen.model('mlp') builds it
  if name in _moe_configs():
    return _moe_configs()[name].num_layers
  return llama_config(name).num_layers


def _moe_configs() -> dict[str, Any]:
  from flax_shardmeta.examples import moe

  return moe.MOE_CONFIGS


def _rules(name: str) -> tuple[tuple[str, Any], ...]:
  """The rules a model is meant to be planned with."""
  if name in _moe_configs():
    from flax_shardmeta.examples import moe

    return moe.MOE_RULES
  return model_rules(name)


def _loss(name: str, apply: Any, batch: jax.Array) -> jax.Array:
  if name == 'mlp':
    return jnp.mean((apply(batch) - jnp.tanh(batch)) ** 2)
  logits = apply(batch[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def abstract_batch(name: str, batch: int, seq: int) -> jax.ShapeDtypeStruct:
  """The batch a built-in model trains on: tokens (with the next-token target)
  for Llama, ``(batch, 1024)`` features for the MLP."""
  if name == 'mlp':
    return jax.ShapeDtypeStruct((batch, 1024), jnp.float32)
  return jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)


def train_step(
  name: str,
  mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
  *,
  rules: Sequence[tuple[str, Any]] | None = None,
  batch: int = BATCH,
  seq: int = SEQ,
  api: str = 'linen',
  remat: str = 'none',
  optimizer_name: str = 'adamw',
  dtype: Any = jnp.bfloat16,
  num_layers: int | None = None,
  offload: str | fsm.OffloadPreset | None = None,
  capacity_factor: float | None = None,
) -> tuple[fsm.JitWithContext, Any, jax.ShapeDtypeStruct]:
  """A built-in model's training step on ``mesh``, with abstract arguments.

  Args:
    name: one of ``MODEL_NAMES``, or of ``examples.moe.MOE_CONFIGS``.
    mesh: the mesh (a pod's, from ``fsm.make_mesh(..., topology=...)``, or an
      ``AbstractMesh`` for an estimate).
    rules: logical axis rules (the model's own by default).
    batch: global batch size (sequences, or rows for the MLP).
    seq: tokens per sequence (Llama).
    api: ``'linen'`` (a ``TrainState``) or ``'nnx'`` (model and
      ``nnx.Optimizer``).
    remat: rematerialisation of each layer (``REMAT_POLICIES``).
    optimizer_name: one of :data:`OPTIMIZERS`.
    dtype: the parameters' dtype.
    num_layers: another depth than the model's own.
    offload: what the step keeps in host memory (an ``fsm.OFFLOAD_PRESETS``
      name or an ``fsm.OffloadPreset``): the optimizer state between steps
      (laid out in ``pinned_host``, moved to the chips for the update and
      back), and the named activations the layers' remat policy offloads
      (the built-in models name each layer's input ``LAYER_INPUT``).
    capacity_factor: another capacity factor than the mixture-of-experts
      model's own (``examples.moe.MoeConfig.capacity_factor``).

  Returns:
    ``(step, state, batch)``: ``step(state, batch) -> (state, loss)`` from
    ``fsm.jit`` (state donated, shardings by the rules), and the abstract
    arguments.

  Example:
    >>> import jax, flax_shardmeta as fsm
    >>> from flax_shardmeta.examples import train
    >>> mesh = jax.make_mesh((2, 4), ('data', 'model'))
    >>> step, state, batch = train.train_step('mlp', mesh, batch=16)
    >>> batch.shape, step.in_shardings[1].spec
    ((16, 1024), P('data', None))
  """
  rules = _rules(name) if rules is None else tuple(rules)
  tx = optimizer(optimizer_name)
  tokens = abstract_batch(name, batch, seq)
  hosted = _offload_preset(offload)
  model = (name, remat, dtype, num_layers, hosted.names)
  if capacity_factor is not None and name not in _moe_configs():
    raise UnknownNameError(
      f'capacity_factor is a setting of the mixture-of-experts models '
      f'({", ".join(_moe_configs())}), not of {name!r}'
    )
  if api == 'linen':
    fn, state = _linen(*model, tx, rules, capacity_factor)
  elif api == 'nnx':
    fn, state = _nnx(*model, tx, rules)
  else:
    raise UnknownNameError(f"unknown api {api!r}; choose 'linen' or 'nnx'")
  layout: Any = state
  if hosted.optimizer:
    fn, layout = _optimizer_on_host(fn, state, mesh, rules)
  step = fsm.jit(
    fn,
    mesh=mesh,  # pyright: ignore[reportArgumentType]
    rules=rules,
    in_shardings=(layout, ('batch', None)),
    out_shardings=(layout, None),
    donate_argnums=0,
  )
  return step, state, tokens


def _offload_preset(offload: str | fsm.OffloadPreset | None) -> fsm.OffloadPreset:
  if isinstance(offload, fsm.OffloadPreset):
    return offload
  if (offload or 'none') not in fsm.OFFLOAD_PRESETS:
    raise UnknownNameError(
      f'unknown offload {offload!r}; choose from {", ".join(fsm.OFFLOAD_PRESETS)} '
      'or pass an fsm.OffloadPreset'
    )
  return fsm.OFFLOAD_PRESETS[offload or 'none']


def _kept(state: Any) -> Any:
  return state


def _optimizer_on_host(fn: Any, state: Any, mesh: Any, rules: Any) -> tuple[Any, Any]:
  """``fn`` with the optimizer state in host memory between steps: moved to
  the chips for the update, once the gradients are computed (``fn``'s
  ``arrive``), and back after it, as MaxText's
  ``optimizer_memory_host_offload`` does; and the state's shardings, its
  optimizer state's in ``pinned_host``."""
  shardings = fsm.get_sharding(state, mesh, rules)
  flat, treedef = jax.tree_util.tree_flatten_with_path(
    shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding)
  )
  hosted = ['opt_state' in jax.tree_util.keystr(path) for path, _ in flat]
  host = [fsm.in_host_memory(s) if h else s for (_, s), h in zip(flat, hosted)]
  device = [fsm.in_device_memory(s) for (_, s) in flat]

  def moved(tree: Any, to: list[Any]) -> Any:
    leaves = jax.tree_util.tree_leaves(tree)
    out = [jax.device_put(x, s) if h else x for x, s, h in zip(leaves, to, hosted)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), out)

  def step(state: Any, batch: jax.Array) -> tuple[Any, jax.Array]:
    new, loss = fn(state, batch, arrive=lambda s: moved(s, device))
    return moved(new, host), loss

  return step, jax.tree_util.tree_unflatten(treedef, host)


def _linen(
  name: str,
  remat: str,
  dtype: Any,
  num_layers: int | None,
  offloaded: Sequence[str],
  tx: Any,
  rules: Any,
  capacity_factor: float | None = None,
) -> tuple[Any, Any]:
  from flax_shardmeta.examples import linen, moe

  if name in moe.MOE_CONFIGS:
    module, example = moe.model(
      name, dtype, remat=remat, num_layers=num_layers, offloaded=offloaded,
      capacity_factor=capacity_factor,
    )  # fmt: skip
  else:
    module, example = linen.model(
      name, dtype, remat=remat, num_layers=num_layers, offloaded=offloaded
    )

  def init(key: jax.Array) -> train_state.TrainState:
    x = jnp.zeros(example.shape, example.dtype)
    params = module.init(key, x)['params']
    return train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)

  def step(state: Any, batch: jax.Array, arrive: Any = _kept) -> tuple[Any, jax.Array]:
    def loss_fn(params: Any) -> jax.Array:
      return _loss(name, lambda x: state.apply_fn({'params': params}, x), batch)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    state = arrive(state)  # the optimizer state, for the update only
    return state.apply_gradients(grads=grads), loss

  with fsm.logical_axis_rules(rules):
    return step, jax.eval_shape(init, jax.random.key(0))


def _nnx(
  name: str,
  remat: str,
  dtype: Any,
  num_layers: int | None,
  offloaded: Sequence[str],
  tx: Any,
  rules: Any,
) -> tuple[Any, Any]:
  from flax import nnx

  from flax_shardmeta.examples import nnx as nnx_models

  if name in _moe_configs():
    raise UnknownNameError(
      f"the mixture-of-experts example {name!r} is Linen only; pass api='linen'"
    )

  def create() -> tuple[Any, Any]:
    m = nnx_models.model(
      name,
      dtype,
      rngs=nnx.Rngs(0),
      remat=remat,
      num_layers=num_layers,
      offloaded=offloaded,
    )
    return m, nnx.Optimizer(m, tx, wrt=nnx.Param)

  with fsm.logical_axis_rules(rules):
    graphdef, state = nnx.split(nnx.eval_shape(create))

  def step(state: Any, batch: jax.Array, arrive: Any = _kept) -> tuple[Any, jax.Array]:
    model, opt = nnx.merge(graphdef, state)

    def loss_fn(m: Any) -> jax.Array:
      return _loss(name, m, batch)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    nnx.update((model, opt), arrive(nnx.state((model, opt))))  # for the update only
    opt.update(model, grads)
    return nnx.state((model, opt)), loss

  return step, state


def builder(
  name: str,
  *,
  batch: int = BATCH,
  seq: int = SEQ,
  api: str = 'linen',
  optimizer_name: str = 'adamw',
  dtype: Any = jnp.bfloat16,
  num_layers: int | None = None,
) -> Any:
  """``build(mesh, rules, remat, offload=None, **knobs) -> (step, state,
  batch)`` for ``fsm.suggest`` (``offload``: an ``fsm.OffloadPreset``, see
  :func:`train_step`). The mixture-of-experts models take the knob
  ``capacity_factor``, and the build's ``knob_notes`` says the share of
  tokens a factor drops at uniform routing.

  Example:
    >>> import jax
    >>> build = builder('mlp', batch=16)
    >>> step, state, batch = build(jax.make_mesh((2, 4), ('data', 'model')),
    ...                            [('batch', 'data')], 'none')
    >>> batch.shape
    (16, 1024)
    >>> builder('moe-tiny', seq=100).knob_notes(capacity_factor=0.5)
    'capacity_factor=0.5 drops 48% of the routed tokens at uniform routing'
  """

  def build(
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    rules: Sequence[tuple[str, Any]],
    remat: str,
    offload: fsm.OffloadPreset | None = None,
    *,
    capacity_factor: float | None = None,
  ) -> Any:
    return train_step(
      name,
      mesh,
      rules=rules,
      batch=batch,
      seq=seq,
      api=api,
      remat=remat,
      optimizer_name=optimizer_name,
      dtype=dtype,
      num_layers=num_layers,
      offload=offload,
      capacity_factor=capacity_factor,
    )

  def knob_notes(capacity_factor: float | None = None) -> str:
    if capacity_factor is None or name not in _moe_configs():
      return ''
    from flax_shardmeta.examples import moe

    config = _moe_configs()[name]
    share = moe.dropped_share(config, seq, capacity_factor)
    if not share:
      return f'capacity_factor={capacity_factor} drops no token at uniform routing'
    return (
      f'capacity_factor={capacity_factor} drops {share:.0%} of the routed tokens '
      'at uniform routing'
    )

  build.knob_notes = knob_notes  # pyright: ignore[reportFunctionMemberAccess]
  return build
