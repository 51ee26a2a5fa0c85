"""Devices: what the chips are and how they are laid out, below both the
hosts (``_hosts``) and the capacity layer (``_capacity``).

Chip figures (``chips``), GPU clusters described to XLA's compiler (``gpu``,
its target descriptions in ``gpu_targets/``) and TPU topologies from libtpu
with meshes over their devices (``topology``), and simulated CPU devices
(``simulated``: the one place ``XLA_FLAGS``' device count is set). Modules
here may import only the core's errors; ``_hosts`` (meshes over processes) and
``_capacity`` (a step's cost) build on them.
"""
