"""What the DVC stages share: their paths, JSONL writing, file hashes, located params errors and table text."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from composer_plugins.core.config import Config
from composer_plugins.core.errors import ConfigError
from composer_plugins.core.io import atomic_write_jsonl

#: The splits prepare writes per env.
SPLITS = ("train", "test")
#: Paths of the replay stage (relative to the repository root).
PATHS_REPLAY = {"traces": "data/traces.jsonl", "cache": "data/teacher_cache/cache.sqlite", "out": "data/replay"}

#: Where each stage writes (relative to the repository root).
PATHS = {
    "data": "data/tasks",
    "sft_model": "models/sft/model",
    "traces": "data/traces.jsonl",
    "pairs": "data/pairs.jsonl",
    "runs": "runs",
    "evals": "evals",
}


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]]) -> int:
    """Write ``rows`` as JSONL atomically (parents created, keys sorted); returns the number of rows."""
    return atomic_write_jsonl(path, rows, sort_keys=True, default=str)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def section(params: Mapping[str, Any], key: str, known: Sequence[str] | None = None) -> dict[str, Any]:
    """``params[key]`` as a dict (``{}`` when absent); with ``known``, a located error for a key outside it."""
    node = params.get(key)
    if node is None:
        return {}
    if not isinstance(node, Mapping):
        raise param_error(params, key, f"must be a mapping, got {type(node).__name__}")
    unknown = sorted(set(node) - set(known)) if known is not None else []
    if unknown:
        raise param_error(params, f"{key}.{unknown[0]}", "unknown key.", valid=known)
    return dict(node)


def param_error(params: Mapping[str, Any], key: str, msg: str, valid: Sequence[str] | None = None) -> ConfigError:
    if isinstance(params, Config):
        return params.error(key, msg, valid)
    return ConfigError(msg, key=key, valid=valid)


def env_key(spec: Any) -> str:
    """The key an env spec is filed under (``data/tasks/<key>``): its name, or ``env``."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        return str(spec.get("name") or "env")
    return "env"


def is_num(v: Any) -> bool:
    """True for an int or float that is not a bool."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def md_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table: the header, its rule and one line per row."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: each column padded to its widest cell, a rule of dashes under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = [
        "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)
