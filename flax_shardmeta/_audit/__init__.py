"""The Explicit-axes audit: a step written for Auto axes, traced on the same
mesh with Explicit ones.

``intercept`` (the user's step traced on Explicit axes, going on past each
refusal with its fix), ``replay`` (the Auto program replayed to read XLA's
layout of chosen values), ``rewrite`` (a statement with its refused calls
fixed, as code to paste), ``sites`` (refusals at the user's lines, with the
code to write), ``notes`` (size-1 axes, rules naming one axis twice, opaque
calls), ``figures`` (a compiled program's collectives, annotations,
transposes, memory), ``tracing`` (the step traced under each axis type, the
rounds and the fixed step), ``audit_text`` (the report as text) and
``audit_explicit`` (``fsm.audit_explicit`` and its ``ExplicitAudit``).
Modules here may import the core, the plans and the capacity layer's HLO
reading, never the CLI or the examples.
"""
