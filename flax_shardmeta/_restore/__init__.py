"""Restore plans: a checkpoint saved on one mesh, restored onto another.

``chunks`` (which saved chunks each host reads, as index arithmetic on shard
grids), ``checkpoint`` (a saved layout read from an orbax checkpoint's
metadata) and ``reading_plan`` (``fsm.restore_plan`` and ``RestorePlan``).
Modules here may import the core (rules, annotations, shardings), the plans of
``_planning`` and the device figures of ``_devices``, but never the capacity
layer (``_capacity``), the host modules (``_hosts``), ``_jit``, the NNX
adapter, the examples or the CLI.
"""
