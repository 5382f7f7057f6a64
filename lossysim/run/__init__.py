"""Running experiments: one training run (``experiment``) and sweeps of them (``sweep``).

A run reads top-down in ``experiment``: it builds what it trains with (``build``), then loops
over training steps (``step``), metrics rows and the summary (``record``), evaluations
(``evaluate``) and checkpoints (``checkpoint``), keeping its progress in ``state``.
"""
