"""The errors page: the line every error and warning message ends with.

Each class of ``_errors`` has a section on ``docs/errors.md``, its anchor the
class name in lower case. ``str()`` of an error ends with that section's line;
``.message`` is the message as raised, to quote inside another one.
"""

from __future__ import annotations

_ERRORS = 'flax_shardmeta._errors'
"""The module whose classes the page documents (a subclass made elsewhere
points to its nearest base there)."""

ERRORS_PAGE = 'docs/errors.md'
"""The page with a section per error and warning class: what raises it, what to do."""


def errors_page_line(cls: type) -> str:
  """The line ending the message of an error or warning ``cls``: its section.

  The section is that of the nearest class of ``_errors`` in ``cls``'s MRO (a
  subclass made elsewhere points to its base's); its anchor is the class name
  in lower case, as the page's headings make it.

  Example:
    >>> import flax_shardmeta as fsm
    >>> errors_page_line(fsm.RuleConflictError)
    '(errors page: docs/errors.md#ruleconflicterror)'
  """
  documented = next(
    c for c in cls.__mro__ if c.__module__ == _ERRORS and c.__name__[0] != '_'
  )
  return f'(errors page: {ERRORS_PAGE}#{documented.__name__.lower()})'


class NamesItsSection:
  """Ends ``str()`` of an error or warning with its errors page line."""

  # In ``__str__``, not the arguments: a traceback, ``print``, pytest's
  # ``match=`` and a shown warning all read it, while ``args`` keep the
  # message as raised (``message`` returns it, to quote inside another one).
  def __str__(self) -> str:
    text = super().__str__()
    line = errors_page_line(type(self))
    return f'{text}\n{line}' if text else line

  @property
  def message(self) -> str:
    """The message as raised, without the errors page line: to quote inside
    another message (a command's one-line error, a wrapping error).

    Example:
      >>> import flax_shardmeta as fsm
      >>> fsm.NoMeshError('no mesh').message
      'no mesh'
    """
    return BaseException.__str__(self)  # type: ignore[arg-type]

  @property
  def errors_page(self) -> str:
    """The line ``str()`` ends with: the errors page section about this class.

    Example:
      >>> import flax_shardmeta as fsm
      >>> fsm.NoMeshError('no mesh').errors_page
      '(errors page: docs/errors.md#nomesherror)'
    """
    return errors_page_line(type(self))


def message(error: BaseException | str) -> str:
  """``error``'s message without the errors page line, to quote in another one
  (also a caught warning's ``message``: the warning or its text).

  Example:
    >>> import flax_shardmeta as fsm
    >>> message(fsm.NoMeshError('no mesh'))
    'no mesh'
  """
  if isinstance(error, BaseException) and isinstance(error, NamesItsSection):
    return BaseException.__str__(error)
  return str(error)
