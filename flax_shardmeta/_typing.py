"""Type aliases shared across flax_shardmeta."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import jax

MeshAxes: TypeAlias = str | tuple[str, ...] | None | Any
"""What one array dimension maps to on the mesh: a mesh-axis name, a tuple of
mesh-axis names (sharded over their product), ``None`` (replicated) or
``PartitionSpec.UNCONSTRAINED`` (left to the compiler)."""

LogicalNames: TypeAlias = Sequence[Any]
"""One entry per array dimension: a logical or mesh-axis name, ``None``, a tuple
of mesh axes or ``PartitionSpec.UNCONSTRAINED``."""

LogicalRule: TypeAlias = tuple[str, MeshAxes]
"""``(logical_name, mesh_axes)``: the dimension named ``logical_name`` may be
sharded over ``mesh_axes``."""

LogicalRules: TypeAlias = Sequence[LogicalRule]
"""Priority-ordered rules: earlier rules win over later ones."""

AnyMesh: TypeAlias = jax.sharding.Mesh | jax.sharding.AbstractMesh
"""A concrete device mesh or an abstract one (shape and names only)."""

PyTree: TypeAlias = Any
"""Any JAX pytree."""

BoxingInitializer: TypeAlias = Callable[..., Any]
"""An initializer whose result is a box. Typed ``Any`` on purpose: Linen's
``Module.param`` unboxes it, so the module sees the array, not the box."""
