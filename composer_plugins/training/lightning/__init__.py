"""The Lightning glue: ``ComposerModule`` (``module``), the one ``Trainer`` factory (``trainer``), strategy,
callbacks, checkpoints, progress bars, validation (``evaluation``), held-out curves (``curves``) and MLflow
tracking (``tracking``).

Imports ``training.config``, ``training.rollout`` and ``training.step``.
"""
