"""The source lines of a lowered program, and moving a cached program's lines.

The fit cache is keyed by the lowered program without its source locations
(:func:`read`), so the same model fitted from a second script reuses the
first one's compiled program. That program's HLO text names the first
script's lines; the lines of each lowered op, read here in op order from
``lowered.as_text(debug_info=True)``, are kept with the cached figures. On a
cache hit the two lists, one op for one op (the same program without
locations is the same op sequence), tell where each old line is now
(:func:`mapping`), and :func:`rewrite` moves the HLO text's lines there
before it is read.

MLIR locations, as jax prints them: ``loc("f.py":4:15 to :28)`` (a line and
column range; older MLIR prints ``"f.py":4:15``), ``loc("name"(child))`` (a
function's frame, or jax's name stack around the op's frames),
``loc(callsite(callee at caller))`` (the frames, innermost first), ``fused``
locations, ``loc(unknown)``, and ``#locN`` aliases defined on lines of their
own (``#loc7 = loc(...)``).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

Place = tuple[str, int]
Chain = tuple[Place, ...]

# Location aliases are defined one a line, most after the module.
_ALIAS_LINE = re.compile(r'^(#loc[\w.]*) = loc\((.*)\)[ \t]*$\n?', re.M)
# A quoted string (skipped whole: an attribute may hold anything), or an op's
# location: most are a bare alias, read without the parser.
_SITE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|(?<![\w@%#$.])loc\((?:(#loc[\w.]*)\))?')
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_ALIAS_NAME = re.compile(r'#loc[\w.]*')
_LINE_COL = re.compile(r':(\d+)(?::\d+)?(?: to (?:\d*:)?\d+)?')
_ESCAPE = re.compile(r'\\([0-9A-Fa-f]{2}|.)')


@dataclasses.dataclass(frozen=True)
class Lines:
  """The source lines of a lowered program's ops, in op order: ``ops[i]`` is
  the i-th op's index in ``chains``, a chain of ``(file, line)`` frames,
  innermost first (empty where jax kept none).

  Example:
    >>> lines = Lines([(), (('m.py', 3), ('d.py', 9))], [1, 1, 0])
    >>> Lines.from_json(lines.to_json()) == lines
    True
    >>> lines.to_json()['ops']  # runs of one chain: [chain, count, ...]
    [1, 2, 0, 1]
  """

  chains: list[Chain]
  ops: list[int]

  def to_json(self) -> dict[str, Any]:
    """A compact JSON form: file names once, runs of ops with one chain."""
    files: dict[str, int] = {}
    chains = [
      [n for f, line in chain for n in (files.setdefault(f, len(files)), line)]
      for chain in self.chains
    ]
    runs: list[int] = []
    for op in self.ops:
      if runs and runs[-2] == op:
        runs[-1] += 1
      else:
        runs += [op, 1]
    return {'files': list(files), 'chains': chains, 'ops': runs}

  @classmethod
  def from_json(cls, data: Any) -> Lines | None:
    """The lines :meth:`to_json` wrote, or None for anything else."""
    try:
      files = [str(f) for f in data['files']]
      chains = [
        tuple((files[c[i]], int(c[i + 1])) for i in range(0, len(c), 2))
        for c in data['chains']
      ]
      runs = data['ops']
      ops = [int(runs[i]) for i in range(0, len(runs), 2) for _ in range(runs[i + 1])]
    except (KeyError, TypeError, ValueError, IndexError):
      return None
    if any(not 0 <= op < len(chains) for op in ops):
      return None
    return cls(chains, ops)


def read(text: str) -> tuple[str, Lines]:
  """A lowered program's text (``as_text(debug_info=True)``) without its
  source locations, and the lines of its ops.

  Each op's location becomes its jax name stack alone (the frames' function
  names, files and lines go), so the same program written at other lines or
  in another file reads the same; another name stack is another program.

  Example:
    >>> text = '\\n'.join([
    ...   '%0 = stablehlo.tanh %a loc(#loc3)',
    ...   '%1 = stablehlo.sine %0 loc(unknown)',
    ...   '#loc1 = loc("m.py":4:15 to :28)',
    ...   '#loc2 = loc("loss"(#loc1))',
    ...   '#loc3 = loc("jit(step)/tanh"(callsite(#loc2 at "d.py":9:2)))'])
    >>> program, lines = read(text)
    >>> print(program)
    %0 = stablehlo.tanh %a loc("jit(step)/tanh")
    %1 = stablehlo.sine %0 loc()
    >>> [lines.chains[op] for op in lines.ops]
    [(('m.py', 4), ('d.py', 9)), ()]
  """
  reader = _Reader()
  for m in _ALIAS_LINE.finditer(text):
    reader.aliases[m.group(1)] = m.group(2)
  body = _ALIAS_LINE.sub('', text).rstrip('\n')
  pieces: list[str] = []
  ops: list[int] = []
  at = 0
  while (m := _SITE.search(body, at)) is not None:
    if m.group(0).startswith('"'):  # a string: nothing to read in it
      pieces.append(body[at : m.end()])
      at = m.end()
      continue
    pieces.append(body[at : m.start()])
    if m.group(1) is not None:
      chain, names = reader.alias(m.group(1))
      at = m.end()
    else:
      node, end = reader.parse_site(body, m.end())
      chain, names = reader.chain(node), reader.names(node)
      at = end
    ops.append(reader.chain_id(chain))
    pieces.append(f'loc({", ".join(names)})')
  pieces.append(body[at:])
  return ''.join(pieces), Lines(reader.chains, ops)


def mapping(old: Lines, new: Lines) -> dict[Place, Place]:
  """Where each of ``old``'s lines is in ``new``: the two programs' ops side
  by side, their frames innermost first; a line met at several new ones goes
  to the most frequent.

  Example:
    >>> old = Lines([(('a.py', 4), ('d.py', 9)), (('a.py', 5),)], [0, 1, 1])
    >>> new = Lines([(('b.py', 10), ('d.py', 9)), (('b.py', 11),)], [0, 1, 1])
    >>> mapping(old, new)[('a.py', 5)]
    ('b.py', 11)
    >>> mapping(old, Lines([], []))  # not the same program: nothing moves
    {}
  """
  if len(old.ops) != len(new.ops):
    return {}
  votes: dict[Place, Counter[Place]] = {}
  for (a, b), count in Counter(zip(old.ops, new.ops)).items():
    # jax keeps the innermost frames: a deeper or shallower caller in the new
    # script shifts only the outermost ones.
    for was, now in zip(old.chains[a], new.chains[b]):
      votes.setdefault(was, Counter())[now] += count
  return {was: counts.most_common(1)[0][0] for was, counts in votes.items()}


def rewrite(text: str, moves: dict[Place, Place]) -> str:
  """An optimised HLO text with its source lines moved: its ``FileNames``
  and ``FileLocations`` tables (a file it did not name is added), and
  ``source_file``/``source_line`` metadata (older XLA). Lines not in
  ``moves`` stay.

  Example:
    >>> text = '\\n'.join([
    ...   'HloModule m', '', 'FileNames', '1 "a.py"', '', 'FileLocations',
    ...   '1 {file_name_id=1 function_name_id=1 line=4 end_line=5 column=2}',
    ...   '', 'ENTRY %main () -> f32[] {',
    ...   '  %c = f32[] constant(0), metadata={source_file="a.py" source_line=4}',
    ...   '}'])
    >>> print(rewrite(text, {('a.py', 4): ('b.py', 10)}))
    HloModule m
    <BLANKLINE>
    FileNames
    1 "a.py"
    2 "b.py"
    <BLANKLINE>
    FileLocations
    1 {file_name_id=2 function_name_id=1 line=10 end_line=11 column=2}
    <BLANKLINE>
    ENTRY %main () -> f32[] {
      %c = f32[] constant(0), metadata={source_file="b.py" source_line=10}
    }
  """
  moves = {was: now for was, now in moves.items() if was != now}
  if not moves:
    return text
  # The tables come before the first computation: only that much is split.
  m = _FIRST_COMPUTATION.search(text)
  cut = m.start() if m else len(text)
  text = _rewrite_tables(text[:cut], moves) + text[cut:]
  if 'source_file="' in text:
    text = _SOURCE.sub(lambda s: _moved_source(s, moves), text)
  return text


def relocate(text: str, stored: Any, current: Lines) -> str:
  """A cached HLO text with the lines of the ``stored`` lines (JSON, those
  of the lowering that compiled it) moved to ``current``'s; unchanged when
  the entry has no lines.

  Example:
    >>> text = 'FileNames\\n1 "a.py"\\n\\nFileLocations\\n'
    >>> text += '1 {file_name_id=1 function_name_id=1 line=4 end_line=4}\\n'
    >>> stored = Lines([(('a.py', 4),)], [0]).to_json()
    >>> print(relocate(text, stored, Lines([(('a.py', 7),)], [0])))
    FileNames
    1 "a.py"
    <BLANKLINE>
    FileLocations
    1 {file_name_id=1 function_name_id=1 line=7 end_line=7}
    <BLANKLINE>
    >>> relocate(text, None, Lines([], [])) == text
    True
  """
  old = Lines.from_json(stored) if stored is not None else None
  if old is None:
    return text
  return rewrite(text, mapping(old, current))


class _Reader:
  """Parses MLIR locations and resolves them, aliases once each."""

  def __init__(self) -> None:
    self.aliases: dict[str, str] = {}
    self._resolved: dict[str, Any] = {}
    self._read: dict[str, tuple[Chain, tuple[str, ...]]] = {}
    self._chain_ids: dict[Chain, int] = {}
    self.chains: list[Chain] = []

  def chain_id(self, chain: Chain) -> int:
    if chain not in self._chain_ids:
      self._chain_ids[chain] = len(self.chains)
      self.chains.append(chain)
    return self._chain_ids[chain]

  def alias(self, name: str) -> tuple[Chain, tuple[str, ...]]:
    """The chain and name stack of an op located at alias ``name``."""
    if name not in self._read:
      node = self._node(name)
      self._read[name] = (self.chain(node), self.names(node))
    return self._read[name]

  def _node(self, name: str) -> Any:
    if name not in self._resolved:
      self._resolved[name] = ('?',)  # a cycle reads as unknown, not forever
      text = self.aliases.get(name)
      if text is not None:
        self._resolved[name] = self._parse_whole(text)
    return self._resolved[name]

  def _parse_whole(self, text: str) -> Any:
    try:
      return self._parse(text, 0)[0]
    except (_Unreadable, ValueError, IndexError):  # a form this reader does not know
      return ('?',)

  def parse_site(self, body: str, at: int) -> tuple[Any, int]:
    """The location starting at ``body[at]`` (after ``loc(``), and where the
    text after its closing parenthesis starts."""
    end = _balanced_end(body, at)
    return self._parse_whole(body[at : end - 1]), end

  def _parse(self, s: str, i: int) -> tuple[Any, int]:
    if s.startswith('#loc', i):
      m = _ALIAS_NAME.match(s, i)
      assert m is not None
      return ('r', m.group(0)), m.end()
    if s.startswith('unknown', i):
      return ('?',), i + len('unknown')
    if s.startswith('callsite(', i):
      callee, i = self._parse(s, i + len('callsite('))
      i = _expect(s, i, ' at ')
      caller, i = self._parse(s, i)
      return ('c', callee, caller), _expect(s, i, ')')
    if s.startswith('fused', i):
      i += len('fused')
      if s.startswith('<', i):
        i = _balanced_end(s, i + 1, '<', '>')
      i = _expect(s, i, '[')
      parts = []
      while True:
        part, i = self._parse(s, i)
        parts.append(part)
        if s.startswith(']', i):
          return ('u', parts), i + 1
        i = _expect(s, i, ', ')
    m = _STRING.match(s, i)
    if m is None:
      raise _Unreadable(f'no location at {s[i : i + 20]!r}')
    quoted, i = m.group(0), m.end()
    if (lc := _LINE_COL.match(s, i)) is not None:
      return ('f', _unescape(quoted), int(lc.group(1))), lc.end()
    if s.startswith('(', i):
      child, i = self._parse(s, i + 1)
      return ('n', quoted, child), _expect(s, i, ')')
    return ('n', quoted, None), i

  def _deref(self, node: Any) -> Any:
    seen = set()
    while node[0] == 'r' and node[1] not in seen:
      seen.add(node[1])
      node = self._node(node[1])
    return ('?',) if node[0] == 'r' else node

  def chain(self, node: Any) -> Chain:
    """The ``(file, line)`` frames of a location, innermost first."""
    node = self._deref(node)
    kind = node[0]
    if kind == 'f':
      return ((node[1], node[2]),)
    if kind == 'n':
      return self.chain(node[2]) if node[2] is not None else ()
    if kind == 'c':
      return self.chain(node[1]) + self.chain(node[2])
    if kind == 'u':
      return next((c for c in map(self.chain, node[1]) if c), ())
    return ()

  def names(self, node: Any) -> tuple[str, ...]:
    """jax's name stack around a location (quoted as printed): the names
    outside its frames; a name around a file location is a frame's function,
    not part of the program."""
    node = self._deref(node)
    if node[0] == 'n':
      child = self._deref(node[2]) if node[2] is not None else None
      if child is not None and child[0] == 'f':
        return ()
      return (node[1],) + (self.names(child) if child is not None else ())
    if node[0] == 'u':
      return tuple(n for part in node[1] for n in self.names(part))
    return ()


class _Unreadable(Exception):
  """A location this reader does not know (the op then has no lines)."""


def _expect(s: str, i: int, token: str) -> int:
  if not s.startswith(token, i):
    raise _Unreadable(f'expected {token!r} at {s[i : i + 20]!r}')
  return i + len(token)


def _balanced_end(s: str, i: int, open_: str = '(', close: str = ')') -> int:
  """Just past the ``close`` matching an ``open_`` already read before
  ``s[i]``, quoted strings skipped."""
  depth = 1
  while i < len(s):
    c = s[i]
    if c == '"':
      m = _STRING.match(s, i)
      i = m.end() if m else len(s)
      continue
    if c == open_:
      depth += 1
    elif c == close:
      depth -= 1
      if depth == 0:
        return i + 1
    i += 1
  return len(s)


def _unescape(quoted: str) -> str:
  r"""An MLIR string's text: ``\\`` and ``\XX`` (hex) escapes read."""
  body = quoted[1:-1]
  if '\\' not in body:
    return body

  def one(m: re.Match[str]) -> str:
    code = m.group(1)
    return chr(int(code, 16)) if len(code) == 2 else code

  return _ESCAPE.sub(one, body)


_FIRST_COMPUTATION = re.compile(r'^(?:%|ENTRY\b)', re.M)
_FILE_NAME = re.compile(r'(\d+) "(.*)"$')
_FILE_LOCATION = re.compile(
  r'(\d+ \{file_name_id=)(\d+)( function_name_id=\d+ line=)(\d+)'
  r'(?:( end_line=)(\d+))?'
)
_SOURCE = re.compile(
  r'\bsource_file="([^"]*)" source_line=(\d+)(?: source_end_line=(\d+))?'
)


def _rewrite_tables(head: str, moves: dict[Place, Place]) -> str:
  """The module header's ``FileNames`` and ``FileLocations`` tables moved."""
  lines = head.split('\n')
  files: dict[int, str] = {}
  ids: dict[str, int] = {}
  last_name = -1
  section = ''
  for n, line in enumerate(lines):
    if line in ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames'):
      section = line
    elif section == 'FileNames' and (m := _FILE_NAME.match(line)):
      files[int(m.group(1))] = m.group(2)
      ids.setdefault(m.group(2), int(m.group(1)))
      last_name = n
  if last_name < 0:
    return head
  added: list[str] = []

  def file_id(name: str) -> int:
    if name not in ids:
      ids[name] = max(files, default=0) + 1 + len(added)
      escaped = name.replace('\\', '\\\\').replace('"', '\\"')
      added.append(f'{ids[name]} "{escaped}"')
    return ids[name]

  def moved(m: re.Match[str]) -> str:
    was = (files.get(int(m.group(2)), ''), int(m.group(4)))
    if was not in moves:
      return m.group(0)
    name, line = moves[was]
    out = f'{m.group(1)}{file_id(name)}{m.group(3)}{line}'
    if m.group(5):  # the range keeps its length
      out += f'{m.group(5)}{int(m.group(6)) - was[1] + line}'
    return out

  section = ''
  for n, line in enumerate(lines):
    if line in ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames'):
      section = line
    elif section == 'FileLocations':
      lines[n] = _FILE_LOCATION.sub(moved, line, count=1)
  lines[last_name + 1 : last_name + 1] = added
  return '\n'.join(lines)


def _moved_source(m: re.Match[str], moves: dict[Place, Place]) -> str:
  was = (m.group(1), int(m.group(2)))
  if was not in moves:
    return m.group(0)
  name, line = moves[was]
  out = f'source_file="{name}" source_line={line}'
  if m.group(3) is not None:
    out += f' source_end_line={int(m.group(3)) - was[1] + line}'
  return out
