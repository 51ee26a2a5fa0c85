"""Capacity: what a whole training step costs, per chip, before launch.

In rooms by concept:

- ``fit/``: ``fsm.fit``. The step and its arguments (``traced_step``), the
  program compiled for the memory a run will have (``usable``,
  ``compiled``) or read from the cache (``figure_cache``, keyed without
  source lines), extrapolated over layers for deep scanned
  models (``extrapolate``), the GPU verdict (``gpu_verdict``) and ``fit``
  itself (``fit``);
- ``hlo/``: the compiled program's optimised HLO (parsed by ``_programs``,
  which reads every program jax and XLA produce), its data flow (``flow``),
  why each collective is there (``attribution``), its loops, collectives and
  work, a step's summary of them and the roofline;
- ``estimate/``: the estimate where nothing can compile for the target
  (layouts ``propagate``d through the traced step, a ``liveness`` walk, the
  ``unplaced`` values, the ``estimator``);
- ``why/``: the layout changes a step's constraints ask for, and
  ``report.why()``'s text;
- ``suggest/``: rule presets, candidates, the search, how they rank,
  ``fsm.suggest``;
- ``peak/``: what holds a step's peak, row by row (``FitReport.peak()``),
  from the buffer assignment ``_programs`` reads and why's data flow;
- ``report``: ``FitReport`` and its table.

Modules here may import the core, ``_programs``, ``_init``, ``_planning`` and
``_devices`` (chip figures, GPU and TPU topologies); never ``_hosts``,
``_jit``, the NNX adapter (``nnx``), the examples or the CLI, which sit above
(``suggest`` takes a model as a factory, and the built-in models' factories
live in ``examples.train``). The core never imports this layer.
"""
