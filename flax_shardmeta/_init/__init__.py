"""A whole ``init`` run as one program, every parameter created on its shards.

``program_memory`` (XLA's memory analysis of a compiled program) and
``sharded_init``, which makes each parameter with ``_generate``. These
may import the core (the boxes, ``_sharding``, ``_explicit``, ``_jit_key``) and
``_generate``. Nothing here imports ``_planning``, ``_devices``,
``_capacity``, ``_hosts``, ``_jit``, the NNX adapter, the examples or the CLI.
"""
