"""The NNX adapter's implementation; ``flax_shardmeta.nnx`` is its public face.

:class:`~flax_shardmeta._flax_adapter.FsmRules`, the view of fsm's resolution
that flax's own NNX functions read from a Variable's metadata, lives in the
core (``_flax_adapter``), where the Linen boxes (which hand it to
``nnx.bridge``) and this adapter both take it, neither importing the other.
The modules here (``metadata``, ``reading``, ``writing``, ``construct``)
may import the core, ``_init`` and ``flax.nnx``, never ``_planning``,
``_devices``, ``_capacity``, ``_hosts``, ``_jit``, the public ``nnx`` module,
the examples or the CLI.
"""
