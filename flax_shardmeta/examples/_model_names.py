"""The built-in models' names and rules, without importing jax.

Kept apart from the models so that the command line can list them (and print
its help) without loading jax; a test keeps ``MODEL_NAMES`` in step with
``_common.LLAMA_CONFIGS``.
"""

from __future__ import annotations

MODEL_NAMES = ('mlp', 'llama3-8b', 'llama3-70b', 'llama3-405b')
"""The built-in models: the notebook MLP and the Llama-3 shapes."""

MLP_RULES = (('batch', 'data'), ('hidden', 'model'), ('embed', None), ('layers', None))
"""Rules for the notebook MLP over a ('data', 'model') mesh."""


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
