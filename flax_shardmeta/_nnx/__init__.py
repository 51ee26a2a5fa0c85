"""The NNX adapter's implementation; ``flax_shardmeta.nnx`` is its public face.

``rules`` holds :class:`~flax_shardmeta._nnx.rules.FsmRules`, the view of
fsm's resolution that flax's own NNX functions read from a Variable's
metadata. The Linen boxes hand it to ``nnx.bridge``, so it sits below
``_boxes`` and may import only the vocabulary and the rules, and never
``flax.nnx``: Linen users do not load it. The other modules (``metadata``,
``reading``, ``writing``, ``construct``) may import the core, ``_init`` and
``flax.nnx``, never ``_planning``, ``_capacity``, ``_hosts``, ``_jit``, the
public ``nnx`` module, the examples or the CLI.
"""
