"""Runs: ``run_train``/``run_eval`` (``run``), SFT (``sft``), the training CLI commands (``commands``) and
``training``'s one default plugin (``plugin``), which registers every built-in of ``training``.

Imports every other sub-package of ``training``.
"""
