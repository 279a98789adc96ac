"""What every backend shares: the config it reads, the result it returns, its run history.

Every backend reads the same :class:`~composer_plugins.training.config.train.TrainConfig`, takes its own options as
keyword arguments and returns a :class:`~composer_plugins.training.runs.run.RunResult` (writing ``model``,
``history.csv`` and ``metrics.json`` like the native path). Every local mode shares :class:`Backend`'s
``max_steps`` override and its one loop :meth:`Backend.run_local`. See docs/backends.md.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from composer_plugins.core.errors import ConfigError
from composer_plugins.core.io import atomic_write_json
from composer_plugins.training.step.metrics import scalar_metrics

__all__ = ["Backend", "resolve_config", "write_history"]


def resolve_config(config: Any = None, overrides: Sequence[str] = ()) -> tuple[Any, Any]:
    """``(TrainConfig, Config)`` from a ``TrainConfig``, a mapping, a YAML path or ``None`` (packaged default).

    An already loaded ``(TrainConfig, Config)`` pair (from ``load_train_config``) is returned as is.
    """
    from composer_plugins.core.config import Config
    from composer_plugins.training.config.train import TrainConfig, load_train_config, train_config_from_dict

    if isinstance(config, tuple) and len(config) == 2 and isinstance(config[0], TrainConfig):
        return config[0], config[1]
    if isinstance(config, TrainConfig):
        if overrides:
            raise ConfigError("overrides need a config file or mapping, not an already built TrainConfig", key="config")
        return config, Config()
    if config is None or isinstance(config, str | os.PathLike):
        return load_train_config(config, overrides)
    if isinstance(config, Mapping):
        from composer_plugins.core.config import apply_overrides

        src = Config(dict(config))
        apply_overrides(src, overrides)
        return train_config_from_dict(src, src), src
    raise ConfigError(f"expected a TrainConfig, a mapping or a YAML path, got {type(config).__name__}", key="config")


class Backend:
    """Base class of the built-in backends.

    Args:
        config: the shared training config (:class:`~composer_plugins.training.config.train.TrainConfig`,
            a mapping, a YAML path, or ``None`` for the packaged default).
        overrides: dotted ``key=value`` overrides applied to a file/mapping config.
        output_dir: overrides ``config.output_dir``.
        max_steps: overrides ``trainer.max_steps``.
    """

    #: Registry name.
    name: ClassVar[str] = ""
    #: The upstream requirement the backend was tested with.
    upstream: ClassVar[str] = ""
    #: What runs on a CPU-only machine, and what needs GPUs (shown by ``composer-plugins backends info``).
    runs_here: ClassVar[str] = ""
    needs_gpu: ClassVar[str] = ""
    #: The channel × mode cells this backend declares (:mod:`~composer_plugins.backends.support`):
    #: ``{mode: {channel kind: Cell}}``, a mode being ``<name>`` or ``<name>:<mode=>``; ``None`` for a mode that
    #: composes the channel objects themselves (every channel runs).
    support: ClassVar[Mapping[str, Mapping[str, Any] | None]] = {}

    def __init__(
        self,
        config: Any = None,
        overrides: Sequence[str] = (),
        *,
        output_dir: str | None = None,
        max_steps: int | None = None,
    ) -> None:
        self.config, self.src = resolve_config(config, overrides)
        if output_dir is not None:
            self.config = dataclasses.replace(self.config, output_dir=str(output_dir))
        if max_steps is not None:
            trainer = dataclasses.replace(self.config.trainer, max_steps=int(max_steps))
            self.config = dataclasses.replace(self.config, trainer=trainer)

    @property
    def output_dir(self) -> Path:
        """Where ``train()`` writes the model, ``history.csv`` and ``metrics.json``."""
        return Path(self.config.output_dir)

    def train(self) -> Any:  # pragma: no cover - abstract
        """Run training; return a :class:`~composer_plugins.training.runs.run.RunResult`."""
        raise NotImplementedError

    @classmethod
    def info(cls) -> dict[str, str]:
        """Name, tested upstream, what runs on CPU here and what needs GPUs."""
        return {"name": cls.name, "upstream": cls.upstream, "runs_here": cls.runs_here, "needs_gpu": cls.needs_gpu}

    # -- the local loop shared by the backends ------------------------------------------
    def run_local(
        self, run: Any, loss_of: Callable[[Any, int], tuple[Any, Mapping[str, Any]]], *, old_logprobs: bool = False
    ) -> Any:
        """Train ``trainer.max_steps`` steps in this process; returns the ``RunResult``.

        ``loss_of(record, step) -> (loss, metrics)`` gets each step's record from ``run``'s experience maker
        (with the no-grad sampling-time log-probs when ``old_logprobs``); the components' optimizer step (the
        EMA teacher's update included) follows.
        """
        history: list[dict[str, float]] = []
        for step in range(self.config.trainer.max_steps):
            t0 = time.perf_counter()
            tasks, ro, rewards, feedback = run.rollout(step)
            record = run.parts.experience.make(tasks, ro, rewards, feedback, old_logprobs=old_logprobs)
            loss, metrics = loss_of(record, step)
            grad_norm = run.parts.optimize(loss)
            scored = [float(r) for r in rewards if not math.isnan(float(r))]  # unscorable rows (NaN) left out
            row = {
                "step": float(step + 1),
                "loss": float(loss.detach()),
                "reward": sum(scored) / len(scored) if scored else float("nan"),
                "unscorable": 1.0 - len(scored) / max(1, len(rewards)),
                "grad_norm": grad_norm,
            }
            row.update(scalar_metrics(metrics))
            row["step_time"] = time.perf_counter() - t0
            history.append(row)
        return self.write_outputs(history, {}, run.policy, run.tokenizer)

    # -- outputs shared by the backends ------------------------------------------------
    def write_outputs(
        self, history: list[dict[str, float]], metrics: dict[str, float], model: Any = None, tokenizer: Any = None
    ) -> Any:
        """Write ``history.csv``, ``metrics.json`` and (when given) ``model/``; return a ``RunResult``."""
        from composer_plugins.training.runs.run import RunResult

        out = self.output_dir
        out.mkdir(parents=True, exist_ok=True)
        write_history(out / "history.csv", history)
        model_dir = out / "model"
        if model is not None:
            model.save_pretrained(model_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(model_dir)
        final = dict(metrics)
        if history:
            final.update({f"train/{k}": v for k, v in history[-1].items() if k != "step"})
        atomic_write_json(out / "metrics.json", final, default=str)
        return RunResult(metrics=final, output_dir=str(out), model_dir=str(model_dir), history=history)


def write_history(path: Path, rows: list[dict[str, float]]) -> None:
    """One CSV row per optimizer step; columns are the union of the rows' keys, ``step`` first."""
    keys = list(dict.fromkeys(["step", *(k for r in rows for k in r)]))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
