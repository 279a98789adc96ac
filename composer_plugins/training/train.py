"""The documented public entry points of the training stack, under the name users import them by.

``from composer_plugins.training.train import load_train_config, run_train`` (docs/training.md, third-party
plugins and backends written against earlier releases) keeps working: this module only re-exports.
The code lives in rooms of one purpose: the config schema, loading and validation in
:mod:`~composer_plugins.training.config`; the component builders in :mod:`~composer_plugins.training.builders`;
policy resolution in :mod:`~composer_plugins.training.policy`; the SFT warm start in
:mod:`~composer_plugins.training.sft`; the strategy in :mod:`~composer_plugins.training.strategy`; the
``Trainer`` factory in :mod:`~composer_plugins.training.trainer`; the runs in :mod:`~composer_plugins.training.run`.
Nothing inside ``composer_plugins`` imports this module.
"""

from __future__ import annotations

from composer_plugins.training.builders import build_channels, build_env, build_generator, build_hint_provider
from composer_plugins.training.config import (
    DEFAULT_CONFIG,
    TrainConfig,
    channel_spec,
    config_to_yaml,
    load_train_config,
    loads_train_config,
    train_config_from_dict,
)
from composer_plugins.training.policy import load_policy_for, resolve_policy
from composer_plugins.training.run import RunResult, run_eval, run_sft, run_train
from composer_plugins.training.trainer import build_trainer, lightning_trainer

__all__ = [
    "DEFAULT_CONFIG",
    "RunResult",
    "TrainConfig",
    "build_channels",
    "build_env",
    "build_generator",
    "build_hint_provider",
    "build_trainer",
    "channel_spec",
    "config_to_yaml",
    "lightning_trainer",
    "load_policy_for",
    "load_train_config",
    "loads_train_config",
    "resolve_policy",
    "run_eval",
    "run_sft",
    "run_train",
    "train_config_from_dict",
]
