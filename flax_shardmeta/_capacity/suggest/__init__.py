"""``fsm.suggest``: rule presets (``presets``), the candidates it compiles
(``candidate``), how they rank (``ranking``) and the search
(``suggestions``).
"""
