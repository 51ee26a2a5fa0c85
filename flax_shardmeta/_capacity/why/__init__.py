"""Why each collective is there, in words: the layout changes a step's
constraints ask for (``layout_changes``) and ``report.why()``'s text
(``readable``).
"""
