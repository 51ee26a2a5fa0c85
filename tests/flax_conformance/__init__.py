"""Shims that run flax's own sharding-metadata tests against flax_shardmeta.

Each ``shim_*`` module stands for one flax module: it re-exports everything of
that module, with flax's sharding-metadata names replaced by flax_shardmeta's.
``tests/test_flax_conformance.py`` rewrites the import lines of flax's test
files to import these instead and runs them; ``plugin`` is the pytest plugin
those runs load first.
"""
