"""The one progress bar of training, SFT and evaluation: optimizer steps, throughput and reward.

It replaces Lightning's bars with one line per phase in the units a user asks about; turned off by
``trainer.enable_progress_bar: false`` or ``--no-progress`` / ``COMPOSER_PROGRESS=0``. See docs/training.md
"Progress".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from tqdm.auto import tqdm


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


class StepProgressBar(ProgressBar):
    """A tqdm bar over optimizer steps (``train``/``sft``) and one over held-out problems (``eval``).

    Args:
        phase: ``"train"`` (postfix: reward, loss, rollouts/s, tokens/s from the module's
            ``last_step_stats``) or ``"sft"`` (postfix: loss, examples/s).
    """

    def __init__(self, phase: str = "train") -> None:
        super().__init__()
        self.phase = phase
        self._enabled = True
        self._bar: Any = None
        self._vbar: Any = None
        self._t0 = 0.0
        self._rows = 0
        self._tokens = 0.0

    # -- Lightning's ProgressBar interface -------------------------------------------------
    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.trainer.is_global_zero

    # -- training --------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.is_enabled:
            return
        self._t0, self._rows, self._tokens = time.monotonic(), 0, 0.0
        self._bar = tqdm(
            total=trainer.max_steps if trainer.max_steps > 0 else None,
            initial=trainer.global_step,
            desc=self.phase,
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._bar is None:
            return
        self._count(pl_module, batch)
        if trainer.fit_loop._should_accumulate():
            return
        self._bar.update(trainer.global_step - self._bar.n)
        self._bar.set_postfix_str(self._postfix(trainer, pl_module), refresh=True)

    def _count(self, pl_module: Any, batch: Any) -> None:
        stats = getattr(pl_module, "last_step_stats", None) or {}
        if self.phase == "train":
            tasks = batch.get("tasks", ()) if isinstance(batch, Mapping) else ()
            cfg = getattr(pl_module, "cfg", None)
            self._rows += len(tasks) * (int(cfg.rollout.num_generations) if cfg is not None else 1)
            self._tokens += float(stats.get("completion_tokens", 0.0))
        elif isinstance(batch, Mapping) and "input_ids" in batch:
            self._rows += int(batch["input_ids"].shape[0])

    def _postfix(self, trainer: Any, pl_module: Any) -> str:
        dt = max(time.monotonic() - self._t0, 1e-9)
        if self.phase == "train":
            s = getattr(pl_module, "last_step_stats", None) or {}
            parts = [
                f"reward={_fmt(s['reward'])}" if "reward" in s else "",
                f"loss={_fmt(s['loss'])}" if "loss" in s else "",
                f"rollouts/s={_fmt(self._rows / dt)}",
                f"tokens/s={_fmt(self._tokens / dt)}",
            ]
        else:
            loss = trainer.callback_metrics.get("sft/loss")
            parts = [f"loss={_fmt(float(loss))}" if loss is not None else "", f"examples/s={_fmt(self._rows / dt)}"]
        return " ".join(p for p in parts if p)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Ctrl-C or an error: close the bars, so what is printed next starts on a line of its own."""
        for bar in (self._vbar, self._bar):
            if bar is not None:
                bar.close()
        self._bar = self._vbar = None

    # -- evaluation ------------------------------------------------------------------------
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.is_enabled or trainer.sanity_checking:
            return
        batches = getattr(trainer.val_dataloaders, "batches", None)  # StaticBatches of {"index", "tasks"}
        total = sum(len(b["tasks"]) for b in batches) if batches is not None else None
        self._vbar = tqdm(
            total=total, desc="eval", unit="problem", dynamic_ncols=True, leave=self._bar is None, file=sys.stderr
        )

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._vbar is None:
            return
        self._vbar.update(len(batch["tasks"]) if isinstance(batch, Mapping) and "tasks" in batch else 1)
        # the running held-out accuracy from the MeanMetric's local state (compute() would sync across
        # ranks, and only rank 0 draws the bar)
        acc = getattr(getattr(pl_module, "validator", None), "accuracy", None)
        weight = float(getattr(acc, "weight", 0.0) or 0.0)
        if weight > 0:
            self._vbar.set_postfix_str(f"accuracy={_fmt(float(acc.mean_value) / weight)}", refresh=True)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._vbar is not None:
            self._vbar.close()
            self._vbar = None


class StepLines(Callback):
    """Where no bar is drawn (a log, ``dvc repro``): one line on stderr every ``every`` optimizer steps and at
    the last, ``<label>: step 20/40 reward=0.41 loss=0.093 (31 s)``; the metrics themselves go to files."""

    def __init__(self, label: str, every: int) -> None:
        self.label, self.every = label, max(1, int(every))
        self._t0 = 0.0
        self._last = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._t0, self._last = time.monotonic(), int(trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = int(trainer.global_step)
        if not trainer.is_global_zero or step == self._last:
            return
        self._last = step
        if step % self.every and step != trainer.max_steps:
            return
        s = getattr(pl_module, "last_step_stats", None) or {}
        parts = [f"{k}={_fmt(float(s[k]))}" for k in ("reward", "loss") if k in s]
        total = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""
        line = f"{self.label}: step {step}{total} {' '.join(parts)} ({time.monotonic() - self._t0:.0f} s)"
        print(line.replace("  ", " "), file=sys.stderr, flush=True)
