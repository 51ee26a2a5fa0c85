"""The estimate without a compiler: layouts propagated through the traced
step (``propagate``), a liveness walk (``liveness``), the values nothing
lays out (``unplaced``) and the report made of them (``estimator``).
"""
