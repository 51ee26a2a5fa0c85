"""Host-side chores: meshes over processes, data and transfers, launches.

Everything that deals with real devices and processes: ``make_mesh``, per-host
data layouts, moving host values onto shards and back, and local
multi-process launches. These modules may import the core,
``_init``, ``_planning`` and ``_capacity`` (the topologies behind
``make_mesh``), never the NNX adapter, the examples or the CLI.
"""
