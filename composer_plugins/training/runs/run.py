"""The runs the CLI commands call: :func:`run_sft`, :func:`run_train`, :func:`run_eval` (and :class:`RunResult`).

Each checks the input files, builds the components, resolves the policy and drives a Lightning ``Trainer``
over the module, then writes ``metrics.json``, ``history.csv``, the exported model and the MLflow run.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L

from composer_plugins.core import progress
from composer_plugins.core.config import Config, redact
from composer_plugins.core.errors import Interrupted
from composer_plugins.core.io import atomic_write_json, atomic_write_jsonl
from composer_plugins.models.tiny import load_policy
from composer_plugins.training.config.inputs import check_checkpoint, check_inputs, checkpoint_step
from composer_plugins.training.config.train import TrainConfig
from composer_plugins.training.lightning import tracking
from composer_plugins.training.lightning.checkpoints import good_checkpoints, load_policy_weights, resolve_resume
from composer_plugins.training.lightning.module import ComposerModule
from composer_plugins.training.lightning.strategy import build_strategy
from composer_plugins.training.lightning.tracking import mlflow_settings
from composer_plugins.training.lightning.trainer import (
    HistoryCallback,
    build_trainer,
    lightning_trainer,
    progress_bar,
    quiet_lightning,
    set_threads,
)
from composer_plugins.training.rollout.rewards import TaskStream, eval_batches, task_drawer
from composer_plugins.training.step.components import build_env
from composer_plugins.training.step.policy import load_policy_for, resolve_policy
from composer_plugins.training.step.teacher_scores import teacher_summary


@dataclass
class RunResult:
    """What :func:`run_train` returns: metrics, paths and the MLflow run id (if any)."""

    metrics: dict[str, float]
    output_dir: str
    model_dir: str
    run_id: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    start_metrics: dict[str, float] = field(default_factory=dict)
    #: False on the other ranks of a data-parallel run (only rank 0 reports: files, metrics, the CLI's output).
    is_global_zero: bool = True


class RunInterrupted(Interrupted):
    """Ctrl-C during :func:`run_train`: the step it stopped at and where to continue from (the CLI exits 130)."""

    def __init__(self, step: int, checkpoint_step: int | None, checkpoint_dir: Path | None) -> None:
        self.step, self.checkpoint_step, self.checkpoint_dir = step, checkpoint_step, checkpoint_dir
        if checkpoint_step is not None:
            then = f"last checkpoint at step {checkpoint_step}; continue with `--resume last`"
        elif checkpoint_dir is None:
            then = "this run writes no checkpoints (trainer.checkpoint_every_n_steps: 0); start over with `--overwrite`"
        else:
            then = "no checkpoint written yet; start over with `--overwrite`"
        KeyboardInterrupt.__init__(self, f"interrupted at step {step}; {then}")


def _interrupted(trainer: Any, ckpt_dir: Path | None) -> RunInterrupted:
    steps = [checkpoint_step(p) for p in good_checkpoints(ckpt_dir)] if ckpt_dir is not None else []
    steps = [s for s in steps if s >= 0]
    return RunInterrupted(int(trainer.global_step), max(steps) if steps else None, ckpt_dir)


@quiet_lightning()
def run_sft(cfg: TrainConfig, src: Config | None = None) -> str:
    """Run (or reuse from cache) the SFT warm start; copy the policy to ``<output_dir>/model``."""

    check_inputs(cfg, src or Config())  # files and paths first: no model is built for a run that cannot start
    env = build_env(cfg, src)
    path = resolve_policy(dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, enabled=True)), env)
    out = Path(cfg.output_dir) / "model"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("composer_meta.json", "sft_history.json"))
    metrics_file = Path(path) / "sft_metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    atomic_write_json(Path(cfg.output_dir, "metrics.json"), metrics)
    hist_file = Path(path) / "sft_history.json"
    history = json.loads(hist_file.read_text()) if hist_file.exists() else []
    log_sft_run(cfg, metrics, history)
    return str(out)


def log_sft_run(cfg: TrainConfig, metrics: Mapping[str, float], history: Sequence[Mapping[str, float]]) -> str | None:
    """One MLflow run for the SFT warm start (when ``mlflow`` is on): its config, final and per-step loss.

    Tagged like every pipeline stage (``dvc.stage`` from ``$DVC_STAGE``, git commit, seed); the run
    name is ``cfg.mlflow.run_name`` or ``sft-s<sft.seed>``. A cached warm start logs the history recorded when
    it was trained. Returns the run id.
    """
    settings = mlflow_settings(cfg)
    if settings is None:
        return None
    from mlflow.entities import Metric, Param

    client = tracking.client(settings["tracking_uri"])
    exp_id = tracking.ensure_experiment(client, settings["experiment"], settings["tracking_uri"])
    name = tracking.run_name(f"sft-s{cfg.sft.seed}", given=cfg.mlflow.run_name)
    tags = {**settings["tags"], "mlflow.runName": name}
    run = client.create_run(exp_id, tags=tags)
    conf = {"sft": asdict(cfg.sft), "model": asdict(cfg.model), "env": redact(cfg.env), "seed": cfg.seed}
    params = [Param(k, str(v)[:500]) for k, v in tracking.flatten(conf).items()]
    points = [Metric(k, float(v), 0, int(row.get("step", 0))) for row in history for k, v in row.items() if k != "step"]
    points += [Metric(k, float(v), 0, int(cfg.sft.steps)) for k, v in metrics.items()]
    for i in range(0, len(params), 100):  # MLflow's per-batch limits: 100 params, 1000 metrics
        client.log_batch(run.info.run_id, params=params[i : i + 100])
    for i in range(0, len(points), 1000):
        client.log_batch(run.info.run_id, metrics=points[i : i + 1000])
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def _val_metrics(trainer: Any) -> dict[str, float]:
    """``val/*`` metrics of the last validation (``val/accuracy``, ``val/mean_reward``, ``val/pass_at_<k>``)."""
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/") and hasattr(v, "item")}


@quiet_lightning()
def run_train(
    cfg: TrainConfig,
    src: Config | None = None,
    *,
    resume: str | None = None,
    extra_callbacks: Sequence[Any] = (),
    strategy: Any = None,
    logger: Any = None,
    module: Any = None,
) -> RunResult:
    """RL from the resolved policy. ``resume="last"`` (or a ``.ckpt`` path) continues a run exactly.

    Writes ``<output_dir>/model`` (``save_pretrained``), ``history.csv``, ``metrics.json`` and
    ``checkpoints/``; logs params, per-channel metrics, reward, accuracy and checkpoints to MLflow.
    """

    # checked before anything is built: a missing or broken input fails in a second, naming the file
    check_inputs(cfg, src or Config())
    ckpt_dir = Path(cfg.output_dir) / "checkpoints" if cfg.trainer.checkpoint_every_n_steps > 0 else None
    ckpt_path = resolve_resume(resume, ckpt_dir)
    set_threads(cfg)
    if not cfg.trainer.enable_progress_bar:
        progress.quiet_libraries()  # no "Loading weights" bar alone in a run whose own bar is off
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = build_env(cfg, src) if module is None else module.env
    loaded = load_policy_for(cfg, env) if module is None else None
    L.seed_everything(cfg.seed, verbose=False)
    if loaded is not None:
        module = ComposerModule(cfg, policy=loaded[0], tokenizer=loaded[1], env=env, src=src)
    stream = TaskStream(
        task_drawer(env, cfg, "train"),
        cfg.rollout.prompts_per_step,
        cfg.trainer.max_steps * cfg.trainer.accumulate_grad_batches,
        seed=cfg.seed,
    )
    val = eval_batches(env, cfg)
    if strategy is None:
        strategy = build_strategy(cfg, module.policy, src)
    trainer = build_trainer(cfg, extra_callbacks=extra_callbacks, strategy=strategy, logger=logger)
    run_id = getattr(trainer.logger, "run_id", None) if trainer.logger else None
    start: dict[str, float] = {}
    final: dict[str, float] = {}
    try:
        with quiet_lightning():
            if cfg.eval.at_start and ckpt_path is None and val:
                trainer.validate(module, dataloaders=val, verbose=False)
                start = {k.replace("val/", "start/"): v for k, v in _val_metrics(trainer).items()}
                if trainer.logger:
                    trainer.logger.log_metrics(start, step=0)
            trainer.fit(
                module,
                train_dataloaders=stream,
                val_dataloaders=val if cfg.trainer.val_every_n_steps else None,
                ckpt_path=ckpt_path,
                weights_only=True,
            )
            if cfg.eval.at_end and val:
                trainer.validate(module, dataloaders=val, verbose=False)
                final = _val_metrics(trainer)
    except SystemExit:  # Lightning's answer to Ctrl-C: tear down, then sys.exit(1)
        if not trainer.interrupted:
            raise
        teacher_summary(getattr(module, "teacher_scoring", None))
        raise _interrupted(trainer, ckpt_dir) from None
    teacher_summary(getattr(module, "teacher_scoring", None))  # teachers that failed, once more at the end
    # data parallel: every rank holds the same policy (FSDP: gathered here); rank 0 writes the files
    with module.full_params(recurse=True):
        model_dir = module.export_pretrained(out / "model") if trainer.is_global_zero else out / "model"
    hist_cb = next((c for c in trainer.callbacks if isinstance(c, HistoryCallback)), None)
    history = list(hist_cb.rows) if hist_cb else []
    metrics: dict[str, float] = {**start, **final}
    if history:
        metrics.update({k: v for k, v in history[-1].items() if k != "step"})
        # train/reward is the last step's; this is the mean over every step of the run
        metrics["train/reward_mean_over_steps"] = sum(r.get("train/reward", 0.0) for r in history) / len(history)
    if trainer.logger:
        _log_artifacts(trainer.logger, [model_dir, out / "history.csv"])
    if trainer.is_global_zero:
        atomic_write_json(out / "metrics.json", metrics)
    if run_id:
        (out / "mlflow_run.txt").write_text(str(run_id) + "\n")
    return RunResult(
        metrics=metrics,
        output_dir=str(out),
        model_dir=str(model_dir),
        run_id=run_id,
        history=history,
        start_metrics=start,
        is_global_zero=trainer.is_global_zero,
    )


def _log_artifacts(logger: Any, paths: Sequence[Path | str]) -> None:
    exp = logger.experiment
    for p in paths:
        p = Path(p)
        if p.is_dir():
            exp.log_artifacts(logger.run_id, str(p), artifact_path=p.name)
        elif p.exists():
            exp.log_artifact(logger.run_id, str(p))


@quiet_lightning()
def run_eval(
    cfg: TrainConfig, src: Config | None = None, *, checkpoint: str | None = None, output: str | None = None
) -> dict[str, float]:
    """Held-out evaluation of ``checkpoint`` (a Lightning ``.ckpt`` or a ``save_pretrained`` dir / hub id).

    Without ``checkpoint`` the resolved policy of ``cfg`` is evaluated (e.g. the SFT start).
    Returns (and writes to ``output`` if given) flat ``{"<env>/accuracy", "<env>/pass_at_<k>", "<env>/mean_reward"}``,
    with ``eval.hint_uplift`` also ``<env>/hint_fix_rate``, ``<env>/hint_coverage`` and the ``<env>/hint_*`` counts.
    """

    if checkpoint is None:
        check_inputs(cfg, src or Config())
    else:
        check_checkpoint(checkpoint)
    set_threads(cfg)
    env = build_env(cfg, src)
    ckpt_file = checkpoint if checkpoint and str(checkpoint).endswith(".ckpt") else None
    path = checkpoint if checkpoint and not ckpt_file else resolve_policy(cfg, env)
    policy, tok = load_policy(path, dtype=cfg.model.dtype)
    module = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, channels=[], src=src)
    if ckpt_file:  # the policy's weights, strictly: a checkpoint of another model fails, naming the keys
        load_policy_weights(module.policy, ckpt_file)
    L.seed_everything(cfg.seed, verbose=False)
    bar = progress_bar("eval", cfg.trainer.enable_progress_bar)
    trainer = lightning_trainer(
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        callbacks=[bar] if bar else [],
    )
    if cfg.eval.predictions:
        module.validator.predictions = []
    trainer.validate(module, dataloaders=eval_batches(env, cfg), verbose=False)
    env_name = _env_name(cfg)
    metrics = {f"{env_name}/{k[4:]}": v for k, v in _val_metrics(trainer).items()}
    if output:
        out = Path(output)
        atomic_write_json(out, metrics)
        if (preds := module.validator.predictions) is not None:
            atomic_write_jsonl(out.with_suffix(".predictions.jsonl"), preds, ensure_ascii=True)
    return metrics


def _env_name(cfg: TrainConfig) -> str:
    e = cfg.env
    if isinstance(e, str):
        return e
    if isinstance(e, Mapping):
        return str(e.get("name") or str(e.get("class_path", "env")).rsplit(".", 1)[-1])
    return "env"
