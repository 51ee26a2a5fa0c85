"""Host-side chores: meshes over processes, data and transfers, jit, launches.

Everything that deals with real devices and processes: ``make_mesh``, per-host
data layouts, moving host values onto shards and back, ``fsm.jit`` with its
mesh and rules, orbax restore targets and local multi-process launches. These
modules may import the core and ``_planning``, never the NNX adapter, the
examples or the CLI.
"""
