"""What holds the peak: a step's memory per chip split into what holds it.

``rows`` holds the record (``PeakRow``, ``PeakMemory``, ``PeakDiff``) and its
text; ``values`` tells what each value alive at the peak is, from why's
reading of the program's data flow (``hlo.attribution``); ``holders``
builds the record from a compiled program's figures and its buffer
assignment (``_programs.buffers``), or from an estimate.

Modules here may import the core, ``_programs`` and the ``_capacity`` modules
below ``report`` (the vocabulary, ``hlo``, ``why``); ``report`` and ``fit``
import them.
"""
