"""The replica process: ``python -m composer_plugins.diloco.run --target train|toy|module:function [--config C] k=v``,
what every executor starts; the environment it sets says which replica this is (:mod:`.env`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_plugins.core.config import Config, apply_overrides, load_config, loads_config
from composer_plugins.core.errors import ComposerPluginsError, ConfigError
from composer_plugins.core.registry import import_object
from composer_plugins.diloco.common import DiLoCoConfig
from composer_plugins.diloco.env import ENV_INDEX, ENV_RESTART, ENV_SYNC_LOG

__all__ = ["check_replica_config", "load_target_config", "main"]


def load_target_config(config: str | None, overrides: Sequence[str], section: str | None = None) -> Config:
    """The config a ``toy`` or ``module:function`` target reads (``--section`` picks a top-level key)."""
    if section:
        full = load_config(config, ()) if config else Config()
        node = full.get_path(section)
        if not isinstance(node, Mapping):
            raise full.error(section, f"section {section!r} not found or not a mapping.", valid=list(full))
        cfg = Config(dict(node), full.source, {})
        apply_overrides(cfg, overrides)
        return cfg
    return load_config(config, overrides) if config else loads_config("{}", overrides=overrides)


def check_replica_config(
    target: str, config: str | None, overrides: Sequence[str] = (), section: str | None = None
) -> DiLoCoConfig:
    """Load and validate what every replica will read, once, before any starts (raising the located
    :class:`ConfigError` a replica would raise); the ``diloco:`` section."""
    if target == "train":
        from composer_plugins.training.config.train import load_train_config

        _, src = load_train_config(config, list(overrides), section=section)
        return DiLoCoConfig.from_config(src)
    cfg = load_target_config(config, overrides, section)
    if target == "toy":
        from composer_plugins.core.config import from_dict
        from composer_plugins.diloco.toy import ToyConfig

        from_dict(ToyConfig, cfg.get("toy") or {}, cfg, "toy").validate(cfg, "toy")
    elif ":" not in target:
        raise ConfigError(f"--target must be 'train', 'toy' or 'module:function', got {target!r}")
    return DiLoCoConfig.from_config(cfg)


def _run_target(target: str, config: str | None, overrides: Sequence[str], section: str | None = None) -> Any:
    if target == "train":
        from composer_plugins.diloco.replica import run_project_train

        return run_project_train(config, overrides, section=section)
    cfg = load_target_config(config, overrides, section)
    if target == "toy":
        from composer_plugins.diloco.toy import run_toy

        return run_toy(cfg)
    if not target.partition(":")[2]:
        raise ConfigError(f"--target must be 'train', 'toy' or 'module:function', got {target!r}")
    return import_object(target)(cfg)


def summary_path(sync_log: str | os.PathLike[str] | None) -> Path | None:
    """Where a replica launched with sync log ``replica<i>.sync.jsonl`` leaves its summary (``replica<i>.result.json``,
    beside it), which the launcher's closing table reads."""
    if not sync_log or not str(sync_log).endswith(".sync.jsonl"):
        return None
    return Path(str(sync_log).removesuffix(".sync.jsonl") + ".result.json")


def write_replica_summary(res: Any, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Write what the launcher's closing table shows of this replica (rounds, final loss, parameter hash, model
    path) from the target's result and the last line of its sync log; ``None`` when not launched (no sync log)."""
    e = os.environ if env is None else env
    sync_log = e.get(ENV_SYNC_LOG)
    path = summary_path(sync_log)
    if path is None:
        return None
    last: dict[str, Any] = {}
    if sync_log and os.path.exists(sync_log):
        for line in Path(sync_log).read_text().splitlines():
            with contextlib.suppress(ValueError):
                last = json.loads(line)
    if isinstance(res, Mapping):
        found = dict(res)
        metrics = {k: v for k, v in found.items() if isinstance(v, (int, float)) and k.endswith("loss")}
        model = found.get("model_dir") or found.get("model_path")
    else:
        found = {}
        metrics = {k: v for k, v in (getattr(res, "metrics", None) or {}).items() if k.endswith("loss")}
        model = getattr(res, "model_dir", None)
    name = next((k for k in ("eval_loss", "eval/loss", "train/loss", "loss") if k in metrics), None)
    name = name or next(iter(sorted(metrics)), None)
    out = {
        "replica": int(e.get(ENV_INDEX, "0")),
        "restart": int(e.get(ENV_RESTART, "0")),
        "rounds": found.get("outer_step", last.get("outer_step")),
        "loss_name": name,
        "loss": float(metrics[name]) if name else None,
        "param_hash": found.get("param_hash") or last.get("param_hash"),
        "model_path": str(model) if model else None,
    }
    path.write_text(json.dumps(out))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Replica entry: ``python -m composer_plugins.diloco.run --target train|toy|mod:fn [--config C] k=v``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m composer_plugins.diloco.run", description=main.__doc__)
    p.add_argument("--target", default="toy")
    p.add_argument("--config", default=None)
    p.add_argument("--config-inline", default=None, help="the config's YAML text (cloud jobs get it this way)")
    p.add_argument("--section", default=None)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.config_inline is not None:
        import tempfile

        fd, path = tempfile.mkstemp(prefix="composer-config-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(a.config_inline)
        a.config = path
    try:
        write_replica_summary(_run_target(a.target, a.config, a.overrides, a.section))
    except ComposerPluginsError as e:
        print(f"Error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # torchft's quorum thread and native servers can outlive the run; do not let them hold the exit.
    os._exit(code)
