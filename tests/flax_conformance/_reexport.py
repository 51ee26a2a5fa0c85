"""Re-exporting a flax module from the shim that stands for it."""

from collections.abc import Callable
from types import ModuleType
from typing import Any


def public_namespace(module: ModuleType) -> dict[str, Any]:
  """Every name of ``module`` except its dunders, for ``globals().update``.

  Private names are kept: flax's tests reach into them (``nn.spmd``,
  ``partitioning._with_sharding_constraint``) and must find flax's own.
  """
  return {k: v for k, v in vars(module).items() if not k.startswith('__')}


def fallback(module: ModuleType) -> Callable[[str], Any]:
  """A module ``__getattr__`` (PEP 562) reading ``module``: the names it gains
  after the shim copied it (a submodule imported later) are found too."""

  def __getattr__(name: str) -> Any:
    return getattr(module, name)

  return __getattr__
