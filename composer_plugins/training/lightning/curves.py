"""Held-out learning curves during RL (``eval.every_n_steps``): greedy accuracy on a fixed held-out subset.

:class:`HeldoutCurve` records ``heldout/accuracy`` on the first ``eval.curve_problems`` held-out problems
(the same subset for every step, variant and seed, so curves pair), from step 0, also into
``<output_dir>/heldout_curve.csv``; ``eval.curve_early_every`` / ``curve_early_until`` evaluate densely early.
See docs/metrics.md (``train/heldout/accuracy``) and docs/results.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from composer_plugins.core.io import read_jsonl
from composer_plugins.training.rollout.rewards import env_tasks

__all__ = ["CURVE_FILE", "CURVE_STAT", "HeldoutCurve", "heldout_curve"]

#: The step statistic (history.csv column ``train/<CURVE_STAT>``).
CURVE_STAT = "heldout/accuracy"
#: Every point of the curve, step 0 included, in the run's output directory.
CURVE_FILE = "heldout_curve.csv"


class HeldoutCurve(Callback):
    """Greedy held-out accuracy every ``every_n_steps`` optimizer steps (see the module docstring)."""

    def __init__(
        self, every_n_steps: int, num_problems: int, seed: int = 1234, early_every: int = 0, early_until: int = 0
    ) -> None:
        if int(every_n_steps) < 1:
            raise ValueError(f"eval.every_n_steps must be at least 1 to draw a curve, got {every_n_steps!r}")
        if int(num_problems) < 1:
            raise ValueError(f"eval.curve_problems must be at least 1, got {num_problems!r}")
        if int(early_every) < 0 or int(early_until) < 0 or (int(early_until) > 0) != (int(early_every) > 0):
            raise ValueError(
                f"eval.curve_early_every ({early_every!r}) and eval.curve_early_until ({early_until!r}) are set "
                "together, both >= 1 (e.g. 3 and 18: every 3 steps up to step 18), or both 0"
            )
        self.early_every, self.early_until = int(early_every), int(early_until)
        self.every_n_steps = int(every_n_steps)
        self.num_problems = int(num_problems)
        self.seed = int(seed)
        self.tasks: list[dict[str, Any]] = []
        self.points: list[tuple[int, float]] = []

    def _tasks(self, pl_module: Any) -> list[dict[str, Any]]:
        cfg = pl_module.cfg
        if cfg.data.test_path:
            return [dict(t) for t in read_jsonl(cfg.data.test_path)[: self.num_problems]]
        return env_tasks(pl_module.env, cfg.data.test_split, self.num_problems, cfg.eval.seed)

    def accuracy(self, pl_module: Any) -> float:
        """Greedy accuracy of the current policy on the subset (sampling and hint uplift off)."""
        was_training = pl_module.training
        pl_module.eval()
        try:
            return pl_module.validator.greedy_accuracy(pl_module.policy, self.tasks, self.seed)
        finally:
            pl_module.train(was_training)

    def due(self, step: int, last: bool = False) -> bool:
        """Whether the curve is evaluated at optimizer step ``step`` (step 0 always, and the last step)."""
        if step == 0 or last or step % self.every_n_steps == 0:
            return True
        return self.early_every > 0 and step <= self.early_until and step % self.early_every == 0

    def _log(self, trainer: Any, pl_module: Any, step: int, value: float) -> None:
        self.points.append((step, value))
        out_dir = getattr(getattr(pl_module, "cfg", None), "output_dir", None)
        for lg in trainer.loggers or ():
            lg.log_metrics({f"train/{CURVE_STAT}": value}, step=step)
        if out_dir and trainer.is_global_zero:
            path = Path(out_dir) / CURVE_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("step,value\n" + "".join(f"{s},{v}\n" for s, v in self.points))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.tasks = self._tasks(pl_module)
        self.points = []
        if not self.tasks:
            raise ValueError("eval.every_n_steps: the held-out split holds no problems to draw a curve on")
        self._log(trainer, pl_module, int(trainer.global_step), self.accuracy(pl_module))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        step = int(trainer.global_step)
        last = trainer.max_steps is not None and step >= trainer.max_steps
        if not self.due(step, last):
            return
        value = self.accuracy(pl_module)
        stats = getattr(pl_module, "last_step_stats", None)
        if isinstance(stats, dict):
            stats[CURVE_STAT] = value  # HistoryCallback (after this one) writes it as train/heldout/accuracy
        self._log(trainer, pl_module, step, value)


def heldout_curve(eval_cfg: Mapping[str, Any] | Any) -> HeldoutCurve | None:
    """The callback for ``eval`` (a section object or mapping), or ``None`` when ``every_n_steps`` is 0/unset."""
    get = eval_cfg.get if isinstance(eval_cfg, Mapping) else lambda k, d=None: getattr(eval_cfg, k, d)
    every = int(get("every_n_steps", 0) or 0)
    if every <= 0:
        return None
    return HeldoutCurve(
        every,
        int(get("curve_problems", 100) or 100),
        int(get("seed", 1234) or 1234),
        int(get("curve_early_every", 0) or 0),
        int(get("curve_early_until", 0) or 0),
    )
