"""Offload presets: what a step keeps in host memory, for ``fsm.suggest``.

Beside the rule presets (how arrays are laid out over the chips) and the
remat policies (what the backward pass recomputes), ``suggest`` can try
where the step keeps things: the optimizer state in host memory between
steps (``pinned_host``, moved to the chips for the update and back), and
named activations (``checkpoint_name``) offloaded by the remat policy
instead of kept or recomputed:

===================== ========= ==================================================
preset                optimizer activations offloaded
===================== ========= ==================================================
none                  device    none
optimizer             host      none
activations           device    ``decoder_layer_input``: each layer's input
optimizer+activations host      ``decoder_layer_input``
===================== ========= ==================================================

``decoder_layer_input`` is the name the built-in models (and MaxText) give
each decoder layer's input; a model of your own names its own values, and an
:class:`OffloadPreset` says which to offload. The build function receives
the preset and lays the step out as it says (``examples.train.builder``
does for the built-in models).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from flax_shardmeta._errors import FitError

LAYER_INPUT = 'decoder_layer_input'
"""The checkpoint name of each decoder layer's input in the built-in models."""


@dataclasses.dataclass(frozen=True)
class OffloadPreset:
  """What a step keeps in host memory.

  Attributes:
    name: e.g. ``'optimizer'``.
    optimizer: the optimizer state lives in host memory between steps.
    names: checkpoint names (``jax.ad_checkpoint.checkpoint_name``) whose
      values the remat policy offloads to host memory for the backward pass.
    description: one line, for tables.

  Example:
    >>> import flax_shardmeta as fsm
    >>> mine = fsm.OffloadPreset('qkv', names=('query_proj', 'key_proj'))
    >>> mine.offloads, mine.names
    (True, ('query_proj', 'key_proj'))
  """

  name: str
  optimizer: bool = False
  names: tuple[str, ...] = ()
  description: str = ''

  def __post_init__(self) -> None:
    names = (self.names,) if isinstance(self.names, str) else tuple(self.names)
    object.__setattr__(self, 'names', names)
    if not self.name or not all(isinstance(n, str) and n for n in names):
      raise FitError(
        f'OffloadPreset({self.name!r}, names={self.names!r}): give a name and '
        'checkpoint names as non-empty strings.'
      )

  @property
  def offloads(self) -> bool:
    """Whether it puts anything in host memory."""
    return self.optimizer or bool(self.names)

  @property
  def text(self) -> str:
    """What it offloads, in words: ``'optimizer state, decoder_layer_input'``."""
    parts = ['optimizer state'] if self.optimizer else []
    return ', '.join(parts + list(self.names)) or 'nothing'


OFFLOAD_PRESETS: dict[str, OffloadPreset] = {
  p.name: p
  for p in (
    OffloadPreset('none', description='everything in device memory'),
    OffloadPreset(
      'optimizer', optimizer=True, description='optimizer state in host memory'
    ),
    OffloadPreset(
      'activations',
      names=(LAYER_INPUT,),
      description="each layer's input offloaded for the backward pass",
    ),
    OffloadPreset(
      'optimizer+activations',
      optimizer=True,
      names=(LAYER_INPUT,),
      description='optimizer state and layer inputs in host memory',
    ),
  )
}
"""The built-in offload presets, by name (see the module doc)."""


def resolve_offload(
  presets: Iterable[str | OffloadPreset],
) -> tuple[OffloadPreset, ...]:
  """Names and presets -> presets; unknown names list the known ones.

  Example:
    >>> [p.text for p in resolve_offload(['none', 'optimizer'])]
    ['nothing', 'optimizer state']
  """
  out = []
  for p in presets:
    if isinstance(p, OffloadPreset):
      out.append(p)
    elif isinstance(p, str) and p in OFFLOAD_PRESETS:
      out.append(OFFLOAD_PRESETS[p])
    else:
      raise FitError(
        f'unknown offload preset {p!r}; choose from {", ".join(OFFLOAD_PRESETS)} '
        'or pass a fsm.OffloadPreset(name, optimizer=..., names=...).'
      )
  names = [p.name for p in out]
  if len(set(names)) != len(names):
    raise FitError(f'offload presets {names} name one preset twice.')
  if not out:
    raise FitError("offload=(): give at least one offload preset ('none').")
  return tuple(out)
