"""Content checksums of a checkpoint that hold on any mesh.

A leaf's checksum is a sum, modulo 2**32 in each of two lanes, over its
elements of a hash of (the element's global index, its bits). Addition does
not care how the array is split: each process sums the shards it holds (one
replica of each), the processes' sums add up to the whole array's, and a
checkpoint saved on one mesh is checked on another. The hashing runs on
device, one small program per shard shape; only two words per shard come
back to the host.

``fsm.save`` writes the checksums as JSON beside orbax's metadata;
``fsm.restore`` checks every leaf it reads without a cast against them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flax_shardmeta._errors import CheckpointDamagedError, ShardingProblem

FILE = '_FSM_CHECKSUMS.json'
"""The file ``fsm.save`` writes in the checkpoint's folder."""
ALGORITHM = 'fsm-element-hash-v1'
"""Two lanes of ``sum(fmix32(hash(global index), element bits)) mod 2**32``."""
_SEEDS = (0x9E3779B9, 0x7F4A7C15)
_ODD = np.uint32(0x9E3779B1)


def _fmix(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finalizer: every input bit changes half the output's."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


@jax.jit
def _shard_sums(data: jax.Array, start: jax.Array) -> jax.Array:
  """Both lanes' sums over a shard ``data`` whose first element is at global
  index ``start`` (one program: the words are never all held at once)."""
  words = _words(data)
  shape = words.shape[:-1]
  lanes = []
  for seed in _SEEDS:
    h = jnp.full(shape, np.uint32(seed), jnp.uint32)
    for d in range(len(shape)):
      index = lax.broadcasted_iota(jnp.uint32, shape, d) + start[d]
      h = _fmix(h ^ (index * _ODD + np.uint32(d)))
    for k in range(words.shape[-1]):
      h = _fmix(h ^ words[..., k])
    lanes.append(jnp.sum(h, dtype=jnp.uint32))
  return jnp.stack(lanes)


_UNSIGNED = {2: jnp.uint2, 4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}


def _words(x: jax.Array) -> jax.Array:
  """``x``'s bits as uint32 words, one trailing axis of them per element."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)[..., None]
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    parts = [_words(jnp.real(x)), _words(jnp.imag(x))]
    return jnp.concatenate(parts, axis=-1)
  bits = jax.dtypes.itemsize_bits(x.dtype)
  if bits == 64:
    return lax.bitcast_convert_type(x, jnp.uint32)
  return lax.bitcast_convert_type(x, _UNSIGNED[bits]).astype(jnp.uint32)[..., None]


def in_device_memory(sharding: Any) -> bool:
  """Whether arrays of ``sharding`` are in device memory, where they are
  hashed (a host-memory array would need a device copy of the whole leaf)."""
  return getattr(sharding, 'memory_kind', None) in (None, 'device')


def hashable(dtype: Any) -> bool:
  """Whether leaves of ``dtype`` get a checksum."""
  dt = np.dtype(dtype)
  if dt == np.bool_ or jnp.issubdtype(dt, jnp.complexfloating):
    return True
  return dt.kind in 'iuf' or jax.dtypes.itemsize_bits(dt) in (*_UNSIGNED, 64)


def _local_sums(value: jax.Array) -> np.ndarray:
  """Both lanes' sums over the shards this process holds (replica 0 only)."""
  parts = []
  for shard in value.addressable_shards:
    if shard.replica_id != 0:
      continue  # each shard counted once, by the device holding replica 0
    start = [s.start or 0 for s in shard.index] if shard.index else []
    offset = jax.device_put(np.asarray(start, np.uint32), shard.device)
    parts.append(_shard_sums(shard.data, offset))
  out = np.zeros(2, dtype=np.uint64)
  for p in parts:  # the programs run concurrently; sums come back at the end
    out += np.asarray(p, dtype=np.uint64)
  return out % (1 << 32)


def checksums(values: dict[str, jax.Array]) -> dict[str, str]:
  """Per name, the checksum of the whole array (16 hex digits).

  A collective across processes when there are several: every process calls
  it with the same names, each summing the shards it holds.
  """
  names = list(values)
  sums = np.zeros((len(names), 2), dtype=np.uint64)
  for i, name in enumerate(names):
    sums[i] = _local_sums(values[name])
  if jax.process_count() > 1 and names:
    from jax.experimental import multihost_utils

    every = multihost_utils.process_allgather(sums.astype(np.uint32))
    sums = np.asarray(every, dtype=np.uint64).reshape(-1, len(names), 2).sum(axis=0)
  sums %= 1 << 32
  return {n: f'{int(s[1]):08x}{int(s[0]):08x}' for n, s in zip(names, sums)}


def write(directory: str, leaves: dict[str, Any], sums: dict[str, str]) -> str:
  """Writes the checksums file into ``directory``; its path."""
  record = {
    'algorithm': ALGORITHM,
    'leaves': {
      name: {
        'shape': list(leaves[name].shape),
        'dtype': str(leaves[name].dtype),
        'checksum': sums[name],
      }
      for name in sums
    },
  }
  where = os.path.join(directory, FILE)
  tmp = f'{where}.tmp'
  with open(tmp, 'w') as f:
    json.dump(record, f, indent=1, sort_keys=True)
  os.replace(tmp, where)  # a reader never sees half a file
  return where


def read(directory: str) -> dict[str, Any] | None:
  """The checksums file of the checkpoint at ``directory`` (None: none)."""
  where = os.path.join(directory, FILE)
  if not os.path.exists(where):
    return None
  try:
    with open(where) as f:
      record = json.load(f)
  except (OSError, ValueError) as e:
    _corrupt(where, f'{type(e).__name__}: {e}', e)
  ok = isinstance(record, dict) and isinstance(record.get('algorithm'), str)
  leaves = record.get('leaves') if isinstance(record, dict) else None
  if not ok or not isinstance(leaves, dict):
    _corrupt(where, 'it lacks the "algorithm" text or the "leaves" mapping', None)
  bad = [n for n, v in leaves.items() if not isinstance(v, dict) or 'checksum' not in v]
  if bad:
    _corrupt(where, f'leaf {bad[0]} has no "checksum"', None)
  return record


def _corrupt(where: str, why: str, cause: BaseException | None) -> NoReturn:
  raise CheckpointDamagedError(
    f'{where}: the checksums file fsm.save wrote is corrupt ({why}); the '
    'checkpoint cannot be checked. Restore from another checkpoint, or delete '
    'the file to restore unchecked'
  ) from cause


@dataclasses.dataclass(frozen=True)
class ContentCheck:
  """Which leaves a restore checks against the checksums ``fsm.save`` wrote.

  Attributes:
    algorithm: the checkpoint's checksum algorithm (None: it has none).
    checked: paths whose values are checked after they are read.
    unchecked: (path, why) of the leaves that are not.
    on_paper: the plan read no checkpoint (nothing is restored from it).
  """

  algorithm: str | None
  checked: tuple[str, ...]
  unchecked: tuple[tuple[str, str], ...]
  on_paper: bool = False

  def __str__(self) -> str:
    if self.on_paper:
      return 'content: not checked (planned on paper, no checkpoint read)'
    if self.algorithm is None:
      return (
        'content: not checked: the checkpoint has no checksums (it was not '
        'written by fsm.save), so damaged data would restore as other values'
      )
    n = len(self.checked)
    text = (
      f"content: {n} array{'' if n == 1 else 's'} checked against fsm.save's checksums"
    )
    lines = [text + (f', {len(self.unchecked)} not:' if self.unchecked else '')]
    lines += [f'  {path}: {why}' for path, why in self.unchecked]
    return '\n'.join(lines)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready form."""
    return {
      'algorithm': self.algorithm,
      'checked': list(self.checked),
      'unchecked': [{'path': p, 'why': w} for p, w in self.unchecked],
      'on_paper': self.on_paper,
    }


def content_check(plan: Any) -> ContentCheck:
  """What a restore of ``plan`` (a ``RestorePlan``) checks, leaf by leaf."""
  ckpt = plan.checkpoint
  if ckpt is None:
    return ContentCheck(None, (), (), on_paper=True)
  record = ckpt.checksums
  if record is None:
    return ContentCheck(None, (), ())
  checked, unchecked = [], []
  for e in plan.entries:
    why = _unchecked(record, ckpt.keys.get(e.path), e)
    if why:
      unchecked.append((e.path, why))
    else:
      checked.append(e.path)
  return ContentCheck(record['algorithm'], tuple(checked), tuple(unchecked))


def _unchecked(record: dict[str, Any], keys: Any, e: Any) -> str:
  """Why the leaf of entry ``e`` is not checked ('' if it is)."""
  if record['algorithm'] != ALGORITHM:
    return f'checksums of another algorithm ({record["algorithm"]!r})'
  saved = record['leaves'].get('/'.join(keys)) if keys is not None else None
  if saved is None:
    return 'no checksum recorded for it'
  if e.memory_kind not in (None, 'device'):
    return f'restored into {e.memory_kind} memory: checked only in device memory'
  if e.saved_dtype is not None and np.dtype(e.saved_dtype) != np.dtype(e.dtype):
    return (
      f'restored as {e.dtype} from {e.saved_dtype}: its checksum is of the saved '
      f'{e.saved_dtype} bits, so it is checked only when restored as saved'
    )
  return ''


def verify(plan: Any, restored: dict[str, jax.Array]) -> None:
  """Checks the leaves just read against the checkpoint's checksums.

  A collective across processes: every process calls it after each group.
  Raises ``CheckpointDamagedError`` naming each leaf whose values differ.
  """
  ckpt = plan.checkpoint
  record = None if ckpt is None else ckpt.checksums
  if ckpt is None or record is None:
    return
  check = set(content_check(plan).checked)
  names = {p: '/'.join(ckpt.keys[p]) for p in restored if p in check}
  found = checksums({p: restored[p] for p in names})
  bad = []
  for path, got in found.items():
    want = record['leaves'][names[path]]['checksum']
    if got != want:
      e = plan.entry(path)
      bad.append(
        ShardingProblem(
          path,
          e.shape,
          None,
          e.spec,
          f'its values differ from what fsm.save wrote (checksum {got}, '
          f"saved {want}): the checkpoint's data were damaged or changed "
          'after it was saved',
          'restore from another checkpoint (an earlier step, or a copy)',
        )  # fmt: skip
      )
  if bad:
    n = len(bad)
    head = '1 leaf was' if n == 1 else f'{n} leaves were'
    raise CheckpointDamagedError(
      f'{head} restored with other values than saved, in {ckpt.directory}:\n'
      + '\n'.join(f'  - {p}' for p in bad),
      bad,
    )
