"""Making a training run one DiLoCo replica: the callback for a config (either transport) and the project's
``train`` target. :mod:`.run` is the replica process's entry point; :mod:`.toy` the toy target.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_plugins.core.config import Config
from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
from composer_plugins.diloco.glue import DiLoCoCallbackBase
from composer_plugins.diloco.transports import get_transport

__all__ = ["diloco_callback_from_config", "replica_train_overrides", "run_project_train"]


def diloco_callback_from_config(
    cfg: Config | Mapping[str, Any], env: Mapping[str, str] | None = None, *, force: bool = False
) -> DiLoCoCallbackBase | None:
    """The DiLoCo callback of ``diloco.transport`` for a training config, or ``None`` when this process is not a
    replica: no lighthouse or store known (``diloco.lighthouse``, or the launcher's environment) and not ``force``.
    """
    dcfg = DiLoCoConfig.from_config(cfg)
    replica = ReplicaInfo.from_env(env)
    if not (force or dcfg.lighthouse or replica.active):
        return None
    return get_transport(dcfg.transport).callback(dcfg, replica)


def replica_train_overrides(src: Config, replica: ReplicaInfo) -> list[str]:
    """Overrides that make the project's ``train`` config one replica of a DiLoCo job (docs/diloco.md, the end of
    "Configuration")."""
    base = str(src.get_path("output_dir", "runs/default"))
    seed = replica.seed if replica.seed is not None else int(src.get_path("seed", 0) or 0) + replica.index
    out = [f"seed={seed}", f"output_dir={base}/replica{replica.index}", "trainer.checkpoint_every_n_steps=0"]
    uses_checkpoints = "checkpoint_dir" not in get_transport(str(src.get_path("diloco.transport", "torchft"))).ignored
    if uses_checkpoints and src.get_path("diloco.checkpoint_dir") is None:
        out.append(f"diloco.checkpoint_dir={base}/diloco_checkpoints")
    if replica.index != 0:
        out += ["eval.at_start=false", "eval.at_end=false"]
    return out


def run_project_train(config: str | None, overrides: Sequence[str] = (), *, section: str | None = None) -> Any:
    """One replica of the project's ``train`` run (``ComposerModule``) with :class:`DiLoCoCallback` added."""
    try:
        from composer_plugins.training.config.train import load_train_config
        from composer_plugins.training.runs.run import run_train
    except ImportError as e:
        raise ComposerPluginsError(f"the project's training module is not available ({e}). HINT: --target toy") from e
    replica = ReplicaInfo.from_env()
    _, src = load_train_config(config, list(overrides), section=section)
    cfg, src = load_train_config(config, [*overrides, *replica_train_overrides(src, replica)], section=section)
    cb = diloco_callback_from_config(src, force=True)
    assert cb is not None
    res = run_train(cfg, src, extra_callbacks=[cb])
    summary = {
        "replica": replica.index,
        "restart": replica.restart,
        "seed": cfg.seed,
        "output_dir": cfg.output_dir,
        "outer_step": cb.history[-1]["outer_step"] if cb.history else 0,
        "heal_count": cb.heal_count,
        "bytes_allreduced": cb.bytes_allreduced,
        "param_hash": cb.history[-1].get("param_hash") if cb.history else None,
        "metrics": res.metrics,
    }
    Path(res.output_dir, "diloco.json").write_text(json.dumps(summary, indent=2))
    return res
