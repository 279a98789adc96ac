"""The train stage of one study cell: its effective ``train`` config (variant x seed) and the run."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from composer_plugins.core.config import Config
from composer_plugins.core.errors import ConfigError
from composer_plugins.pipeline import study
from composer_plugins.pipeline.common import PATHS, SPLITS, env_key, section
from composer_plugins.training.lightning import tracking


def train_config(
    params: Mapping[str, Any],
    variant: str | None,
    seed: int,
    *,
    pairs: str | None = PATHS["pairs"],
    model: str = PATHS["sft_model"],
) -> dict[str, Any]:
    """The effective ``train`` config (plain dict) of study cell ``variant × seed``.

    ``params['train']`` deep-merged with ``study.variants.<variant>``, then the pipeline's
    wiring: start from the SFT stage's model (SFT off), the prepared GSM8K files, the pairs of
    the replay stage, ``seed``, ``output_dir=runs/<variant>-s<seed>``, and MLflow settings/tags.
    """
    over = study.variant_overrides(params, variant) if variant else {}
    # merge_params: a variant replaces a mapping it marks `_replace: true` (e.g. another hints.provider)
    cfg = study.merge_params(section(params, "train"), over)
    name = study.run_name(variant, seed) if variant else "sft"
    key = env_key(cfg.get("env", "gsm8k"))
    cfg["data"] = data = dict(cfg.get("data") or {})
    for split in SPLITS:
        data.setdefault(f"{split}_path", (Path(PATHS["data"]) / key / f"{split}.jsonl").as_posix())
    cfg["seed"] = int(seed)
    cfg["output_dir"] = (Path(PATHS["runs"]) / name).as_posix()
    cfg["model"] = {**(cfg.get("model") or {}), "name_or_path": model}
    cfg["sft"] = {**(cfg.get("sft") or {}), "enabled": False}
    if pairs is not None:  # a variant may name its own pairs file (study.variants.<v>.replay.pairs_path)
        own = (over.get("replay") or {}).get("pairs_path")
        cfg["replay"] = {**(cfg.get("replay") or {}), "pairs_path": own or pairs}
    flags = channel_flags(cfg)
    ml = section(params, "mlflow")
    cfg["mlflow"] = {
        **(cfg.get("mlflow") or {}),
        "enabled": tracking.mlflow_enabled(params),
        "tracking_uri": ml.get("tracking_uri", "sqlite:///mlflow.db"),
        "experiment": tracking.experiment_name(params),
        "run_name": f"train@{name}",
        "tags": {
            **((cfg.get("mlflow") or {}).get("tags") or {}),
            tracking.TAG_VARIANT: variant or "sft",
            tracking.TAG_SEED: str(seed),
            "study.channels": channels_label(flags),
        },
    }
    return cfg


#: Keys of a cell's config that the pipeline sets (not params.yaml): their errors stay at the generated file.
PIPELINE_KEYS = ("seed", "output_dir", "model.name_or_path", "data", "sft.enabled", "replay.pairs_path", "mlflow")


def cell_key_origin(params: Mapping[str, Any], variant: str | None, key: str) -> str | None:
    """The params key a cell config's ``key`` came from: ``study.variants.<variant>.<key>`` where the variant
    sets it (or the closest parent), else ``train.<key>``; ``None`` for a key the pipeline sets itself.

    Of the two, the one that names more of ``key`` wins (the variant on a tie: it is merged last), where a
    key counts as named when params.yaml has a line for it or a ``-S key=value`` override set it.
    """
    if not isinstance(params, Config) or any(key == p or key.startswith(p + ".") for p in PIPELINE_KEYS):
        return None
    parts = key.split(".")
    best, depth = None, 0
    bases = ([f"study.variants.{variant}"] if variant else []) + ["train"]
    for base in bases:
        for n in range(len(parts), depth, -1):
            full = ".".join([base, *parts[:n]])
            if full in params.lines or full in params.overrides:
                best, depth = ".".join([base, *parts]), n
                break
    return best


def locate_cell_error(params: Mapping[str, Any], variant: str | None, err: ConfigError) -> ConfigError:
    """``err`` (located in a cell's generated config.yaml) located where its value came from instead: the
    params.yaml line of ``train.<key>`` or ``study.variants.<variant>.<key>``, or the ``-S`` override that set it.
    An error the params cannot explain (a key the pipeline sets) is returned unchanged."""
    origin = cell_key_origin(params, variant, err.key) if err.key else None
    if origin is None:
        return err
    assert isinstance(params, Config)
    return params.error(origin, err.problem, err.valid)


def train_cell(
    params: Mapping[str, Any],
    variant: str,
    seed: int,
    *,
    pairs: str | None = PATHS["pairs"],
    model: str = PATHS["sft_model"],
) -> dict[str, Any]:
    """Write the cell's ``config.yaml`` and train it (DiLoCo when ``train.diloco.replicas > 1``).

    Returns the final train metrics. The cell's directory ends up with ``config.yaml``,
    ``model/``, ``history.csv`` and ``metrics.json`` either way.
    """
    if pairs is not None and (not Path(pairs).exists() or Path(pairs).stat().st_size == 0):
        pairs = None  # no pairs (e.g. every student trace agreed with the teachers): replay channel is skipped
    cfg = train_config(params, variant, seed, pairs=pairs, model=model)
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.yaml"
    header = f"# generated by `composer-plugins study train --variant {variant} --seed {seed}`\n"
    cfg_path.write_text(header + yaml.safe_dump(cfg, sort_keys=False))
    replicas = int((cfg.get("diloco") or {}).get("replicas") or 1)
    from composer_plugins.training.config.train import load_train_config

    try:  # a bad value is reported at its params.yaml line (or -S override), not at the generated file
        tc, src = load_train_config(cfg_path)
        if replicas <= 1:
            from composer_plugins.training.runs.run import run_train

            print(f"composer-plugins train -c {cfg_path}", flush=True)
            return dict(run_train(tc, src).metrics)
    except ConfigError as e:
        if e.file is None or Path(e.file) != cfg_path:
            raise
        raise locate_cell_error(params, variant, e) from e
    from composer_plugins.diloco.launch import launch

    print(f"composer-plugins diloco --replicas {replicas} -c {cfg_path} --seed {seed}", flush=True)
    res = launch(replicas, target="train", config=str(cfg_path), log_dir=str(out / "diloco_logs"), base_seed=seed)
    if not res.ok:
        raise ConfigError(f"DiLoCo training failed (exit codes {res.exit_codes}); see {out}/diloco_logs/replica<i>.log")
    r0 = out / "replica0"
    for name in ("model", "history.csv", "metrics.json"):
        src_p, dst = r0 / name, out / name
        if src_p.is_dir():
            shutil.copytree(src_p, dst, dirs_exist_ok=True)
        elif src_p.exists():
            shutil.copy2(src_p, dst)
    return json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}


def channel_flags(train_cfg: Mapping[str, Any]) -> dict[str, bool]:
    """``{channel_key: on}`` for ``train.losses`` (on = enabled and weight != 0; ``training.config.channel_spec``)."""
    from composer_plugins.training.config.loss_specs import channel_spec, losses_mapping

    losses = losses_mapping(train_cfg.get("losses"), pre="train.") or {}
    return {k: channel_spec(k, spec, pre="train.").active for k, spec in losses.items()}


def channels_label(flags: Mapping[str, bool]) -> str:
    """``grpo+hint_distill+replay`` (channels on, in config order) or ``none``."""
    return "+".join(k for k, v in flags.items() if v) or "none"
