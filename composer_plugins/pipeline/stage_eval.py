"""The eval stage of one study cell: held-out metrics of a trained policy, logged to MLflow."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_plugins.core.io import atomic_write_json, read_jsonl
from composer_plugins.pipeline import study
from composer_plugins.pipeline.common import PATHS, is_num, param_error, section
from composer_plugins.pipeline.stage_prepare import env_spec_for, line_novelty
from composer_plugins.pipeline.stage_train import channel_flags, channels_label, train_config
from composer_plugins.training.lightning import tracking

EVAL_KEYS = ("envs", "max_new_tokens", "batch_size", "seed", "hint_uplift", "hint_uplift_samples")


def eval_envs(params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``eval.envs`` as ``{env_key: overrides of the train config's eval section}``."""
    envs = section(params, "eval", EVAL_KEYS).get("envs") or {"gsm8k": {}}
    if not isinstance(envs, Mapping):
        raise param_error(params, "eval.envs", "must map env keys to settings, e.g. {gsm8k: {num_problems: 64}}")
    return {str(k): dict(v or {}) for k, v in envs.items()}


#: The metric each env contributes to the headline table (``<env>/<metric>`` from ``run_eval``).
HEADLINE_ALIASES = {
    "gsm8k/accuracy": ("gsm8k/accuracy",),
    "code/pass_at_1": ("code/pass_at_1", "code/accuracy"),
    "feature_deletion/mean_reward": ("feature_deletion/mean_reward",),
}


def evaluate(
    params: Mapping[str, Any],
    variant: str | None,
    seed: int,
    model: str,
    out: str | os.PathLike[str],
    *,
    data_dir: str = PATHS["data"],
    history: str | os.PathLike[str] | None = None,
    train_metrics: str | os.PathLike[str] | None = None,
    baseline: str = "sft",
) -> dict[str, Any]:
    """Evaluate ``model`` on the held-out split of every ``eval.envs`` entry; write ``out`` (JSON).

    ``variant=None`` evaluates a model outside the study's cells under the row name ``baseline``: the SFT
    start (``sft``, the study's baseline row) or the positive control's teacher (``teacher``). Logs one MLflow run
    (tags: DVC stage, git commit, variant, seed; params: the effective train config and
    ``study.*``; metrics: held-out and final train metrics; artifacts: the result JSON and the
    training curves).
    """
    from composer_plugins.training.config.train import train_config_from_dict
    from composer_plugins.training.runs.run import run_eval

    name = study.run_name(variant, seed) if variant else baseline
    cfg = train_config(params, variant, seed)
    flags = channel_flags(cfg) if variant else dict.fromkeys(channel_flags(cfg), False)
    ev = section(params, "eval")
    metrics: dict[str, float] = {}
    correct: dict[str, str] = {}
    for env_key, settings in eval_envs(params).items():
        c = json.loads(json.dumps(cfg))
        c["env"] = env_spec_for(params, env_key, settings)
        settings.pop("env", None)
        c["data"] = {**c["data"], "test_path": (Path(data_dir) / env_key / "test.jsonl").as_posix()}
        e = {**(c.get("eval") or {}), "at_start": False, "at_end": False}
        e.update({k: ev[k] for k in EVAL_KEYS if k != "envs" and k in ev})
        c["eval"] = {**e, **settings, "predictions": True}  # per-problem correctness: committed, split by line novelty
        tc = train_config_from_dict(c)
        with tempfile.TemporaryDirectory(prefix="eval-") as td:
            res = run_eval(tc, checkpoint=model, output=f"{td}/eval.json")
            preds = read_jsonl(f"{td}/eval.predictions.jsonl")
        metrics.update(
            {f"{env_key}/{k.split('/', 1)[1]}" if "/" in k else f"{env_key}/{k}": float(v) for k, v in res.items()}
        )
        correct[env_key] = "".join("1" if p.get("correct") else "0" for p in preds)
        train_file = Path(data_dir) / env_key / "train.jsonl"
        if train_file.exists() and preds:
            metrics.update(novelty_accuracy(read_jsonl(train_file), preds, env_key))
    for head, aliases in HEADLINE_ALIASES.items():
        if found := [a for a in aliases if a in metrics]:
            metrics.setdefault(head, metrics[found[0]])
    if train_metrics and Path(train_metrics).exists():
        tm = json.loads(Path(train_metrics).read_text())
        tm = {k: v for k, v in tm.items() if k.startswith(("train/", "sft/")) and is_num(v)}
        metrics.update({study.canonical_metric(k): float(v) for k, v in tm.items()})
    result = {
        "run": name,
        "variant": variant or baseline,
        "seed": seed,
        "channels": channels_label(flags),
        "channel_flags": flags,
        "model": str(model),
        "metrics": metrics,
        "correct": correct,  # per env, one character per held-out problem in test.jsonl order (1: solved greedily)
    }
    atomic_write_json(out, result, sort_keys=True)
    run_id = log_eval_run(params, cfg, result, artifacts=[out, *([history] if history else [])])
    if run_id:
        result["mlflow_run_id"] = run_id
    return result


def novelty_accuracy(
    train_rows: Sequence[Mapping[str, Any]], predictions: Sequence[Mapping[str, Any]], env_key: str
) -> dict[str, float]:
    """Greedy accuracy split by line novelty (:func:`line_novelty`): ``<env>/accuracy_unseen_line`` on the problems
    whose second worked line never occurs in train (the composition headline), ``accuracy_seen_line`` on the rest,
    with their counts ``n_unseen_line`` / ``n_seen_line``."""
    novel = line_novelty(train_rows, predictions)
    out: dict[str, float] = {}
    for name, want in (("unseen", True), ("seen", False)):
        rows = [p for p, nv in zip(predictions, novel, strict=True) if nv is want]
        out[f"{env_key}/n_{name}_line"] = float(len(rows))
        if rows:
            out[f"{env_key}/accuracy_{name}_line"] = sum(bool(p.get("correct")) for p in rows) / len(rows)
    return out


def log_eval_run(
    params: Mapping[str, Any],
    train_cfg: Mapping[str, Any],
    result: Mapping[str, Any],
    artifacts: Sequence[str | os.PathLike[str]] = (),
) -> str | None:
    """Log one evaluation into the study's MLflow experiment; returns the run id (``None`` when off)."""
    if not tracking.mlflow_enabled(params):
        return None
    from composer_plugins.core.config import redact
    from composer_plugins.core.errors import ComposerPluginsError
    from composer_plugins.training.config.train import train_config_from_dict
    from composer_plugins.training.lightning.tracking import config_components

    tags = tracking.run_tags(
        variant=str(result["variant"]), seed=int(result["seed"]), extra={"study.channels": result["channels"]}
    )
    try:  # provenance of the evaluated config's env and channels; the eval itself never depends on it
        tags.update(tracking.provenance_tags(config_components(train_config_from_dict(train_cfg))))
    except ComposerPluginsError:
        pass
    client, rid = start_run(params, f"eval@{result['run']}", tags)
    try:
        flat = {f"train.{k}": v for k, v in tracking.flatten(redact(dict(train_cfg))).items()}
        flat.update(
            {
                "study.variant": result["variant"],
                "study.seed": result["seed"],
                "study.channels": result["channels"],
                **{f"study.channel.{k}": "on" if v else "off" for k, v in result["channel_flags"].items()},
            }
        )
        from mlflow.entities import Metric, Param

        items = [Param(k[:250], str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            client.log_batch(rid, params=items[i : i + 100])
        ms = [Metric(study.canonical_metric(k), float(v), 0, 0) for k, v in result["metrics"].items()]
        for i in range(0, len(ms), 500):
            client.log_batch(rid, metrics=ms[i : i + 500])
        for a in artifacts:
            if a and Path(a).exists():
                client.log_artifact(rid, str(a))
        client.set_terminated(rid, "FINISHED")
    except Exception:
        client.set_terminated(rid, "FAILED")
        raise
    return rid


def start_run(params: Mapping[str, Any], stage: str, tags: dict[str, str]) -> tuple[Any, str]:
    """A new run named ``stage`` in the study's MLflow experiment (outside DVC also its stage tag): client, run id."""
    uri = tracking.tracking_uri(params)
    client = tracking.client(uri)
    exp_id = tracking.ensure_experiment(client, tracking.experiment_name(params), uri)
    if tags[tracking.TAG_STAGE] == "manual":
        tags[tracking.TAG_STAGE] = stage
    return client, client.create_run(exp_id, run_name=tracking.run_name(stage), tags=tags).info.run_id


def unmlflow_key(k: str) -> str:
    """A metric name read back from MLflow (or an old file) in the one naming scheme (docs/metrics.md)."""
    return study.canonical_metric(k)
