"""The one Lightning ``Trainer`` factory, and the callbacks and switches every run shares.

:func:`lightning_trainer` is the single place a ``lightning.Trainer`` is constructed (RL run, SFT, eval,
the DiLoCo toy LM); :func:`build_trainer` is the RL run's use of it (checkpoints, clipping,
accumulation, progress bar, MLflow logger; wrappers such as DiLoCo inject ``extra_callbacks`` and
``strategy``). :class:`HistoryCallback` writes ``history.csv``; ``quiet_lightning`` silences
Lightning's chatter around a fit.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar

from composer_plugins.core import progress
from composer_plugins.core.io import is_wall_clock
from composer_plugins.training.config.train import TrainConfig
from composer_plugins.training.lightning.callbacks import build_callbacks
from composer_plugins.training.lightning.checkpoints import AtomicCheckpointIO
from composer_plugins.training.lightning.curves import heldout_curve
from composer_plugins.training.lightning.progress import StepLines, StepProgressBar
from composer_plugins.training.lightning.strategy import build_strategy
from composer_plugins.training.lightning.tracking import build_logger


def set_threads(cfg: TrainConfig) -> None:
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    import transformers

    names = (
        "lightning.pytorch.utilities.rank_zero",
        "lightning.pytorch.accelerators.cuda",
        "lightning.fabric",
        "lightning.pytorch.trainer.connectors.signal_connector",
    )
    transformers.utils.logging.disable_progress_bar()
    old = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*but have no `val_dataloader`.*")
        warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        warnings.filterwarnings("ignore", message=".*`isinstance\\(treespec, LeafSpec\\)`.*")
        try:
            yield
        finally:
            for n, lvl in old.items():
                logging.getLogger(n).setLevel(lvl)


def progress_bar(phase: str, configured: bool) -> Any:
    """The one progress bar (:mod:`composer_plugins.training.lightning.progress`), or ``None`` when it is off.

    Off when the config says so or the ``--no-progress`` switch (``COMPOSER_PROGRESS=0``) is set; then
    transformers' and the Hub's own bars are silenced too.
    """
    if not progress.enabled(configured):
        if not progress.enabled():
            progress.silence()
        else:
            progress.quiet_libraries()  # our bar is off: no library's bar alone in the log either
        return None
    return StepProgressBar(phase)


def lightning_trainer(*, callbacks: Sequence[Any] = (), **kwargs: Any) -> Any:
    """The one place a ``lightning.Trainer`` is constructed (RL run, SFT, eval, the DiLoCo toy LM).

    Project defaults (no logger, checkpoints, model summary or sanity validation; a progress bar only when
    ``callbacks`` hold one) under ``kwargs``, which may override any of them; :func:`build_trainer` is the RL
    run's use of it.
    """
    bar = any(isinstance(c, ProgressBar) for c in callbacks)
    kw: dict[str, Any] = {"logger": False, "enable_model_summary": False, "num_sanity_val_steps": 0}
    kw.update({"enable_checkpointing": False, "enable_progress_bar": bar, **kwargs})
    return L.Trainer(callbacks=list(callbacks), **kw)


def build_trainer(
    cfg: TrainConfig,
    *,
    extra_callbacks: Sequence[Any] = (),
    strategy: Any = None,
    logger: Any = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> Any:
    """The Lightning ``Trainer`` of the RL phase: checkpoints, clipping, accumulation, progress bar, MLflow.

    Args:
        cfg: the training config.
        extra_callbacks: callbacks appended to the built-in ones (e.g. a DiLoCo outer-step callback).
        strategy: a Lightning strategy (default: ``trainer.strategy`` through :func:`build_strategy`).
        logger: a logger to use instead of the one built from ``cfg.mlflow`` (``False`` disables it).
        checkpoint_dir: where ``ModelCheckpoint`` writes (default ``<output_dir>/checkpoints``).
        overrides: any other ``lightning.Trainer`` keyword argument.

    Plugin callbacks named in ``trainer.callbacks`` (hook ``register_callbacks``) follow
    ``extra_callbacks``.
    """
    t = cfg.trainer
    ckpt = (
        ModelCheckpoint(
            dirpath=str(checkpoint_dir or Path(cfg.output_dir) / "checkpoints"),
            filename="{step}",
            every_n_train_steps=t.checkpoint_every_n_steps,
            save_last=True,
            save_top_k=t.keep_checkpoints,
            monitor="step",
            mode="max",
            save_on_exception=False,
        )
        if t.checkpoint_every_n_steps > 0
        else None
    )
    curve = heldout_curve(cfg.eval)
    callbacks: list[Any] = [c for c in (ckpt, curve, HistoryCallback(Path(cfg.output_dir) / "history.csv")) if c]
    callbacks += list(extra_callbacks)
    if t.callbacks:
        callbacks += build_callbacks(t.callbacks)
    bar = progress_bar("train", t.enable_progress_bar)
    if bar is not None:
        callbacks.append(bar)
    elif progress.enabled() and t.progress_every_n_steps > 0:
        callbacks.append(StepLines(f"train {cfg.output_dir}", t.progress_every_n_steps))
    val_every = t.val_every_n_steps
    kw: dict[str, Any] = {
        "max_steps": t.max_steps,
        "accelerator": t.accelerator,
        "devices": t.devices,
        "precision": t.precision,
        "accumulate_grad_batches": t.accumulate_grad_batches,
        "gradient_clip_val": t.gradient_clip_val,
        "gradient_clip_algorithm": t.gradient_clip_algorithm,
        "log_every_n_steps": t.log_every_n_steps,
        "enable_checkpointing": ckpt is not None,
        "deterministic": t.deterministic,
        "logger": build_logger(cfg) if logger is None else logger,
        "callbacks": callbacks,
        "default_root_dir": cfg.output_dir,
        "val_check_interval": val_every * t.accumulate_grad_batches if val_every else None,
        "check_val_every_n_epoch": None if val_every else 1,
    }
    if strategy is None and cfg.trainer.strategy != "auto":
        strategy = build_strategy(cfg)
    if strategy is not None:
        kw["strategy"] = strategy
    if ckpt is not None:
        kw["plugins"] = [AtomicCheckpointIO()]  # a kill while saving never leaves a half-written last.ckpt
    kw.update(overrides)
    return lightning_trainer(**kw)


class HistoryCallback(Callback):
    """Writes one CSV row per optimizer step (``step`` + the module's step statistics) to ``path``.

    Columns are named as the MLflow metrics (docs/metrics.md) minus wall-clock ones
    (:func:`~composer_plugins.core.io.is_wall_clock`: MLflow only, so a repeated run writes the same CSV);
    ``step`` counts completed optimizer steps (1 first). On resume, rows up to the restored step are kept.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.rows: list[dict[str, float]] = []
        self._keys: list[str] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.rows, self._keys = [], []
        if trainer.ckpt_path and self.path.exists():
            with open(self.path) as f:
                for r in csv.DictReader(f):
                    if float(r["step"]) <= trainer.global_step:
                        row = {_history_key(k): float(v) for k, v in r.items() if v not in ("", None)}
                        row["step"] = int(row["step"])
                        self.rows.append(row)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        stats = getattr(pl_module, "last_step_stats", {}) or {}
        row: dict[str, float] = {"step": int(trainer.global_step)}
        row.update({f"train/{k}": float(v) for k, v in stats.items() if not is_wall_clock(k)})
        self.rows.append(row)
        if trainer.global_rank == 0:
            self.write(append=True)

    def write(self, append: bool = False) -> None:
        """Write the CSV (columns: union of every row's keys, ``step`` first); append when the columns are unchanged."""
        if append and self._keys and self.rows and set(self.rows[-1]) <= set(self._keys) and self.path.exists():
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self._keys).writerow(self.rows[-1])
            return
        keys = list(dict.fromkeys(["step", *(k for r in self.rows for k in r)]))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        self._keys = keys


def _history_key(k: str) -> str:
    """An old unprefixed history column (``reward``, ``grpo/loss``) under its current name (``train/...``)."""
    return k if k == "step" or k.startswith(("train/", "sft/", "val/", "start/")) else f"train/{k}"
