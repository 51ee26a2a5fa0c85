"""Creating parameter values on their shards, equal to the unsharded ones.

The lower half makes one parameter where it lives, whole when small, window
by window when large: ``loops`` (the loops a window is computed in),
``jaxpr_graph`` (an init's jaxpr as one flat graph), ``windowed`` (a
parameter computed for any window of it), ``fill`` (each device filling its
shard from windows) and ``generate`` (an initializer run where its output
lives). The boxes' initializers call ``generate``, so these may import only
the core below the boxes: the vocabulary (``_typing``, ``_specs``), the
rules (``_rules``, ``_resolution``), ``_validate`` and ``_placement``.

The upper half runs a whole ``init`` as one program: ``program_memory``
(XLA's memory analysis of a compiled program) and ``sharded_init``. They may
also import the core's shardings (``_sharding``), ``_explicit`` and
``_jit_key``. Nothing here imports ``_planning``, ``_capacity``, ``_hosts``,
``_jit``, the NNX adapter, the examples or the CLI.
"""
