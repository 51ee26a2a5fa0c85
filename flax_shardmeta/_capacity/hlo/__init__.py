"""A compiled program's optimised HLO, read: its text (``text``, the one
guarded reader, with XLA's metadata in ``name_stacks``), its data flow
(``flow``), why each collective is there (``attribution``), its loops
(``trip_counts``), collectives (``collectives``) and work (``work``), a
step's summary of them (``summary``) and the roofline over it
(``roofline``).
"""
