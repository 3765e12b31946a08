"""Which CP × PP × DP layout fits and runs fastest: layouts, an analytic model, measured runs.

- :mod:`.layouts`: candidate ``dp × cp × pp`` (+ virtual stages) layouts for N devices;
- :mod:`.model`: the analytic memory / step-time model (formulas in its docstring);
- :mod:`.hardware`: device presets (h100, h200, b200, a measured cpu, custom);
- :mod:`.measure`: short real steps of candidate layouts, predicted beside measured.

Nothing here imports torch at import time except :mod:`.measure`'s functions when they run.
"""
