"""MLflow helpers shared by every stage that trains or evaluates (nothing imports mlflow at import time).

Every stage of a study logs into one experiment of a local sqlite store (``sqlite:///mlflow.db``);
:func:`run_tags` and :func:`provenance_tags` tie a run to the code, the DVC stage and the plugins;
:func:`ensure_experiment` creates an experiment under one file lock per store. ``MLFLOW_TRACKING_URI``,
``MLFLOW_EXPERIMENT_NAME`` and ``COMPOSER_MLFLOW=0`` override ``params.yaml``: see docs/training.md "MLflow".
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from composer_plugins.core.config import redact
from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.core.plugins import get_registry
from composer_plugins.core.version import __version__

DEFAULT_EXPERIMENT = "composer-plugins"
DEFAULT_DB = "mlflow.db"

#: Tag keys written by :func:`run_tags`.
TAG_STAGE = "dvc.stage"
TAG_EXP = "dvc.exp"
TAG_COMMIT = "git.commit"
TAG_DIRTY = "git.dirty"
TAG_VARIANT = "study.variant"
TAG_SEED = "study.seed"


def repo_root(start: str | os.PathLike[str] | None = None) -> Path:
    """The DVC repository root above ``start`` (``DVC_ROOT`` when DVC runs the stage), else the cwd.

    The root is the directory holding ``.dvc/``, so a study directory with its own dvc.yaml
    (``studies/<name>/``) shares the repository's MLflow store whether DVC or a person runs the
    command there. Outside a DVC repository: the nearest dvc.yaml, then the git root.
    """
    env = os.environ.get("DVC_ROOT")
    if env:
        return Path(env)
    here = Path(start or os.getcwd()).resolve()
    for name, found in ((".dvc", Path.is_dir), ("dvc.yaml", Path.is_file), (".git", Path.exists)):
        for p in (here, *here.parents):
            if found(p / name):
                return p
    return here


def git_commit(root: str | os.PathLike[str] | None = None) -> tuple[str, bool]:
    """``(commit sha, dirty)`` of the git checkout at ``root``; ``("unknown", False)`` outside git."""
    cwd = str(root or repo_root())

    def git(*args: str, timeout: float) -> str:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=True
        ).stdout

    try:
        sha = git("rev-parse", "HEAD", timeout=10).strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown", False
    try:
        status = git("status", "--porcelain", "--untracked-files=no", timeout=20)
    except (OSError, subprocess.SubprocessError):
        status = ""
    return sha or "unknown", bool(status.strip())


def tracking_uri(params: Mapping[str, Any] | None = None, root: str | os.PathLike[str] | None = None) -> str:
    """The MLflow tracking URI: ``$MLFLOW_TRACKING_URI``, else ``params['mlflow']['tracking_uri']``, else sqlite.

    A relative ``sqlite:///file.db`` is resolved against the repository root, so every stage
    (whatever its working directory) writes into the same store.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI") or ((params or {}).get("mlflow") or {}).get("tracking_uri")
    base = Path(root) if root else repo_root()
    if not uri:
        return f"sqlite:///{(base / DEFAULT_DB).as_posix()}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        rel = uri[len("sqlite:///") :]
        return f"sqlite:///{(base / rel).resolve().as_posix()}"
    return uri


def experiment_name(params: Mapping[str, Any] | None = None) -> str:
    """``$MLFLOW_EXPERIMENT_NAME``, else ``params['mlflow']['experiment']``, else ``composer-plugins``."""
    return (
        os.environ.get("MLFLOW_EXPERIMENT_NAME")
        or ((params or {}).get("mlflow") or {}).get("experiment")
        or DEFAULT_EXPERIMENT
    )


def mlflow_enabled(params: Mapping[str, Any] | None = None) -> bool:
    """False when ``COMPOSER_MLFLOW=0`` or ``mlflow.enabled: false`` in params."""
    if os.environ.get("COMPOSER_MLFLOW", "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return bool(((params or {}).get("mlflow") or {}).get("enabled", True))


def run_tags(
    stage: str | None = None,
    *,
    variant: str | None = None,
    seed: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Tags for an MLflow run of a pipeline stage.

    Args:
        stage: DVC stage name; defaults to ``$DVC_STAGE`` (set by DVC), else ``"manual"``.
        variant: study variant (e.g. ``full``, ``no_hint``); defaults to ``$COMPOSER_VARIANT``.
        seed: study seed; defaults to ``$COMPOSER_SEED``.
        extra: more tags (values are stringified).
    """
    sha, dirty = git_commit()
    tags = {
        TAG_STAGE: stage or os.environ.get("DVC_STAGE") or "manual",
        TAG_COMMIT: sha,
        TAG_DIRTY: str(dirty).lower(),
        "mlflow.source.git.commit": sha,
    }
    if exp := os.environ.get("DVC_EXP_NAME"):
        tags[TAG_EXP] = exp
    if baseline := os.environ.get("DVC_EXP_BASELINE_REV"):
        tags["dvc.exp.baseline"] = baseline
    if variant := variant or os.environ.get("COMPOSER_VARIANT"):
        tags[TAG_VARIANT] = variant
    if seed is None and os.environ.get("COMPOSER_SEED"):
        seed = int(os.environ["COMPOSER_SEED"])
    if seed is not None:
        tags[TAG_SEED] = str(seed)
    tags.update({str(k): str(v) for k, v in (extra or {}).items()})
    return tags


def artifact_location(uri: str) -> str | None:
    """Where a new experiment of the store at ``uri`` keeps its artifacts: next to the store.

    ``sqlite:///<dir>/mlflow.db`` -> ``<dir>/mlartifacts`` (MLflow's own default, ``./mlruns`` of the
    current directory, would scatter artifacts wherever a command happened to run). File stores keep
    artifacts inside themselves and servers (``http://``) choose their own: ``None`` there.
    """
    db = _sqlite_path(uri)
    return (db.resolve().parent / "mlartifacts").as_uri() if db is not None else None


def _sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///") :])
    return db if db.is_absolute() else repo_root() / db


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<db>.lock`` beside a sqlite store (nothing for other stores).

    MLflow creates and migrates a sqlite store's schema on first use, and two processes doing it at
    once fail (``duplicate column name``); two creating one experiment get ``RESOURCE_ALREADY_EXISTS``.
    Servers (``http://``) serialise that themselves.
    """
    db = _sqlite_path(uri)
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; run the first cell alone there
        fcntl = None  # type: ignore[assignment]
    if db is None or fcntl is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def client(uri: str) -> Any:
    """An ``MlflowClient`` for ``uri`` whose store exists (schema created under :func:`store_lock`)."""
    from mlflow.tracking import MlflowClient

    with store_lock(uri):  # opening the store creates/migrates a sqlite schema: once, under the lock
        c = MlflowClient(tracking_uri=uri)
        c.search_experiments(max_results=1)
    return c


def ensure_experiment(client: Any, name: str, uri: str) -> str:
    """The id of experiment ``name`` in ``client``'s store, created with :func:`artifact_location` if missing."""
    with store_lock(uri):
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return str(exp.experiment_id)
        return str(client.create_experiment(name, artifact_location=artifact_location(uri)))


def dvc_exp_suffix() -> str:
    """`` [<dvc exp name>]`` inside ``dvc exp run`` (DVC sets ``DVC_EXP_NAME``), else ``""``.

    Run names carry it so an experiment's runs are told apart from the baseline's in ``mlflow ui``.
    """
    exp = os.environ.get("DVC_EXP_NAME")
    return f" [{exp}]" if exp else ""


def run_name(what: str, *, given: str | None = None) -> str:
    """The MLflow run name: ``given`` (``mlflow.run_name``), else ``what``; plus :func:`dvc_exp_suffix`.

    ``what`` says what the run is, e.g. ``train@full-s0`` (a study cell), ``train@default-s0
    (grpo+hint_distill)`` (a plain ``composer-plugins train`` with ``output_dir=runs/default``),
    ``sft-s0``, ``eval@no_hint-s1``. MLflow's random names (seeded by the run's own seed, so two
    runs got the same one) are never used.
    """
    return (given or what) + dvc_exp_suffix()


def provenance_tags(components: Mapping[str, tuple[str, str]]) -> dict[str, str]:
    """``plugin.<slot>`` tags: which registry entry, distribution and version supplied each component.

    ``components`` maps a slot (``losses.grpo``, ``env``) to ``(kind, name or class path)``; a
    registry name is tagged ``<name> (<distribution> <version>)``, a class path as given. Also tags
    ``composer_plugins.version``.
    """
    reg = get_registry()
    tags = {"composer_plugins.version": __version__}
    for slot, (kind, name) in components.items():
        try:
            e = reg.get(kind, name)
            prov = e.provider or "unknown distribution"
            tags[f"plugin.{slot}"] = f"{e.name} ({prov})"
        except ComposerPluginsError:
            tags[f"plugin.{slot}"] = name
    return tags


def flatten(d: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are kept as values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key, sep))
        else:
            out[key] = v
    return out


def log_kernel_pick(logger: Any, pick: Any) -> dict[str, str]:
    """Report the LM-head kernels a run picked (:class:`~composer_plugins.kernels.select.KernelPick`): one line in
    the run's log and its params in the experiment logger (MLflow's, when ``logger`` has ``log_hyperparams``)."""
    params = pick.params()
    logging.getLogger("composer_plugins.training").info(
        "compute.kernels=%s: %s (chunk %d rows; %s)", pick.setting, pick.kernels, pick.chunk_size, pick.reason
    )
    if logger is not None and hasattr(logger, "log_hyperparams"):
        try:
            logger.log_hyperparams(params)
        except Exception as exc:  # a resumed MLflow run refuses a changed value: the log line still has it
            logging.getLogger("composer_plugins.training").warning("kernel pick not logged as params: %s", exc)
    return params


# -- a training run's MLflow logger, from its TrainConfig ------------------------------------------------------


def mlflow_settings(cfg: Any) -> dict[str, Any] | None:
    """``{tracking_uri, experiment, tags}`` of a :class:`~composer_plugins.training.config.train.TrainConfig` when
    MLflow logging is on (:func:`mlflow_enabled`)."""

    params = {"mlflow": {k: v for k, v in asdict(cfg.mlflow).items() if v is not None}}
    if not mlflow_enabled(params):
        return None
    tags = run_tags(seed=cfg.seed)
    tags.update(provenance_tags(config_components(cfg)))
    tags.update({str(k): str(v) for k, v in redact(cfg.mlflow.tags).items()})
    return {"tracking_uri": tracking_uri(params), "experiment": experiment_name(params), "tags": tags}


def config_components(cfg: Any) -> dict[str, tuple[str, str]]:
    """``{slot: (kind, name)}`` of the env and the active loss channels (for provenance tags)."""
    out: dict[str, tuple[str, str]] = {}
    env = cfg.env
    if isinstance(env, Mapping):
        out["env"] = ("envs", str(env.get("name") or env.get("class_path") or "?"))
    elif isinstance(env, str):
        out["env"] = ("envs", env)
    for ch in cfg.channels:
        if ch.active:
            out[f"losses.{ch.key}"] = ("losses", str(ch.kwargs.get("class_path") or ch.name))
    return out


def default_run_name(cfg: Any) -> str:
    """``train@<output_dir name>-s<seed> (<active channel keys joined by +, or none>)``: a plain ``train`` run."""
    channels = "+".join(ch.key for ch in cfg.channels if ch.active) or "none"
    return f"train@{Path(cfg.output_dir).name}-s{cfg.seed} ({channels})"


def build_logger(cfg: Any) -> Any:
    """Lightning's ``MLFlowLogger`` for ``cfg.mlflow``, or ``False`` when MLflow is off."""
    s = mlflow_settings(cfg)
    if s is None:
        return False
    from lightning.pytorch.loggers import MLFlowLogger

    # the store and experiment exist before Lightning's logger looks them up (cells started together)
    ensure_experiment(client(s["tracking_uri"]), s["experiment"], s["tracking_uri"])
    return MLFlowLogger(
        experiment_name=s["experiment"],
        tracking_uri=s["tracking_uri"],
        run_name=run_name(default_run_name(cfg), given=cfg.mlflow.run_name),
        tags=s["tags"],
        log_model=cfg.mlflow.log_checkpoints,
        artifact_location=artifact_location(s["tracking_uri"]),
    )
