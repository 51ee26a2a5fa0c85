"""The programs jax traces and XLA compiles, read in one place.

``memory`` (XLA's memory analysis of a compiled program, one record with a
JSON form: nothing else calls ``memory_analysis()``), ``hlo_text`` (the
optimised HLO text parsed into computations and instructions, with
``name_stacks``: XLA's op metadata, jax's name stacks and the user's frames),
``compiled_text`` (a compiled program's text, checked against XLA's module
objects, and the counts read off program text), ``source_map`` (a lowered
program's source locations, so a cached program's lines are moved to the
caller's), ``jaxprs`` (the version-aware jaxpr walker: calls inlined,
sub-programs, scan parameters), ``hosts`` (the hosts of a device set) and
``buffers`` (XLA's buffer assignment of a compiled program, from its dump:
the values alive at the peak of its heap).

Modules here may import only the lowest core modules (``_typing``,
``_specs``, ``_caches``, ``_frames``, ``_arrays``, ``_views``, ``_problem``,
``_errors``, ``_units``), jax and numpy: the parameter generator, the
capacity layer, the audit, restores and sharded init all read programs
through them.
"""
