"""Abstract training states of the built-in models, for planning without devices.

What ``flax-shardmeta plan --model NAME`` plans, as functions: the parameters of
a built-in model (Linen or NNX) and its optimizer state, all
``jax.ShapeDtypeStruct`` under ``jax.eval_shape``, annotated with logical names;
and the rules each model is meant to be planned with. Nothing is allocated, so
Llama-3-405B's state is built in a few seconds on a laptop. flax and optax are
imported only when a function needs them.
"""

from __future__ import annotations

from typing import Any

import flax_shardmeta as fsm
from flax_shardmeta.examples._model_names import LLAMA_RULES, MLP_RULES, MODEL_NAMES

TRAINING_OPTIMIZERS = ('adamw', 'adam', 'adafactor', 'sgd')
"""The built-in training step's optimizers (``examples.train.OPTIMIZERS``)."""
OPTIMIZERS = (*TRAINING_OPTIMIZERS, 'none')
"""Optimizer names :func:`abstract_state` (and ``--optimizer``) accepts."""
LEARNING_RATE = 1e-4
"""Every built-in optimizer's (the state's shapes do not depend on it)."""


class UnknownNameError(fsm.FlaxShardmetaError):
  """An optimizer, model or API name that is not one of the choices.

  Example:
    >>> from flax_shardmeta import examples
    >>> examples.model_rules('gpt')
    Traceback (most recent call last):
    ...
    flax_shardmeta.examples.state.UnknownNameError: unknown model 'gpt'; choose
    from mlp, llama3-8b, llama3-70b, llama3-405b
    (what to do: flax-shardmeta explain FlaxShardmetaError)
  """


def model_rules(name: str) -> tuple[tuple[str, Any], ...]:
  """The logical axis rules built-in model ``name`` is meant to be planned with.

  Example:
    >>> from flax_shardmeta import examples
    >>> dict(examples.model_rules('llama3-70b'))['mlp']
    'model'
  """
  if name not in MODEL_NAMES:
    raise UnknownNameError(
      f'unknown model {name!r}; choose from {", ".join(MODEL_NAMES)}'
    )
  return MLP_RULES if name == 'mlp' else LLAMA_RULES


def optimizer(name: str) -> Any:
  """The optax transformation behind an optimizer name (None for 'none').

  Example:
    >>> from flax_shardmeta import examples
    >>> examples.optimizer('none') is None
    True
  """
  import optax  # only when an optimizer is planned

  # The one table of the built-in optimizers, for plans and training alike.
  made = {
    'adamw': optax.adamw,
    'adam': optax.adam,
    'adafactor': optax.adafactor,
    'sgd': optax.sgd,
  }.get(name)
  if made is not None:
    return made(LEARNING_RATE)
  if name == 'none':
    return None
  raise UnknownNameError(
    f'unknown optimizer {name!r}; choose from {", ".join(OPTIMIZERS)}'
  )


def abstract_linen_params(module: Any, *inputs: Any) -> Any:
  """``module``'s annotated parameters as ShapeDtypeStructs; nothing is allocated.

  Example:
    >>> from flax_shardmeta import examples
    >>> params = examples.abstract_linen_params(*examples.linen.model('mlp'))
    >>> params['ScanDotReluDot_0']['W2'].value.shape
    (4, 1024, 1024)
  """
  import jax

  def init(*xs: Any) -> Any:
    return module.init(jax.random.key(0), *xs)['params']

  return jax.eval_shape(init, *inputs)


def abstract_train_state(params: Any, optimizer_name: str = 'adam') -> dict[str, Any]:
  """``{'params': params, 'opt_state': ...}`` with the optimizer state abstract.

  Optax moments keep their parameter's box, so they are planned like it.

  Example:
    >>> from flax_shardmeta import examples
    >>> params = examples.abstract_linen_params(*examples.linen.model('mlp'))
    >>> state = examples.abstract_train_state(params, 'adam')
    >>> state['opt_state'][0].mu['ScanDotReluDot_0']['W2'].names
    ('layers', 'hidden', 'embed')
  """
  import jax

  tx = optimizer(optimizer_name)
  if tx is None:
    return {'params': params}
  return {'params': params, 'opt_state': jax.eval_shape(tx.init, params)}


def abstract_nnx_state(
  name: str, optimizer_name: str = 'adam', dtype: Any = None
) -> dict[str, Any]:
  """``{'params': nnx.State, 'opt_state': nnx.State}`` of a built-in NNX model.

  The moments of ``nnx.Optimizer`` carry their parameter's annotation.

  Example:
    >>> from flax_shardmeta import examples
    >>> state = examples.abstract_nnx_state('mlp', 'none')
    >>> state['params']['layers']['W2'].shape
    (4, 1024, 1024)
  """
  import jax.numpy as jnp
  from flax import nnx

  from flax_shardmeta.examples import nnx as nnx_models

  tx = optimizer(optimizer_name)

  def create() -> tuple[Any, Any]:
    m = nnx_models.model(name, dtype or jnp.float32, rngs=nnx.Rngs(0))
    return m, (nnx.Optimizer(m, tx, wrt=nnx.Param) if tx is not None else None)

  m, opt = nnx.eval_shape(create)
  state: dict[str, Any] = {'params': nnx.state(m, nnx.Param)}
  if opt is not None:
    state['opt_state'] = nnx.state(opt.opt_state)
  return state


def abstract_state(
  name: str,
  api: str = 'linen',
  optimizer_name: str = 'adam',
  dtype: Any = None,
) -> dict[str, Any]:
  """A built-in model's abstract parameters (and optimizer state) for planning.

  Args:
    name: one of ``examples.MODEL_NAMES``.
    api: 'linen' or 'nnx'.
    optimizer_name: one of :data:`OPTIMIZERS`.
    dtype: the parameters' dtype (float32 by default).

  Returns:
    ``{'params': ..., 'opt_state': ...}`` (no 'opt_state' for 'none').

  Raises:
    UnknownNameError: for a name that is not one of the choices.

  Example:
    >>> from flax_shardmeta import examples
    >>> state = examples.abstract_state('mlp', optimizer_name='none')
    >>> sorted(state)
    ['params']
  """
  import jax.numpy as jnp

  if api == 'linen':
    from flax_shardmeta.examples import linen

    module, x = linen.model(name, dtype or jnp.float32)
    return abstract_train_state(abstract_linen_params(module, x), optimizer_name)
  if api == 'nnx':
    return abstract_nnx_state(name, optimizer_name, dtype)
  raise UnknownNameError(f"unknown api {api!r}; choose 'linen' or 'nnx'")
