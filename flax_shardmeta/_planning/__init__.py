"""Planning: what a layout costs before anything runs.

Whole-tree plans (``plan``: specs, shard shapes and bytes per device, problems,
explanations) and their text and JSON forms. Modules here build on the core
(rules, annotations, shardings) and may import any of it, but never the host
modules (``_hosts``), the NNX adapter, the examples or the CLI.
"""
