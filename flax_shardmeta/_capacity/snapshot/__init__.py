"""``fsm.snapshot`` (``record``) and ``fsm.snapshot_diff`` (``compare``): a
step's layout as a golden file, and the differences between two.
"""
