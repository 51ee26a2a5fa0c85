"""Golden files of a step's layout: ``fsm.snapshot`` (``record``) and
``fsm.snapshot_diff`` (``compare``), with the file's format (``schema``).

A snapshot is what ``fit`` reads of a step, kept as a file to diff in review.
Modules here may import the core, the plans and the capacity layer (``fit``
and its vocabulary), never the audit, the CLI or the examples.
"""
