"""Example models for Linen and NNX, used by the demo, the CLI and the tests.

``examples.linen`` and ``examples.nnx`` hold the Flax scale-up notebook's MLP
and Llama-3 with the same shapes and logical names in both front ends;
``examples.demo`` is the main job that ``flax-shardmeta demo`` runs.
"""
