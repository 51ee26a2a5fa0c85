"""A compiled program's optimised HLO, read (its text parsed by
``_programs.hlo_text``, the one guarded reader): its data flow
(``flow``), why each collective is there (``attribution``), its loops
(``trip_counts``), collectives (``collectives``) and work (``work``), a
step's summary of them (``summary``) and the roofline over it
(``roofline``).
"""
