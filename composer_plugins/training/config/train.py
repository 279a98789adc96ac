"""The training config: the schema of ``composer-plugins train|sft|eval --config``, its loading and validation.

:class:`TrainConfig` holds one self-validating section per top-level key
(:mod:`composer_plugins.training.config.sections`) plus the component specs (``env``, ``losses``, parsed by
:mod:`composer_plugins.training.config.loss_specs`);
:func:`load_train_config` reads YAML with ``key.sub=value`` overrides and ``$env`` secrets and raises a located
:class:`~composer_plugins.core.errors.ConfigError`. See docs/training.md "Config".
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from composer_plugins.core.config import (
    Config,
    apply_overrides,
    from_dict,
    load_config,
    loads_config,
    redact,
    resolve_env,
    to_dict,
)
from composer_plugins.training.config.loss_specs import (
    ChannelSpec,
    channel_spec,
    check_channel,
    losses_as_mapping,
    warn_advantage_kwargs,
)
from composer_plugins.training.config.sections import (
    ComputeSection,
    DataSection,
    EvalSection,
    HintsSection,
    MLflowSection,
    ModelSection,
    OptimSection,
    ReplaySection,
    RolloutSection,
    Section,
    SFTSection,
    TrainerSection,
)

__all__ = [
    "DEFAULT_CONFIG",
    "TrainConfig",
    "channel_spec",
    "config_to_yaml",
    "load_train_config",
    "loads_train_config",
    "train_config_from_dict",
]


@dataclass
class TrainConfig:
    """The whole ``train`` config. ``losses`` maps channel keys to ``{enabled, weight, name, **kwargs}``.

    A file may give ``losses`` as a list of ``{name, weight, label, **kwargs}`` instead (docs/losses.md):
    each item's key is its ``label``, else its ``name`` (:func:`losses_mapping`).
    """

    seed: int = 0
    output_dir: str = "runs/default"
    cache_dir: str = ".composer_cache"
    model: ModelSection = field(default_factory=ModelSection)
    env: Any = field(default_factory=lambda: {"name": "gsm8k", "difficulty": "trivial"})
    data: DataSection = field(default_factory=DataSection)
    losses: dict[str, Any] = field(default_factory=lambda: {"grpo": {"weight": 1.0}, "hint_distill": {"weight": 1.0}})
    hints: HintsSection = field(default_factory=HintsSection)
    replay: ReplaySection = field(default_factory=ReplaySection)
    sft: SFTSection = field(default_factory=SFTSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    optim: OptimSection = field(default_factory=OptimSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    compute: ComputeSection = field(default_factory=ComputeSection)
    eval: EvalSection = field(default_factory=EvalSection)
    mlflow: MLflowSection = field(default_factory=MLflowSection)
    #: Free-form settings read by wrappers of the training loop (e.g. DiLoCo replicas).
    diloco: dict[str, Any] = field(default_factory=dict)

    def validate(self, src: Config | None = None, key: str = "") -> None:
        """Every section's own checks (:meth:`Section.validate`, in field order), then what spans sections:
        the prompts of a step split over the data-parallel ranks, and the ``losses`` channels."""
        src = src if src is not None else Config()
        pre = f"{key}." if key else ""
        for f in fields(self):
            section = getattr(self, f.name)
            if isinstance(section, Section):
                section.validate(src, pre + f.name)
        devices = self.trainer.devices
        if isinstance(devices, int) and not isinstance(devices, bool) and devices > 1:
            if self.rollout.prompts_per_step % devices:
                k = self.rollout.prompts_per_step
                raise src.error(
                    pre + "rollout.prompts_per_step",
                    f"{k} prompts per step cannot be split over trainer.devices={devices} data-parallel ranks; "
                    f"use a multiple of {devices} (each rank draws prompts_per_step / devices).",
                )
        if self.rollout.advantage_kwargs:
            warn_advantage_kwargs(self.rollout.advantage_kwargs, pre + "rollout.advantage_kwargs", src)
        if not isinstance(self.losses, Mapping) or not self.losses:
            raise src.error(pre + "losses", "give at least one loss channel, e.g. {grpo: {weight: 1.0}}.")
        self._parse_channels(src, pre)
        for ch in self.channels:
            if ch.enabled:
                check_channel(ch.key, ch, src, pre)

    @property
    def channels(self) -> tuple[ChannelSpec, ...]:
        """``losses`` parsed into one :class:`ChannelSpec` per entry, in config order (parsed once, by
        :meth:`validate`, with its errors located; again only if ``losses`` changed since): what the step's
        builders, the backends' checks, the MLflow tags and run names read."""
        if getattr(self, "_parsed", (None,))[0] != self.losses:
            self._parse_channels(Config())
        return self._parsed[1]

    def _parse_channels(self, src: Config, pre: str = "") -> None:
        specs = tuple(channel_spec(k, spec, src, pre) for k, spec in self.losses.items())
        self._parsed = (copy.deepcopy(self.losses), specs)


DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


def train_config_from_dict(data: Mapping[str, Any], src: Config | None = None, key: str = "") -> TrainConfig:
    """Build a :class:`TrainConfig` from plain data, with located errors (see :func:`from_dict`)."""
    cfg = from_dict(TrainConfig, data, src, key)
    cfg.validate(src, key)
    return cfg


#: Free-form component fields whose defaults are whole specs: a file that omits one gets the default
#: spec, so an override such as ``losses.hint_distill.enabled=false`` edits it instead of replacing it.
COMPONENT_DEFAULTS: tuple[str, ...] = ("env", "losses", "hints.provider")


def _fill_component_defaults(src: Config) -> None:
    defaults = to_dict(TrainConfig())
    for key in COMPONENT_DEFAULTS:
        node: Any = src
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.get(part) if isinstance(node, Mapping) else None
            if nxt is None:
                nxt = node[part] = {}
            node = nxt
        if isinstance(node, dict) and parts[-1] not in node:
            value: Any = defaults
            for part in parts:
                value = value[part]
            node[parts[-1]] = copy.deepcopy(value)


def _finish(src: Config, overrides: Sequence[str]) -> tuple[TrainConfig, Config]:
    losses_as_mapping(src)
    _fill_component_defaults(src)
    apply_overrides(src, overrides)
    resolve_env(src, src)
    return train_config_from_dict(src, src), src


def load_train_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (), section: str | None = None
) -> tuple[TrainConfig, Config]:
    """Read ``path`` (default: the packaged ``configs/default.yaml``), apply overrides, validate.

    ``section`` selects a sub-mapping of the file (e.g. ``train`` in a DVC ``params.yaml``);
    overrides are then relative to that section. Keys the file omits take the
    :class:`TrainConfig` defaults (component specs ``env``, ``losses``, ``hints.provider``
    included, so overrides edit the default spec).
    """
    p = Path(path) if path is not None else DEFAULT_CONFIG
    if section:
        full = load_config(p)
        node = full.get_path(section)
        if not isinstance(node, Mapping):
            raise full.error(section, f"section {section!r} not found or not a mapping.", valid=list(full))
        lines = {k[len(section) + 1 :]: v for k, v in full.lines.items() if k.startswith(section + ".")}
        src = Config(dict(node), str(p), lines)
    else:
        src = load_config(p)
    return _finish(src, overrides)


def loads_train_config(text: str, overrides: Sequence[str] = ()) -> tuple[TrainConfig, Config]:
    """Like :func:`load_train_config` for YAML text."""
    return _finish(loads_config(text), overrides)


def config_to_yaml(cfg: TrainConfig) -> str:
    """The effective config as YAML (secrets redacted), for ``--print-config``."""
    import yaml

    return yaml.safe_dump(redact(to_dict(cfg)), sort_keys=False)
