"""A whole ``init`` run as one program, every parameter created on its shards.

``sharded_init``, which makes each parameter with ``_generate`` and reads
the init program's memory through ``_programs``. These may import the core
(the boxes, ``_sharding``, ``_explicit``, ``_jit_key``), ``_programs`` and
``_generate``. Nothing here imports ``_planning``, ``_devices``,
``_capacity``, ``_hosts``, ``_jit``, the NNX adapter, the examples or the CLI.
"""
