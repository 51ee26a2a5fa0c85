"""``--module PKG.MOD:FACTORY``: your own model, called the same way by every command.

The factory contract (``plan``, ``fit`` and ``suggest`` alike): ``PKG.MOD`` is
imported (the current directory first on the path, as with ``python -m``) and
``FACTORY`` is called with keyword arguments only, under the command's mesh and
logical axis rules (``jax.set_mesh``, or ``jax.sharding.use_abstract_mesh`` for
an abstract mesh, and ``fsm.logical_axis_rules``): for ``plan`` the abstract
mesh of ``--mesh``; for ``fit`` the mesh of ``--mesh`` over the devices of
``--topology`` (abstract without it); for ``suggest`` each candidate's mesh and
preset rules. The keywords are ``batch``, ``seq``, ``remat`` and
``num_layers``, each passed only when its option is given (``--batch``,
``--seq``, ``--remat``; ``num_layers`` by ``fit --extrapolate``; ``suggest``
passes each candidate's ``remat`` when the factory takes one); an option given
to a factory without that parameter (or ``**kwargs``) is an error. The factory
builds abstractly: parameters with ``jax.eval_shape``, inputs as
``jax.ShapeDtypeStruct``; nothing can be computed on a TPU topology's devices.
What it returns is each command's own (described with the command). A module
that cannot be imported, a missing factory, or a factory (or the model it
returns) that raises is reported in one line naming the factory and the error,
with exit code 2; ``--traceback`` prints the whole traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from flax_shardmeta._errors import FlaxShardmetaError
from flax_shardmeta.cli.common import UsageError

CONTRACT = (__doc__ or '').partition('\n\n')[2]
"""The contract as ``--help`` shows it."""


@dataclasses.dataclass(frozen=True)
class Factory:
  """An imported ``--module PKG.MOD:FACTORY``, called as the contract says.

  Attributes:
    target: ``'pkg.mod:factory'``, as given on the command line.
    function: the factory.
  """

  target: str
  function: Callable[..., Any]

  @classmethod
  def load(cls, target: str) -> Factory:
    """Imports ``PKG.MOD`` and takes its ``FACTORY``.

    Raises:
      UsageError: a malformed target, a module that cannot be imported (its
        error is the ``cause``), or no such factory.
    """
    module_name, colon, attr = target.partition(':')
    if not colon or not module_name or not attr:
      raise UsageError(f'--module {target!r}: expected PKG.MOD:FACTORY')
    if os.getcwd() not in sys.path:  # like `python -m`, find a module next to the user
      sys.path.insert(0, os.getcwd())
    with _reported(target):
      module = importlib.import_module(module_name)
    function = getattr(module, attr, None)
    if function is None:
      raise UsageError(
        f'--module {target}: AttributeError: module {module_name!r} has no '
        f'attribute {attr!r}'
      )
    if not callable(function):
      raise UsageError(
        f'--module {target}: {attr} is {type(function).__name__}, not a function'
      )
    return cls(target, function)

  def __str__(self) -> str:
    """``pkg.mod:factory(batch=8, seq=2048)``: the target and its signature."""
    try:
      return f'{self.target}{inspect.signature(self.function)}'
    except (TypeError, ValueError):  # some callables have no signature to show
      return self.target

  def accepts(self, keyword: str) -> bool:
    """Whether the factory takes ``keyword`` (by name or ``**kwargs``)."""
    try:
      params = inspect.signature(self.function).parameters
    except (TypeError, ValueError):
      return True  # nothing to read: the call itself will say
    named = params.get(keyword)
    if named is not None:
      return named.kind in (named.POSITIONAL_OR_KEYWORD, named.KEYWORD_ONLY)
    return any(p.kind is p.VAR_KEYWORD for p in params.values())

  def default(self, keyword: str) -> Any:
    """The default of parameter ``keyword``, or None."""
    try:
      param = inspect.signature(self.function).parameters.get(keyword)
    except (TypeError, ValueError):
      return None
    return None if param is None or param.default is param.empty else param.default

  def require(self, keyword: str, flag: str) -> None:
    """Raises a ``UsageError`` naming ``flag`` unless the factory takes ``keyword``."""
    if not self.accepts(keyword):
      raise UsageError(
        f'{flag}: {self} takes no {keyword} keyword argument; add the '
        f'parameter (or **kwargs), or leave {flag.split()[0]} out'
      )

  def options(self, given: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """The keyword arguments for ``given`` options, ``{keyword: (flag, value)}``.

    Options whose value is None were not given and are not passed.

    Raises:
      UsageError: a given option the factory takes no parameter for.
    """
    kwargs = {}
    for keyword, (flag, value) in given.items():
      if value is not None:
        self.require(keyword, flag)
        kwargs[keyword] = value
    return kwargs

  def __call__(self, mesh: Any, rules: Any, **kwargs: Any) -> Any:
    """The factory's result, called under ``mesh`` and ``rules``.

    Raises:
      UsageError: whatever the factory raised, in one line (the ``cause``).
    """
    with _reported(self.target, mesh):
      with under(mesh, rules):
        return self.function(**kwargs)

  def step_and_args(self, made: Any) -> tuple[Any, ...]:
    """``made`` as ``(step, *abstract_args)``, what ``fit`` and ``suggest`` take."""
    if not isinstance(made, (tuple, list)) or not made or not callable(made[0]):
      raise UsageError(
        f'--module {self.target}: the factory returned {type(made).__name__}; '
        'expected (step, *abstract_args)'
      )
    return tuple(made)

  @contextlib.contextmanager
  def running(self) -> Iterator[None]:
    """Errors of what the factory returned (its model, its step) are reported
    like its own; flax_shardmeta's (a layout that cannot be) pass through."""
    with _reported(self.target, passing=(FlaxShardmetaError,)):
      yield


@contextlib.contextmanager
def under(mesh: Any, rules: Any) -> Iterator[None]:
  """``mesh`` (concrete or abstract) and logical axis ``rules`` as the context."""
  import jax

  from flax_shardmeta._rules import logical_axis_rules

  if isinstance(mesh, jax.sharding.AbstractMesh):
    context: Any = jax.sharding.use_abstract_mesh(mesh)
  else:
    context = jax.set_mesh(mesh)
  with context, logical_axis_rules(rules):
    yield


@contextlib.contextmanager
def _reported(
  target: str, mesh: Any = None, passing: tuple[type[Exception], ...] = ()
) -> Iterator[None]:
  """Your code's exceptions as one-line ``UsageError``s naming the factory."""
  try:
    yield
  except (UsageError, *passing):
    raise
  except Exception as e:
    if mesh is not None and _computes_eagerly(e, mesh):
      raise UsageError(
        f'--module {target} computes an array eagerly under a TPU topology mesh; '
        'build the arguments abstractly: jax.eval_shape(...) / '
        "jax.ShapeDtypeStruct; a concrete array cannot live on the TPU topology's "
        'devices',
        cause=e,
      ) from None
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = f': {lines[0]}{" ..." if len(lines) > 1 else ""}' if lines else ''
    raise UsageError(f'--module {target}: {type(e).__name__}{text}', cause=e) from None


def _computes_eagerly(error: Exception, mesh: Any) -> bool:
  """Whether ``error`` is jax failing to run an operation on ``mesh``'s devices.

  A mesh over a TPU topology's devices (``fsm.make_mesh(..., topology=...)``)
  compiles but runs nothing: an eager operation under it (``jax.random.key(0)``,
  ``jnp.zeros``) fails deep inside jax with an error that does not say why (jax
  0.10 to 0.12: ``AttributeError: 'Executable' object has no attribute
  'local_devices'``). Rather than match that text, ``error`` is compared with
  what an eager probe raises under the same mesh; where jax runs the probe,
  nothing is detected. A test pins the message this gives.
  """
  import jax
  import jax.numpy as jnp

  if not isinstance(mesh, jax.sharding.Mesh):
    return False
  try:
    with jax.set_mesh(mesh):
      jnp.zeros(())
  except Exception as probe:
    return type(probe) is type(error) and str(probe) == str(error)
  return False
