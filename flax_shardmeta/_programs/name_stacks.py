"""What XLA keeps of the jax program on each instruction: the name stack and
the user's source line, read the same way on every backend.

jax writes an instruction's name stack (``metadata={op_name="..."}``) as
parts joined by ``'/'``, then the primitive:

- module scopes and named scopes: ``Model``, ``layers``, ``attn``; jnp.einsum
  names its spec, ``bse,ehd->bshd``;
- calls of jitted functions, ``jit(step)`` (the program itself leads);
- transformations, wrapping the scope they were entered in:
  ``transpose(jvp(Model))``, or ``jvp()`` when none was;
- jax's own machinery: ``while/body``, ``closed_call`` (``eval_jaxpr`` since
  jax 0.12), ``checkpoint/rematted_computation``, ``cond/branch_1_fun``...

XLA adds three forms. Where it merges instructions (the CPU and GPU
compilers combine collectives and fuse siblings) the name is the longest
prefix the merged names share, then each one's rest between parentheses,
separated by ``':'``: ``.../layers/(attn/dot_general:mlp_norm/mul)``; '/'
then also appears inside parentheses. Where two operations were folded into
one, their whole names are joined by ``';'``. Instructions XLA makes itself
carry their own name (``broadcast.12``). The text escapes quotes and
backslashes in names (``data[\\'tokens\\']``) as C does.

:func:`scope_of` reads the module scope, the same for the same jax operation
on CPU, TPU and GPU; :func:`primitive_of` the primitive.
"""

from __future__ import annotations

import functools
import re

import jax

# Parts that are jax's machinery (control flow, calls, rematerialisation,
# transformations written as plain parts), never a module scope.
_MACHINERY = frozenset(
  'jit pjit jvp transpose vmap pmap xla_pmap xla_call remat remat2 checkpoint '
  'rematted_computation while body body_pred cond scan cond_fun body_fun '
  'closed_call core_call eval_jaxpr named_call custom_vjp_call '
  'custom_vjp_call_jaxpr custom_jvp_call custom_lin shard_map program_order'.split()
)
# Wrappers whose argument is a jitted function's name, not a scope.
_CALLS = frozenset(('jit', 'pjit', 'pmap', 'xla_pmap', 'xla_call'))
# What older jax (0.4) wrapped in jit(...): the lowered module, shard_map's body.
_JAX_FUNCTIONS = frozenset(('main', 'shmap_body'))
_BRANCH = re.compile(r'branch_\d+_fun')
# jnp.einsum's spec scopes, and anything else that cannot be a module's name.
_NOT_A_NAME = re.compile(r'->|[,:()\[\]{}]')
# Older jax wrote a primitive's parameters: 'all_to_all[axis_name=('z',) ...]'.
_PRIMITIVE = re.compile(r'([A-Za-z_][\w\-]*)(?:\[\w+=.*\])?', re.S)
_OPEN, _CLOSE = '([{', ')]}'


def _split(text: str, sep: str) -> list[str] | None:
  """``text`` split at ``sep`` outside brackets; None when they do not balance."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch in _OPEN:
      depth += 1
    elif ch in _CLOSE:
      depth -= 1
      if depth < 0:
        return None
    elif ch == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  if depth:
    return None
  return [*parts, text[start:]]


def bracket_end(text: str, open_: str = _OPEN, close: str = _CLOSE) -> int | None:
  """Where the first bracket ``text`` opens closes (None: it never does);
  the one scan of nested brackets, for name stacks and HLO text alike.

  Example:
    >>> bracket_end('(a, (b)) rest'), bracket_end('f(x') is None
    (7, True)
  """
  depth = 0
  for i, ch in enumerate(text):
    if ch in open_:
      depth += 1
    elif ch in close:
      depth -= 1
      if depth == 0:
        return i
  return None


def _closes_at_end(text: str) -> bool:
  """Whether the first bracket ``text`` opens closes at its last character."""
  return bracket_end(text) == len(text) - 1


def name_stack(op_name: str) -> list[str]:
  """The parts of a name stack: split at '/' outside parentheses and
  brackets (older jax wrote a primitive's parameters, ``all_to_all[...]``).

  A name whose parentheses do not balance (cut short) splits at every '/'.

  Example:
    >>> name_stack('jit(step)/transpose(jvp(Model))/layers/(attn/dot_general:mul)')
    ['jit(step)', 'transpose(jvp(Model))', 'layers', '(attn/dot_general:mul)']
  """
  if not op_name:
    return []
  parts = _split(op_name, '/')
  return op_name.split('/') if parts is None else parts


def alternatives(part: str) -> list[str] | None:
  """The names XLA merged into one part, ``'(a/mul:b/add)'`` ->
  ``['a/mul', 'b/add']``; None for any other part.

  Example:
    >>> alternatives('(jvp(jit(_one_hot))/eq:dot_general)'), alternatives('jvp(M)')
    (['jvp(jit(_one_hot))/eq', 'dot_general'], None)
  """
  if not part.startswith('(') or not _closes_at_end(part):
    return None
  return _split(part[1:-1], ':') or None


def _unwrap(part: str) -> tuple[str, str]:
  """``'transpose(jvp(Model))'`` -> ``('', 'Model')``; ``'jvp(jit(f))'`` ->
  ``('jit', 'f')``: the transformations taken off, then the call wrapper
  (``''`` when none) and what it wraps."""
  while (m := re.fullmatch(r'([\w\-]+)\((.*)\)', part)) and _closes_at_end(
    part[m.start(2) - 1 :]
  ):
    if m.group(1) in _CALLS:
      return m.group(1), m.group(2)
    part = m.group(2)
  return '', part


@functools.cache
def _jax_helper(name: str) -> bool:
  """Whether a jitted function's name is jax's own (``_take``, ``_one_hot``,
  ``take_along_axis``, ``dynamic_index_in_dim``...), not the user's."""
  return (
    name.startswith('_')
    or name in _JAX_FUNCTIONS
    or any(callable(getattr(m, name, None)) for m in (jax.numpy, jax.lax, jax.nn))
  )


def merged_names(op_name: str) -> list[str]:
  """The names XLA merged into ``op_name``, each whole; ``[op_name]`` when
  it merged none.

  Example:
    >>> merged_names('jit(f)/jvp(M)/(attn/dot_general:mlp/jit(_take)/gather)')
    ['jit(f)/jvp(M)/attn/dot_general', 'jit(f)/jvp(M)/mlp/jit(_take)/gather']
    >>> merged_names('jit(f)/mul;jit(f)/broadcast_in_dim')
    ['jit(f)/mul', 'jit(f)/broadcast_in_dim']
  """
  names = _split(op_name, ';') or [op_name]
  if len(names) > 1:  # whole names: two operations folded into one
    return [merged for name in names for merged in merged_names(name)]
  parts = name_stack(op_name)
  for i, part in enumerate(parts):
    merged = alternatives(part)
    if merged is not None:
      return [
        name
        for alternative in merged
        for name in merged_names('/'.join([*parts[:i], alternative, *parts[i + 1 :]]))
      ]
  return [op_name]


def _scopes(op_name: str) -> list[str]:
  """The module scopes of a name stack XLA merged nothing into, in order."""
  parts = name_stack(op_name)[:-1]  # the primitive
  out: list[str] = []
  for i, part in enumerate(parts):
    wrapper, core = _unwrap(part)
    if wrapper:  # a jitted function: the user's is a scope, jax's is not
      if core and i > 0 and not _jax_helper(core):  # the first: the program
        out.append(core)
    elif core and core not in _MACHINERY and not _BRANCH.fullmatch(core):
      if not _NOT_A_NAME.search(core):
        out.append(core)
  return out


def scope_of(op_name: str) -> str:
  """The module scope of a name stack: transformations unwrapped; jax's
  machinery, its own jitted helpers, einsum specs, the program's leading
  ``jit(...)`` and the primitive dropped. Of names XLA merged, the scope
  they share (:func:`merged_names` gives each). The same jax operation reads
  the same on CPU, TPU and GPU.

  Example:
    >>> scope_of('jit(step)/transpose(jvp(Model))/layers/while/body/attn/dot_general')
    'Model/layers/attn'
    >>> scope_of('jit(step)/jvp(Llama)/layers/bse,ehd->bshd/dot_general')
    'Llama/layers'
    >>> scope_of('jit(step)/jvp(M)/layers/(attn/dot_general:attn/jit(_one_hot)/eq)')
    'M/layers/attn'
  """
  scopes = [_scopes(name) for name in merged_names(op_name)]
  shared: list[str] = []
  for names in zip(*scopes):
    if len(set(names)) != 1:
      break
    shared.append(names[0])
  return '/'.join(shared)


def primitive_of(op_name: str) -> str:
  """The primitive ending a name stack (``'dot_general'``, ``'all_gather'``);
  of names XLA merged, the first one's; ``''`` when the name ends in none
  (an argument's path).

  Example:
    >>> primitive_of('jit(step)/jvp(M)/(jvp(jit(_one_hot))/eq:dot_general)')
    'eq'
    >>> primitive_of('jit(step)/jvp(M)/sharding_constraint'), primitive_of('copy.3')
    ('sharding_constraint', 'copy')
  """
  parts = name_stack(merged_names(op_name)[0])
  last = re.sub(r'\.\d+$', '', parts[-1]) if parts else ''  # XLA's: 'copy.3'
  m = _PRIMITIVE.fullmatch(last)
  return m.group(1) if m else ''


# Metadata fields
# ------------------------------------------------------------------------------

_METADATA = re.compile(r'(?:^|[\s,])metadata=\{')
# A field's value: quoted (escapes inside), a list in braces, or a word.
_FIELD = re.compile(r'\s*(\w+)=("(?:[^"\\]|\\.)*"|\{[^}]*\}|[^\s}]*)', re.S)
_ESCAPE = re.compile(r'\\(?:([0-7]{1,3})|x([0-9a-fA-F]{1,2})|(.))', re.S)
_SIMPLE_ESCAPES = {'n': '\n', 'r': '\r', 't': '\t'}


def unescape(text: str) -> str:
  r"""A quoted value of the HLO text as it was before C escaping (XLA escapes
  quotes, backslashes, and bytes outside printable ASCII, in octal).

  Example:
    >>> unescape(r"data[\'tokens\']"), unescape(r'caf\303\251')
    ("data['tokens']", 'café')
  """
  if '\\' not in text:
    return text
  out, at = bytearray(), 0
  for m in _ESCAPE.finditer(text):
    out += text[at : m.start()].encode()
    if m.group(1):
      out.append(int(m.group(1), 8) & 0xFF)
    elif m.group(2):
      out.append(int(m.group(2), 16))
    else:
      out += _SIMPLE_ESCAPES.get(m.group(3), m.group(3)).encode()
    at = m.end()
  out += text[at:].encode()
  return out.decode('utf-8', 'replace')


def metadata(attributes: str) -> dict[str, str]:
  r"""The fields of an instruction's ``metadata={...}``, quoted values
  unescaped.

  Example:
    >>> metadata('to_apply=%add, metadata={op_name="f/a\\"}b" source_line=3}')
    {'op_name': 'f/a"}b', 'source_line': '3'}
  """
  m = _METADATA.search(attributes)
  if m is None:
    return {}
  out: dict[str, str] = {}
  at = m.end()
  while (field := _FIELD.match(attributes, at)) is not None and field.end() > at:
    value = field.group(2)
    if value.startswith('"'):
      value = unescape(value[1:-1])
    out[field.group(1)] = value
    at = field.end()
  return out


def read_op_name(attributes: str) -> str:
  """The jax name stack of an instruction's attributes, or ``''``.

  Example:
    >>> read_op_name(r'kind=kLoop, metadata={op_type="mul" op_name="jit(f)/mul"}')
    'jit(f)/mul'
  """
  return metadata(attributes).get('op_name', '')


def read_frame(attributes: str) -> int | str | None:
  """Where the user's code made an instruction: a stack frame id (newer XLA)
  or ``'file:line'`` (older), or None.

  Example:
    >>> read_frame('metadata={op_name="f" source_file="m.py" source_line=7}')
    'm.py:7'
  """
  fields = metadata(attributes)
  if fields.get('stack_frame_id', '').isdigit():
    return int(fields['stack_frame_id'])
  if 'source_file' in fields and fields.get('source_line', '').isdigit():
    return f'{fields["source_file"]}:{fields["source_line"]}'
  return None


_FILE_NAME = re.compile(r'(\d+) "(.*)"$')
_FILE_LOCATION = re.compile(
  r'(\d+) \{file_name_id=(\d+) function_name_id=\d+ line=(\d+)'
)
_STACK_FRAME = re.compile(r'(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)')


def stack_frames(text: str) -> dict[int, list[tuple[str, int]]]:
  r"""Each stack frame id of a module's text -> its ``(file, line)`` chain,
  innermost first (the tables XLA prints after the module header).

  XLA prints a frame's ``parent_frame_id`` one above its parent's id (a
  frame without a parent prints 1): frame 5 with ``parent_frame_id=5`` was
  called from frame 4. Read as the parent's own id, every chain would stop
  at its innermost frame, a library's (``flax/linen/linear.py``), and the
  user's line that called the layer would be lost.

  Example:
    >>> text = '\n'.join([
    ...   'FileNames', '1 "model.py"', '2 "flax/linen/linear.py"', '',
    ...   'FileLocations',
    ...   '1 {file_name_id=1 function_name_id=1 line=7 end_line=7}',
    ...   '2 {file_name_id=1 function_name_id=1 line=9 end_line=9}',
    ...   '3 {file_name_id=2 function_name_id=2 line=287 end_line=287}', '',
    ...   'StackFrames', '1 {file_location_id=1 parent_frame_id=1}',
    ...   '2 {file_location_id=2 parent_frame_id=2}',
    ...   '3 {file_location_id=3 parent_frame_id=3}'])
    >>> stack_frames(text)[3]
    [('flax/linen/linear.py', 287), ('model.py', 9), ('model.py', 7)]
  """
  files: dict[int, str] = {}
  places: dict[int, tuple[int, int]] = {}
  parents: dict[int, tuple[int, int]] = {}
  section = ''
  for line in text.splitlines():
    if line in ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames'):
      section = line
      continue
    if section == 'FileNames' and (m := _FILE_NAME.match(line)):
      files[int(m.group(1))] = unescape(m.group(2))
    elif section == 'FileLocations' and (m := _FILE_LOCATION.match(line)):
      places[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    elif section == 'StackFrames' and (m := _STACK_FRAME.match(line)):
      parents[int(m.group(1))] = (int(m.group(2)), int(m.group(3)) - 1)
    elif line.startswith(('%', 'ENTRY')):
      section = ''
  out: dict[int, list[tuple[str, int]]] = {}
  for frame in parents:
    chain, seen, at = [], set(), frame
    while at in parents and at not in seen:  # a root frame's parent is 0
      seen.add(at)
      location, parent = parents[at]
      file_id, line_no = places.get(location, (0, 0))
      chain.append((files.get(file_id, '?'), line_no))
      at = parent
    out[frame] = chain
  return out
