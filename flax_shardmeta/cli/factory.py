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
``jax.ShapeDtypeStruct``, a PRNG key as ``jax.eval_shape(lambda:
jax.random.key(0))``; nothing can be computed on the devices of a TPU pod or
GPU cluster this machine does not have (the error names the line that tried).
Every command takes ``(step, *abstract_args)``, a training step (a plain
function, ``jax.jit`` or ``fsm.jit``, whose ``mesh=None`` is the command's
mesh) and its arguments (``plan`` lays out the annotated ones; it also takes a
model, described with it); donate the state the step returns
(``donate_argnums=``), as the run will, or ``fit`` counts both copies and
says so. A module
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
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from flax_shardmeta import FlaxShardmetaError
from flax_shardmeta.cli.options import UsageError

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
    """``made`` as ``(step, *abstract_args)``, what ``fit`` and ``suggest`` take.

    Raises:
      UsageError: anything else, or an argument leaf that is not an array
        (``jax.ShapeDtypeStruct``, a jax or numpy array) or a Python number.
    """
    if not isinstance(made, (tuple, list)) or not made or not callable(made[0]):
      raise UsageError(
        f'--module {self.target}: the factory returned {type(made).__name__}; '
        'expected (step, *abstract_args)'
      )
    _check_arguments(self.target, made[0], made[1:])
    return tuple(made)

  @contextlib.contextmanager
  def running(self) -> Iterator[None]:
    """Errors of what the factory returned (its model, its step) are reported
    like its own; flax_shardmeta's (a layout that cannot be) pass through."""
    with _reported(self.target, passing=(FlaxShardmetaError,)):
      yield


def _check_arguments(target: str, step: Any, args: Sequence[Any]) -> None:
  """Each leaf of ``args`` is an array or its shape and dtype, or a number."""
  import jax

  try:
    names = list(inspect.signature(step).parameters)
  except (TypeError, ValueError):  # no signature to read: number them
    names = []
  for i, arg in enumerate(args):
    leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
    for path, leaf in leaves:
      if isinstance(leaf, (int, float, complex, bool)) or (
        hasattr(leaf, 'shape') and hasattr(leaf, 'dtype')
      ):
        continue
      name = names[i] if i < len(names) else f'#{i}'
      where = f'{name}{jax.tree_util.keystr(path)}'
      raise UsageError(
        f'--module {target}: argument {i + 1} of the step ({where}) is '
        f'{type(leaf).__name__} {leaf!r:.60}; the factory returns (step, '
        '*abstract_args), each argument a tree of jax.ShapeDtypeStruct '
        '(jax.eval_shape output), arrays or numbers'
      )


@contextlib.contextmanager
def under(mesh: Any, rules: Any) -> Iterator[None]:
  """``mesh`` (concrete or abstract) and logical axis ``rules`` as the context."""
  import jax

  import flax_shardmeta as fsm

  if isinstance(mesh, jax.sharding.AbstractMesh):
    context: Any = jax.sharding.use_abstract_mesh(mesh)
  else:
    context = jax.set_mesh(mesh)
  with context, fsm.logical_axis_rules(rules):
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
    if mesh is not None:
      explained = _constraint_failure(e, mesh)
      if explained is not None:
        raise UsageError(f'--module {target}: {explained}', cause=e) from None
      if _computes_eagerly(e, mesh):
        far = _far_devices(mesh)
        raise UsageError(
          f'--module {target} computes an array eagerly{_user_line(e)} under a '
          f'{far} mesh, of devices this machine does not have, where no concrete '
          'array can live; build it abstractly: jax.eval_shape(lambda: '
          'jax.random.key(0)) for a PRNG key, jax.ShapeDtypeStruct(shape, dtype) '
          'for an input, jax.eval_shape(...) for parameters',
          cause=e,
        ) from None
    raise UsageError(
      f'--module {target}: {type(e).__name__}{_gist(e)}', cause=e
    ) from None


def _gist(error: Exception) -> str:
  """``error``'s message in one line: its first line, and under a heading
  (``1 leaf cannot be sharded as annotated:``) the first item listed too,
  which says what is wrong."""
  text = error.message if isinstance(error, FlaxShardmetaError) else str(error)
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if not lines:
    return ''
  head, rest = lines[0], lines[1:]
  if head.endswith(':') and rest:
    head = f'{head} {rest.pop(0).removeprefix("- ")}'
  return f': {head}{" ..." if rest else ""}'


def _user_line(error: BaseException) -> str:
  """`` at file.py:LINE (`code`)``: the innermost frame of ``error``'s
  traceback outside jax, flax, numpy, flax_shardmeta and Python's own
  library, the line of the user's code that ran it; '' when there is none."""
  import sysconfig

  library = [sysconfig.get_paths()['stdlib']]
  for name in ('jax', 'jaxlib', 'flax', 'numpy', 'flax_shardmeta'):
    module = sys.modules.get(name)
    if module is not None and getattr(module, '__file__', None):
      library.append(os.path.dirname(os.path.abspath(module.__file__ or '')))
  frames = traceback.extract_tb(error.__traceback__)
  for frame in reversed(frames):
    path = os.path.abspath(frame.filename)
    if not frame.filename.startswith('<') and not any(
      path.startswith(d + os.sep) for d in library
    ):
      code = f' (`{frame.line}`)' if frame.line else ''
      return f' at {os.path.relpath(path)}:{frame.lineno}{code}'
  return ''


def _far_devices(mesh: Any) -> str:
  """What a mesh of devices this machine lacks is over, for a message."""
  platform = getattr(next(iter(mesh.devices.flat), None), 'platform', '')
  return {'gpu': 'GPU cluster', 'cuda': 'GPU cluster', 'tpu': 'TPU pod'}.get(
    platform, f'{platform} topology'
  )


def _mesh_text(mesh: Any) -> str:
  """``mesh`` for a message: its axes, and what its devices are."""
  import jax

  sizes = ' x '.join(f'{n}={s}' for n, s in zip(mesh.axis_names, mesh.axis_sizes))
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return f'the abstract mesh {sizes} (no --topology: it has no devices)'
  return f'the {_far_devices(mesh)} mesh {sizes} (devices this machine does not have)'


def _constraint_failure(error: Exception, mesh: Any) -> str | None:
  """What went wrong when ``error`` was raised by ``fsm.with_logical_constraint``
  inside the model the factory evaluates (typically ``init`` on a dummy
  input), and what to do; None for any other error.

  Told by the traceback: the constraint's own frame (its ``names``) and the
  line of the model that called it.
  """
  import flax_shardmeta as fsm

  frames = list(traceback.walk_tb(error.__traceback__))
  at = next(
    (
      i
      for i, (frame, _) in enumerate(frames)
      if frame.f_code is fsm.with_logical_constraint.__code__
    ),
    None,
  )
  if at is None:
    return None
  names = frames[at][0].f_locals.get('names')
  where = ''
  if at > 0:
    caller, line = frames[at - 1]
    where = f' at {os.path.basename(caller.f_code.co_filename)}:{line}'
  what = (
    "the model's activation constraint fsm.with_logical_constraint(..., "
    f'{names!r}){where}'
  )
  on = _mesh_text(mesh)
  problems = error.problems if isinstance(error, fsm.ShardingError) else ()
  if problems:
    p = problems[0]
    factors = p.shards(mesh)
    if (
      factors
      and p.shape is not None
      and all(p.shape[d] % f for d, f in zip(p.dims, factors))
    ):
      fix = (
        'The factory evaluates the model on an input the mesh cannot split (a '
        'dummy batch for init?): initialise under jax.eval_shape with inputs of '
        'the real shapes (jax.ShapeDtypeStruct), or with a batch that is a '
        f'multiple of {factors[0]}'
      )
    else:
      fix = f'Fix: {p.hint}'
    return (
      f'{what} cannot lay out the value the factory gives it, on {on}: shape '
      f'{p.shape}, spec {p.to_dict()["spec"]}: {p.reason}. {fix}'
    )
  if isinstance(error, fsm.NoMeshError) or _computes_eagerly(error, mesh):
    return (
      f'{what} was applied eagerly, to a concrete array outside jit, while the '
      f'factory ran; nothing can be laid out on {on}. Initialise the model '
      'abstractly, e.g. jax.eval_shape(lambda: model.init(jax.random.key(0), x)), '
      'or give the factory abstract inputs (jax.ShapeDtypeStruct)'
    )
  return None


def _computes_eagerly(error: Exception, mesh: Any) -> bool:
  """Whether ``error`` is jax failing to run an operation on ``mesh``'s devices.

  A mesh over a TPU pod's or GPU cluster's devices (``fsm.make_mesh(...,
  topology=...)``) compiles but runs nothing: an eager operation under it
  (``jax.random.key(0)``, ``jnp.zeros``) fails deep inside jax with an error
  that does not say why (jax 0.10 to 0.12: ``AttributeError: 'Executable'
  object has no attribute 'local_devices'``). Rather than match that text,
  ``error`` is compared with what an eager probe raises under the same mesh;
  where jax runs the probe, nothing is detected. A test pins the message this
  gives.
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


# What a factory returned
# ------------------------------------------------------------------------------


def made_kind(made: Any) -> str:
  """What a factory returned, as every command reads it: ``'module'`` (a Linen
  module and its example inputs), ``'step'`` (``(step, *abstract_args)``),
  ``'builder'`` (a function of no arguments building the variables or an NNX
  module) or ``'value'`` (the tree itself)."""
  from flax import linen as nn

  seq = isinstance(made, (tuple, list)) and bool(made)
  if seq and isinstance(made[0], nn.Module):
    return 'module'
  if seq and callable(made[0]):
    return 'step'
  return 'builder' if callable(made) else 'value'


def built(made: Any, api: str) -> Any:
  """A ``'builder'``'s abstract result: ``nnx.eval_shape`` of it under
  ``--api nnx`` (an NNX module comes back as its state), else
  ``jax.eval_shape``."""
  import jax

  if api == 'nnx':
    from flax import nnx

    out = nnx.eval_shape(made)
    return nnx.state(out) if isinstance(out, nnx.Module) else out
  return jax.eval_shape(made)
