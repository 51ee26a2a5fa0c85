"""One parameter made where it lives, equal to the unsharded one.

Whole when small, window by window when large: ``loops`` (the loops a window
is computed in), ``jaxpr_graph`` (an init's jaxpr as one flat graph),
``windowed`` (a parameter computed for any window of it), ``fill`` (each
device filling its shard from windows) and ``generate`` (an initializer run
where its output lives). The boxes' initializers call ``generate``, so these
may import only the core below the boxes: the vocabulary (``_typing``,
``_specs``), the rules (``_rules``, ``_resolution``), ``_validate`` and
``_placement``. Nothing here imports ``_init``, ``_planning``, ``_devices``,
``_capacity``, ``_hosts``, ``_jit``, the NNX adapter, the examples or the CLI.
"""
