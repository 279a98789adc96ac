"""Components built from a :class:`~composer_plugins.training.config.train.TrainConfig`: one function per part.

The env, the rollout generator, the hint provider and the loss channels come from the plugin registry
(:func:`~composer_plugins.core.config.build_component`); the MLflow settings, tags, run name and logger from
``mlflow``. The optimizer and strategy have modules of their own (``optim``, ``strategy``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from composer_plugins.core.config import Config, redact
from composer_plugins.core.errors import ConfigError
from composer_plugins.training.config.loss_specs import CHANNEL_KEYS, advantage_estimator
from composer_plugins.training.config.train import TrainConfig, channel_spec


def build_env(cfg: TrainConfig, src: Config | None = None) -> Any:
    """The env named by ``cfg.env`` (registry kind ``envs``)."""
    from composer_plugins.core.config import build_component

    return build_component("envs", cfg.env, key="env", cfg=src)


def build_generator(cfg: TrainConfig, src: Config | None = None, env: Any = None) -> Any:
    """The rollout generator named by ``rollout.generator`` (registry kind ``rollout_generators``).

    With ``rollout.max_turns > 1`` and an ``env`` that has ``reset``/``step``, it is wrapped in the
    ``multi_turn`` generator (:class:`~composer_plugins.training.rollout.multiturn.MultiTurnGenerator`).
    """
    from composer_plugins.core.config import build_component
    from composer_plugins.training.rollout.rollouts import HFGenerator, as_rollout_generator

    spec = cfg.rollout.generator if cfg.rollout.generator is not None else "hf"
    gen = as_rollout_generator(build_component("rollout_generators", spec, key="rollout.generator", cfg=src), src=src)
    if isinstance(gen, HFGenerator) and not (isinstance(spec, Mapping) and "compile" in spec):
        gen.compile = cfg.rollout.compile
    if cfg.rollout.max_turns > 1 and hasattr(env, "reset") and hasattr(env, "step"):
        from composer_plugins.training.rollout.multiturn import MultiTurnGenerator

        gen = MultiTurnGenerator(gen, max_turns=cfg.rollout.max_turns)
    return gen


def configured_hint_provider(cfg: TrainConfig, src: Config | None = None) -> Any:
    """The hint provider named by ``cfg.hints.provider`` (registry kind ``hints``), on the request contract
    (:func:`composer_plugins.envs.hints.build_hint_provider` builds one from a spec or an object)."""
    from composer_plugins.core.config import build_component
    from composer_plugins.envs.hints import as_hint_provider

    if cfg.hints.provider is None:
        raise (src or Config()).error("hints.provider", "a hint-distillation channel is on but no provider is set.")
    return as_hint_provider(build_component("hints", cfg.hints.provider, key="hints.provider", cfg=src))


def build_channels(cfg: TrainConfig, src: Config | None = None) -> list[Any]:
    """The enabled loss channels of ``cfg.losses`` (disabled ones are not built at all)."""
    import inspect

    from composer_plugins.core.errors import UnknownPluginError
    from composer_plugins.core.plugins import get_registry
    from composer_plugins.training.step.assemble import _channel_inputs

    src = src if src is not None else Config()
    reg = get_registry()
    out = []
    for key, spec in cfg.losses.items():
        enabled, name, weight, kw = channel_spec(key, spec, src)
        kw.pop("advantage", None)  # not the channel's: its advantage estimator, attached below
        if not enabled:
            continue
        where = f"losses.{key}"
        if "class_path" in kw:
            from composer_plugins.core.config import build_component

            spec_cp = {"class_path": kw.pop("class_path"), "init_args": kw.pop("init_args", {})}
            if kw:
                raise src.error(
                    f"{where}.{sorted(kw)[0]}",
                    "unknown key next to class_path.",
                    valid=[*CHANNEL_KEYS, "class_path", "init_args"],
                )
            out.append(build_component("losses", spec_cp, key=where, cfg=src, weight=weight, name=key))
            continue
        try:
            entry = reg.get("losses", name)
        except UnknownPluginError as e:
            raise src.error(where if name == key else f"{where}.name", str(e)) from e
        try:
            sig = inspect.signature(entry.factory)
            params = sig.parameters
            accepts_var = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            params, accepts_var = {}, True  # type: ignore[assignment]
        if not accepts_var:
            valid = [p for p in params if p not in ("self", "args", "kwargs")]
            for k in kw:
                if k not in params:
                    raise src.error(
                        f"{where}.{k}", f"loss channel {name!r} has no parameter {k!r}.", valid=[*CHANNEL_KEYS, *valid]
                    )
        from composer_plugins.core.config import build_located

        out.append(build_located(entry, {**kw, "weight": weight, "name": key}, where, src))
    for ch in out:  # the channel's own advantages (losses.<key>.advantage), read by ChannelComposer
        adv = channel_spec(ch.name, cfg.losses[ch.name], src).kwargs.get("advantage")
        if adv is not None and "advantages" not in _channel_inputs(ch):
            raise src.error(f"losses.{ch.name}.advantage", "this channel reads no advantages; remove its estimator.")
        if adv is not None:
            ch.advantage_estimator = advantage_estimator(adv, f"losses.{ch.name}.advantage", src)
    return out


def mlflow_settings(cfg: TrainConfig) -> dict[str, Any] | None:
    """``{tracking_uri, experiment, tags}`` when MLflow logging is on (``COMPOSER_MLFLOW=0`` turns it off)."""
    if os.environ.get("COMPOSER_MLFLOW", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    if not cfg.mlflow.enabled:
        return None
    from composer_plugins.training.lightning import tracking

    params = {"mlflow": {k: v for k, v in asdict(cfg.mlflow).items() if v is not None}}
    uri = tracking.tracking_uri(params)
    exp = tracking.experiment_name(params)
    tags = tracking.run_tags(seed=cfg.seed)
    tags.update(tracking.provenance_tags(config_components(cfg)))
    tags.update({str(k): str(v) for k, v in redact(cfg.mlflow.tags).items()})
    return {"tracking_uri": uri, "experiment": exp, "tags": tags}


def config_components(cfg: TrainConfig) -> dict[str, tuple[str, str]]:
    """``{slot: (kind, name)}`` of the env and the active loss channels (for provenance tags)."""
    out: dict[str, tuple[str, str]] = {}
    env = cfg.env
    if isinstance(env, Mapping):
        out["env"] = ("envs", str(env.get("name") or env.get("class_path") or "?"))
    elif isinstance(env, str):
        out["env"] = ("envs", env)
    for key, spec in cfg.losses.items():
        try:
            ch = channel_spec(key, spec)
        except ConfigError:
            continue
        if ch.active:
            out[f"losses.{key}"] = ("losses", str(ch.kwargs.get("class_path") or ch.name))
    return out


def channels_label(cfg: TrainConfig) -> str:
    """``grpo+hint_distill`` (active channel keys in config order) or ``none``."""
    on = []
    for key, spec in cfg.losses.items():
        try:
            if channel_spec(key, spec).active:
                on.append(key)
        except ConfigError:
            continue
    return "+".join(on) or "none"


def default_run_name(cfg: TrainConfig) -> str:
    """``train@<output_dir name>-s<seed> (<channels>)``: what a plain ``composer-plugins train`` run is."""
    return f"train@{Path(cfg.output_dir).name}-s{cfg.seed} ({channels_label(cfg)})"


def build_logger(cfg: TrainConfig) -> Any:
    """Lightning's ``MLFlowLogger`` for ``cfg.mlflow``, or ``False`` when MLflow is off."""
    s = mlflow_settings(cfg)
    if s is None:
        return False
    from lightning.pytorch.loggers import MLFlowLogger

    from composer_plugins.training.lightning import tracking

    # the store and experiment exist before Lightning's logger looks them up (cells started together)
    tracking.ensure_experiment(tracking.client(s["tracking_uri"]), s["experiment"], s["tracking_uri"])
    return MLFlowLogger(
        experiment_name=s["experiment"],
        tracking_uri=s["tracking_uri"],
        run_name=tracking.run_name(default_run_name(cfg), given=cfg.mlflow.run_name),
        tags=s["tags"],
        log_model=cfg.mlflow.log_checkpoints,
        artifact_location=tracking.artifact_location(s["tracking_uri"]),
    )
