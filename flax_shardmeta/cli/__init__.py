"""Command-line interface: ``flax-shardmeta plan``, ``fit``, ``suggest``, ``demo``,
``snapshot`` and ``diff``.

One module per command (``plan``, ``fit``, ``suggest``, ``demo``, ``snapshot``,
``diff``), each adding its options to the parser ``main`` builds. What they
share: their options and the one usage error (``options``), the checks of
their arguments (``checks``), the rules they load (``rule_files``), how the
process starts jax (``process``), the ``--module PKG.MOD:FACTORY`` contract
they all follow (``factory``) and the training step ``fit`` and ``snapshot``
build (``step``). Nothing here imports jax or flax at
module level: ``--help`` and argument errors answer before either is loaded.

This package may import any other part of flax_shardmeta; nothing imports it.
"""

from flax_shardmeta.cli.main import main

__all__ = ['main']
