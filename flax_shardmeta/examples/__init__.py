"""The built-in example models, public for notebooks and scripts.

``examples.linen`` and ``examples.nnx`` hold the Flax scale-up notebook's MLP
and Llama-3 with the same shapes and logical names in both front ends
(``examples.linen.model(name)`` / ``examples.nnx.model(name, ...)``);
``examples.abstract_state(name, api, optimizer_name, dtype)`` gives a built-in
model's abstract training state for ``fsm.plan``, and
``examples.model_rules(name)`` the rules it is meant to be planned with (what
``flax-shardmeta plan --model NAME`` uses); ``examples.train`` builds their
training steps abstractly for ``fsm.fit`` and ``fsm.suggest``
(``train_step(name, mesh, batch=..., seq=...)``, ``builder(name, ...)``);
``examples.moe`` is a Mixtral-shaped mixture of experts (its experts on the
logical name ``'expert'``), trained by ``examples.train`` too; ``examples.demo``
is the job ``flax-shardmeta demo`` runs. Importing this package is light: the model
modules (and flax's front ends) load when first used.

Example:
  >>> from flax_shardmeta import examples
  >>> examples.MODEL_NAMES
  ('mlp', 'llama3-8b', 'llama3-70b', 'llama3-405b')
"""

import importlib
from typing import Any

from flax_shardmeta.examples.state import (
  MODEL_NAMES,
  OPTIMIZERS,
  UnknownNameError,
  abstract_linen_params,
  abstract_nnx_state,
  abstract_state,
  abstract_train_state,
  model_rules,
  optimizer,
)

_LAZY_MODULES = ('linen', 'nnx', 'demo', 'train', 'moe')


def __getattr__(name: str) -> Any:
  if name in _LAZY_MODULES:
    return importlib.import_module(f'{__name__}.{name}')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = [
  'MODEL_NAMES',
  'OPTIMIZERS',
  'UnknownNameError',
  'abstract_linen_params',
  'abstract_nnx_state',
  'abstract_state',
  'abstract_train_state',
  'model_rules',
  'optimizer',
]
