"""Reference models used by the demo, the CLI and the tests."""

from __future__ import annotations

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

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(
        self.depth,
        kernel_init=with_logical_partitioning(self.dense_init, ('embed', 'hidden')),
        use_bias=False,
    )(x)
    y = jax.nn.relu(y)
    y = with_logical_constraint(y, ('batch', 'hidden'))
    w2 = self.param(
        'W2',
        with_logical_partitioning(self.dense_init, ('hidden', 'embed')),
        (self.depth, x.shape[-1]),
    )
    z = jnp.dot(y, w2, out_sharding=_out_sharding(('batch', 'embed')))
    z = with_logical_constraint(z, ('batch', 'embed'))
    return z, None


class MLP(nn.Module):
  """A stack of DotReluDot layers, unrolled or with ``nn.scan``."""

  num_layers: int = 4
  depth: int = 1024
  use_scan: bool = True

  @nn.compact
  def __call__(self, x):
    if self.use_scan:
      x, _ = nn.scan(
          DotReluDot,
          length=self.num_layers,
          variable_axes={'params': 0},
          split_rngs={'params': True},
          metadata_params={PARTITION_NAME: 'layers'},
      )(self.depth)(x)
    else:
      for _ in range(self.num_layers):
        x, _ = DotReluDot(self.depth)(x)
    return x
