"""Input files and paths named by a train config, checked when a command starts (before any model).

Task files, preference pairs and a local ``model.name_or_path`` are checked through the one JSONL reader;
each problem reads ``<file>:<line>: <key>: <problem> — <fix>`` with where the key is set. Values are checked
apart, when the config loads (:meth:`composer_plugins.training.config.sections.Section.validate`), so
``--print-config`` needs none of these files.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from composer_plugins.core.config import Config, component_spec
from composer_plugins.core.errors import ComposerPluginsError, ConfigError, closest
from composer_plugins.core.io import iter_jsonl
from composer_plugins.core.plugins import get_registry
from composer_plugins.core.registry import import_object
from composer_plugins.training.rollout.chat import PROMPT_KEYS

if TYPE_CHECKING:
    from composer_plugins.training.config.train import TrainConfig

__all__ = [
    "check_checkpoint",
    "check_data_file",
    "check_fresh_output_dir",
    "check_hub_id",
    "check_inputs",
    "check_model_path",
    "checkpoint_step",
    "env_task_fields",
    "hub_unreachable",
]

PAIR_KEYS = ("prompt", "chosen", "rejected")


def _set_at(src: Config, key: str) -> str:
    ov = src.override_of(key)
    if ov is not None:
        return f"command-line override {ov!r}"
    line = src.line_of(key)
    if src.source:
        return f"{src.source}:{line}" if line else str(src.source)
    return "the config"


def _row_keys(row: Mapping[str, Any], names: Sequence[str], skip: Sequence[str] = ()) -> tuple[list[str], str]:
    """A row's keys, sorted, and `` Did you mean: 'x'?`` for the first of them close to one of ``names``."""
    keys = sorted(map(str, row))
    near = [c for k in keys if k not in skip for c in closest(k, names)]
    return keys, f" Did you mean: {near[0]!r}?" if near else ""


def check_data_file(path: str, src: Config, key: str, kind: str = "tasks", fields: Sequence[TaskField] = ()) -> int:
    """Read the JSONL file at ``path`` (``kind``: ``tasks`` or ``pairs``); return its row count, or raise.

    ``fields`` (:data:`TaskField`) are what every task row must carry besides the prompt (a tuple field
    means one of its names, as ``Env.task_fields``); a row without one is refused naming the file, the
    line and the field, once the whole file has parsed (the first of ``fields`` some row lacks, at its first such row).
    """
    where = _set_at(src, key)
    example = (
        '{"prompt": "...", "answer": "..."}'
        if kind == "tasks"
        else '{"prompt": "...", "chosen": "...", "rejected": "..."}'
    )
    p = Path(path).expanduser()
    if not p.exists():
        near = closest(p.name, [c.name for c in p.parent.glob("*.jsonl")]) if p.parent.is_dir() else []
        hint = f" Did you mean: {', '.join(repr(str(p.parent / n)) for n in near)}?" if near else ""
        raise src.error(
            key, f"{path} does not exist — give the path of a JSONL file of {kind}, one {example} per line.{hint}"
        )
    if p.is_dir():
        raise src.error(key, f"{path} is a directory — give the path of a JSONL file of {kind}.")

    def error(file: str, line: int | None, message: str) -> Exception:
        return ConfigError(
            f"{message} — fix this line (one {example} object per line) or point {key} ({where}) at another file.",
            key=key,
            file=file,
            line=line,
        )

    n = 0
    first_missing: dict[int, ConfigError] = {}
    for lineno, row in iter_jsonl(p, path, error=error):
        n += 1
        if kind == "tasks":
            if not any(k in row for k in PROMPT_KEYS):
                keys, sugg = _row_keys(row, PROMPT_KEYS)
                raise ConfigError(
                    f'missing — every task of {key} needs a "prompt" (or "question") field; this line has '
                    f"{keys}.{sugg}",
                    key="prompt",
                    file=path,
                    line=lineno,
                )
            for i, need in enumerate(fields):
                if i not in first_missing:
                    err = _missing_field(row, need, path, lineno, key)
                    if err is not None:
                        first_missing[i] = err
        else:
            missing = [k for k in PAIR_KEYS if k not in row]
            if missing:
                keys, sugg = _row_keys(row, missing, skip=PAIR_KEYS)
                raise ConfigError(
                    f"missing — every pair of {key} needs prompt, chosen and rejected; this line has {keys}.{sugg}",
                    key=", ".join(missing),
                    file=path,
                    line=lineno,
                )
    if first_missing:
        raise first_missing[min(first_missing)]
    if n == 0:
        raise ConfigError(
            f"holds no {kind} (the file is empty) — add one {example} object per line, or unset {key} ({where}).",
            key=key,
            file=path,
        )
    return n


#: ``(field or (one of fields), what reads it, how to fix a row without it)``.
TaskField = tuple[str | tuple[str, ...], str, str]


def _missing_field(row: Mapping[str, Any], need: TaskField, path: str, lineno: int, key: str) -> ConfigError | None:
    """The error for a task row without ``need`` (``file:line: field: missing — fix``), or ``None``."""
    field, why, fix = need
    names = (field,) if isinstance(field, str) else tuple(field)
    if any(n in row for n in names):
        return None
    keys, sugg = _row_keys(row, names)
    spelled = " or ".join(f'"{n}"' for n in names)
    return ConfigError(
        f"missing — every task of {key} needs {spelled} for {why}; this line has {keys} — {fix}.{sugg}",
        key=names[0],
        file=path,
        line=lineno,
    )


def env_task_fields(cfg: TrainConfig, src: Config) -> tuple[tuple[str | tuple[str, ...], ...], str]:
    """``(Env.task_fields, "env 'name'")`` of the env ``cfg.env`` names, without building it.

    An env that cannot be resolved here gives no fields: building it reports that problem, located.
    """
    try:
        target, _ = component_spec(cfg.env, "env", src)
        if target.startswith("class_path:"):
            factory = import_object(target.split(":", 1)[1])
            label = f"env {target.rpartition('.')[2]!r}"
        else:
            factory = get_registry().get("envs", target).factory
            label = f"env {target!r}"
    except (ComposerPluginsError, ImportError, AttributeError, ValueError):
        return (), "the env"
    return tuple(getattr(factory, "task_fields", ()) or ()), label


def _looks_local(name: str) -> bool:
    """A filesystem path rather than a hub id (``org/name``)."""
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
        or Path(name).expanduser().exists()
    )


#: The ways out of a hub id that cannot be loaded, for every message that refuses one.
HUB_WAYS_OUT = (
    "give a local directory written by save_pretrained, download the model once where the hub is reachable "
    "(`hf download {name}`) into the Hugging Face cache (or point HF_HOME at a cache that holds it), or "
    "'tiny' for the embedded model"
)


def _offline() -> bool:
    from huggingface_hub import constants

    check = getattr(constants, "is_offline_mode", None)
    on = check() if callable(check) else bool(getattr(constants, "HF_HUB_OFFLINE", False))
    return on or os.environ.get("TRANSFORMERS_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def check_hub_id(name: str, src: Config, key: str) -> None:
    """Offline (``HF_HUB_OFFLINE``), a hub id must be in the Hugging Face cache: refuse it now if it is not.

    Online, the loader downloads it; if the hub cannot be reached then, the loader's error names the
    id and these same ways out (:class:`composer_plugins.models.tiny.PolicyLoadError`).
    """
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return
    offline = _offline()
    try:
        hit = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid repo id: the loader says why
        return
    if isinstance(hit, str):
        return
    ways = HUB_WAYS_OUT.format(name=name)
    uncached = f"{name!r} is a hub id that is not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and"
    if offline:
        msg = f"HF_HUB_OFFLINE is set, so it cannot be downloaded — {ways}, or unset HF_HUB_OFFLINE to download it now."
        raise src.error(key, f"{uncached} {msg}")
    if unreachable := hub_unreachable():  # fail now, not after a minute of the loader's retries
        msg = f"the hub cannot be reached ({unreachable}), so it cannot be downloaded — {ways}"
        raise src.error(key, f"{uncached} {msg}, or check the network (HF_ENDPOINT, a proxy in HTTPS_PROXY).")


#: Seconds :func:`hub_unreachable` waits for a TCP connection to the hub.
HUB_PROBE_TIMEOUT_S = 3.0


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the Hugging Face hub (``HF_ENDPOINT``) cannot be reached, or ``None`` when a TCP connection opens.

    One connection attempt with a short timeout (the loader's own requests retry for about a minute).
    Behind a proxy (``HTTPS_PROXY``/``HTTP_PROXY``/``ALL_PROXY``) nothing is probed: ``None``.
    """

    from huggingface_hub import constants

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")):
        return None
    endpoint = str(getattr(constants, "ENDPOINT", "https://huggingface.co"))
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return f"{parts.scheme}://{host}:{port}: {e.strerror or type(e).__name__}"


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The optimizer step in a checkpoint's name (``step=12.ckpt`` -> 12), or -1 (``last.ckpt``)."""
    m = re.search(r"step=(\d+)", Path(path).name)
    return int(m.group(1)) if m else -1


def check_fresh_output_dir(cfg: TrainConfig, src: Config, pre: str = "") -> None:
    """``train`` without ``--resume``/``--overwrite`` refuses an ``output_dir`` that holds an earlier run's
    checkpoints (it would start over and overwrite them and its ``history.csv``), located at ``output_dir``."""
    ckpts = sorted(Path(cfg.output_dir, "checkpoints").glob("*.ckpt"))
    if not ckpts:
        return
    step = max(checkpoint_step(p) for p in ckpts)
    at = f" (the last at step {step})" if step >= 0 else ""
    raise src.error(
        pre + "output_dir",
        f"{cfg.output_dir} already holds checkpoints of an earlier run{at} — "
        "continue it with `--resume last`, start over with `--overwrite` (deletes "
        "its checkpoints and history.csv), or give a new output_dir.",
    )


def check_checkpoint(checkpoint: str, key: str = "--checkpoint") -> None:
    """``eval --checkpoint``: a ``.ckpt`` file, a ``save_pretrained`` directory or a hub id, checked as
    :func:`check_model_path` checks ``model.name_or_path`` (a missing path is named with the fix)."""
    src = Config()
    if str(checkpoint).endswith(".ckpt"):
        p = Path(checkpoint).expanduser()
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "does not exist"
            raise src.error(
                key,
                f"{checkpoint} {what} — give a Lightning checkpoint file (e.g. "
                "<output_dir>/checkpoints/last.ckpt), a directory written by save_pretrained "
                "(<output_dir>/model) or a hub id.",
            )
        return
    check_model_path(str(checkpoint), src, key)


def check_model_path(name: str, src: Config, key: str) -> None:
    """A local ``model.name_or_path`` must be a directory that exists; a hub id must be loadable offline."""
    if name == "tiny":
        return
    if not _looks_local(name):
        check_hub_id(name, src, key)
        return
    p = Path(name).expanduser()
    if not p.exists():
        raise src.error(
            key,
            f"{name} does not exist — give a directory written by save_pretrained, a hub id "
            "such as Qwen/Qwen2.5-0.5B-Instruct, or 'tiny' for the embedded model.",
        )
    if p.is_file():
        raise src.error(key, f"{name} is a file — give the directory that holds config.json (save_pretrained).")


def check_inputs(cfg: TrainConfig, src: Config, pre: str = "") -> None:
    """Every path of ``cfg`` that the run will read, checked now."""
    check_model_path(str(cfg.model.name_or_path), src, pre + "model.name_or_path")
    paths = (("data.train_path", cfg.data.train_path), ("data.test_path", cfg.data.test_path))
    env_fields, env = env_task_fields(cfg, src) if any(v for _, v in paths) else ((), "the env")
    fix = "add it to this line, or set env to the env these tasks are for"
    reward: list[TaskField] = [(f, f"the reward of {env}", fix) for f in env_fields]
    for key, value in paths:
        if value:
            fields = list(reward)
            if key == "data.train_path" and cfg.sft.enabled:
                at = (
                    _set_at(src, pre + "sft.enabled")
                    if src.line_of(pre + "sft.enabled") or src.override_of(pre + "sft.enabled")
                    else "the default"
                )
                fields.append(
                    (
                        ("target", "solution"),
                        f"the SFT warm start (sft.enabled is on: {at})",
                        "add a worked solution to this line, or set sft.enabled: false and start from an "
                        "already fine-tuned model.name_or_path",
                    )
                )
            check_data_file(str(value), src, pre + key, "tasks", fields)
    if cfg.replay.pairs_path:
        check_data_file(str(cfg.replay.pairs_path), src, pre + "replay.pairs_path", "pairs")
