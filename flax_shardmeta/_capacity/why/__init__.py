"""Why each collective is there, in words: the layout changes a step's
constraints ask for (``layout_changes``), the user's line of each traced
operation and the collectives the step's code calls (``traced_lines``), and
``report.why()``'s text (``readable``).
"""
