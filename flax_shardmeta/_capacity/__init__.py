"""Capacity: what a whole training step costs, per chip, before launch.

``fit`` compiles a step for its mesh and reads XLA's own figures (``compiled``;
``extrapolate`` for deep scanned models), or estimates them where nothing can
compile for the target (``estimate``, over ``propagate``d layouts and a
``liveness`` walk). The compiled program's HLO text is read in one place
(``hlo_text``), then its loops, collectives and work (``hlo_loops``,
``hlo_collectives``, ``hlo_work``, summed up by ``hlo``). Beside them: the
roofline, chip figures, TPU topologies and meshes over devices (``topology``),
byte counts of abstract arrays (``arrays``), rule presets, the fit cache, the
step's arguments and their layouts (``step``), the report with its table, and
``suggest`` ranking meshes, presets and remat (its ``candidate``s).

Modules here may import the core, ``_init`` and ``_planning``; never
``_hosts``, ``_jit``, the NNX adapter (``nnx``), the examples or the CLI,
which sit above (``_hosts.mesh.make_mesh`` lays its meshes out with
``topology.device_mesh``; ``suggest`` takes a model as a factory, and the
built-in models' factories live in ``examples.train``). The core never
imports this layer.
"""
