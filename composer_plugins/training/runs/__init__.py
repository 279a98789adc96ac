"""Runs: ``run_train``/``run_eval`` (``run``), SFT (``sft``) and the training CLI commands (``commands``).

Imports every other sub-package of ``training``.
"""
