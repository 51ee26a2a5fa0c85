"""How the ``flax-shardmeta`` process starts jax: on this machine's CPU, with the
accelerator plugins' start-up lines about hardware it does not have closed off
(``fsm.cpu_only_jax``).

Nothing here imports jax.
"""

from __future__ import annotations


def local_jax_on_cpu() -> None:
  """Every command runs on this machine's CPU (the demo's simulated devices) or
  compiles for a described pod: jax starts that way, before anything imports
  it, so that the plugins' start-up lines about a missing TPU or GPU never
  print (``fsm.cpu_only_jax``)."""
  import flax_shardmeta as fsm

  fsm.cpu_only_jax()
