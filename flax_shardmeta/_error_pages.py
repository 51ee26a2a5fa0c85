"""The errors page: the line every error and warning message ends with.

Each class of ``_errors`` has a section on the errors page, ``errors.md``,
shipped inside the package (the site's ``docs/errors.md`` includes it), so an
installed user reads it with ``flax-shardmeta explain CLASSNAME``. ``str()`` of
an error ends with that command; ``.message`` is the message as raised, to
quote inside another one.
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import re

_ERRORS = 'flax_shardmeta._errors'
"""The module whose classes the page documents (a subclass made elsewhere
points to its nearest base there)."""

ERRORS_PAGE = 'errors.md'
"""The page with a section per error and warning class (what raises it, what
to do), a file of the package: ``flax-shardmeta explain`` prints its sections."""


def errors_page_line(cls: type) -> str:
  """The line ending the message of an error or warning ``cls``: its section.

  The section is that of the nearest class of ``_errors`` in ``cls``'s MRO (a
  subclass made elsewhere points to its base's), named as the command that
  prints it. On the documentation site it is ``errors.html#`` and the class
  name in lower case.

  Example:
    >>> import flax_shardmeta as fsm
    >>> errors_page_line(fsm.RuleConflictError)
    '(what to do: flax-shardmeta explain RuleConflictError)'
  """
  documented = next(
    c for c in cls.__mro__ if c.__module__ == _ERRORS and c.__name__[0] != '_'
  )
  return f'(what to do: flax-shardmeta explain {documented.__name__})'


@functools.cache
def sections() -> dict[str, str]:
  """Each section of the errors page by its class name, as written (markdown).

  Example:
    >>> list(sections())[:2]
    ['FlaxShardmetaError', 'ShardingError']
  """
  page = importlib.resources.files('flax_shardmeta').joinpath(ERRORS_PAGE)
  parts = re.split(r'^## (\w+)\n', page.read_text(encoding='utf-8'), flags=re.M)
  return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2])}


def _key(name: str) -> str:
  # 'fsm.ShardingError', 'flax_shardmeta._errors.ShardingError', the old
  # 'docs/errors.md#shardingerror' and 'shardingerror' all name one section.
  return re.split(r'[.#/:]', name.strip())[-1].lower()


def section_name(name: str) -> str:
  """The class whose section ``name`` means, whatever its case or prefix.

  Raises:
    LookupError: no section has that name; the message lists the close ones.

  Example:
    >>> section_name('fsm.shardingerror'), section_name('errors.md#fiterror')
    ('ShardingError', 'FitError')
  """
  by_key = {_key(n): n for n in sections()}
  if _key(name) in by_key:
    return by_key[_key(name)]
  close = difflib.get_close_matches(_key(name), by_key, n=3, cutoff=0.6)
  known = [by_key[c] for c in close] or list(sections())
  which = 'did you mean' if close else 'the sections are'
  raise LookupError(
    f'no section of the errors page is called {name!r}; {which} {", ".join(known)}'
  )


LISTING_WIDTH = 100
"""Columns of the list of sections: each line's first sentence is cut to fit."""


def _plain_links(text: str) -> str:
  return re.sub(r'\[([^\]]+)\]\([^)]+\)', r'\1', text)


def _listing() -> str:
  width = max(map(len, sections()))
  room = LISTING_WIDTH - width - 4
  out = ['The errors page, a section per class (flax-shardmeta explain NAME):']
  for name, text in sections().items():
    paragraph = _plain_links(' '.join(text.split('\n\n', 1)[0].split()))
    sentence = paragraph.split('. ', 1)[0].rstrip('.:') + '.'
    if len(sentence) > room:
      sentence = sentence[: room - 3] + '...'
    out.append(f'  {name:<{width}}  {sentence}')
  return '\n'.join(out) + '\n'


def explain_error(error: str | type | BaseException | None = None) -> str:
  """The errors page's section on an error or warning, as text for a terminal.

  What ``flax-shardmeta explain NAME`` prints: what raises it, a message as it
  reads (indented) and what to do. ``error`` is a class name in any case, with
  or without a module (``'fsm.ShardingError'``), the class or an instance (a
  subclass made elsewhere gets its base's section); ``None`` lists the
  sections, one line each.

  Raises:
    LookupError: no section has that name; the message lists the close ones.

  Example:
    >>> import flax_shardmeta as fsm
    >>> print(fsm.explain_error('nomesherror').splitlines()[0])
    NoMeshError
    >>> 'What to do:' in fsm.explain_error(fsm.NoMeshError('no mesh'))
    True
  """
  if error is None:
    return _listing()
  if isinstance(error, BaseException):
    error = type(error)
  if isinstance(error, type):
    error = errors_page_line(error).rsplit(' ', 1)[1].rstrip(')')
  title = section_name(error)
  out, fenced = [title, '=' * len(title), ''], False
  for line in sections()[title].splitlines():
    if line.startswith('```'):
      fenced = not fenced
      continue
    if fenced:
      out.append(f'    {line}' if line else '')
    else:
      out.append(_plain_links(line))
  return '\n'.join(out) + '\n'


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
      '(what to do: flax-shardmeta explain NoMeshError)'
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
