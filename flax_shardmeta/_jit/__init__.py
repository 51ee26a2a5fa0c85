"""``fsm.jit``: ``jax.jit`` with a mesh, logical rules and annotated trees.

``jit`` resolves logical in/out shardings and enters the mesh and the rules
wherever it traces, lowers or runs, keeping each rule set in traces of its
own; ``graph`` lets NNX graph nodes be arguments, their updates written back.
How the rules enter jax's own cache key (for plain ``jax.jit``) is the
core's ``_jit_key``. Modules here may import the core and ``_init``; never
``_planning``, ``_capacity``, ``_hosts``, the NNX adapter, the examples or
the CLI.
"""
