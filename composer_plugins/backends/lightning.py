"""The ``lightning`` backend: the native path, registered like every other backend.

It is exactly :func:`composer_plugins.training.runs.run.run_train` (``ComposerModule`` under a Lightning
``Trainer``), behind the same ``build("backends", name, config=...).train()`` interface as the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from composer_plugins.backends.base import Backend


class LightningBackend(Backend):
    """Train with :class:`~composer_plugins.training.lightning.module.ComposerModule` and a Lightning ``Trainer``.

    Args:
        resume: ``"last"`` or a checkpoint path (passed to ``run_train``).
        strategy, extra_callbacks, logger: passed to :func:`~composer_plugins.training.runs.run.run_train`.
    """

    name = "lightning"
    upstream = "lightning>=2.6,<2.7"
    runs_here = "everything (all channels, tiny model on CPU)"
    needs_gpu = "nothing (set trainer.accelerator=gpu for GPUs)"
    support: ClassVar[dict[str, Any]] = {"lightning": None}

    def __init__(
        self,
        config: Any = None,
        overrides: Sequence[str] = (),
        *,
        resume: str | None = None,
        strategy: Any = None,
        extra_callbacks: Sequence[Any] = (),
        logger: Any = None,
        **common: Any,
    ) -> None:
        super().__init__(config, overrides, **common)
        self.resume, self.strategy, self.extra_callbacks, self.logger = resume, strategy, list(extra_callbacks), logger

    def train(self) -> Any:
        """:func:`~composer_plugins.training.runs.run.run_train` on the config; returns its ``RunResult``."""
        from composer_plugins.training.runs.run import run_train

        return run_train(
            self.config,
            self.src,
            resume=self.resume,
            extra_callbacks=self.extra_callbacks,
            strategy=self.strategy,
            logger=self.logger,
        )
