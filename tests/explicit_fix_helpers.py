"""A helper module for tests/test_audit_fixes_paste.py: the refused line is
here, inside a helper whose result has another rank than the refused value
(Auto mesh axes as written; the test pastes the fixes for Explicit ones)."""

import jax.numpy as jnp


def token_norms(table, tokens):
  """Per token, the norm of its embedding: rank 2, from a rank-3 gather."""
  rows = table[tokens]  # refused
  return jnp.sqrt(jnp.sum(rows**2, axis=-1))
