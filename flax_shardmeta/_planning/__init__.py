"""Planning: the whole layout of a tree before anything runs.

Whole-tree plans and their text and JSON forms, lowest first: ``explain`` (why
each dimension of an entry has its mesh axes), ``format`` (the plan as a
table), ``entry`` (one array's planned layout), ``plan`` (``fsm.plan`` and
``ShardingPlan``) and ``verify`` (arrays checked against a plan). Modules here
build on the core (rules, annotations, shardings) and may import any of it,
but never the capacity layer (``_capacity``), the host modules (``_hosts``),
``_jit``, the NNX adapter, the examples or the CLI.
"""
