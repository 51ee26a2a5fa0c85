"""``fsm.fit``: the step and its arguments (``traced_step``), compiling it
for the memory a run will have (``usable``, ``compiled``), the cache of
compiled figures (``figure_cache``, keyed without source lines: the
program's lines are moved by ``_programs.source_map``), deep scanned models
(``extrapolate``), the GPU verdict (``gpu_verdict``), what a step could
donate (``donation``) and ``fit`` itself (``fit``).
"""
