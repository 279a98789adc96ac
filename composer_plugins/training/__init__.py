"""The training stack: config dataclasses and building components from config (``train``),
the composed ``ComposerModule`` and SFT (``module``), MLflow tracking (``tracking``) and the
``train``/``sft``/``eval`` commands (``commands``).

Imports point down: ``core``, ``losses``, ``models``, ``envs`` and ``teachers`` only.
"""
