"""The pairs stage: agreement-k extraction and data-juicer normalisation from the teacher cache."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from composer_plugins.core.io import atomic_write_json, is_wall_clock
from composer_plugins.pipeline.common import param_error, section

PAIRS_KEYS = ("k", "compare", "normalize", "recipe")


def pairs(
    params: Mapping[str, Any],
    traces: str | os.PathLike[str],
    cache: str | os.PathLike[str],
    out: str | os.PathLike[str],
) -> dict[str, Any]:
    """Preference pairs from the replay stage's teacher cache, without paying for any call.

    The teachers of ``replay.teachers`` are replayed over ``traces`` against a copy of ``cache``
    (the replay stage's output stays byte-identical) with a zero budget, so every answer comes
    from the cache: a paid teacher whose answer is missing is refused, never called; free local
    teachers such as ``oracle`` simply answer. Then agreement-k extraction (``pairs.k``,
    ``pairs.compare``) and, if ``pairs.normalize``, the data-juicer recipe (``pairs.recipe`` or
    the shipped one). Writes ``out`` and ``<out stem>.stats.json``.
    """
    from composer_plugins.core.config import Config as _Config
    from composer_plugins.core.config import resolve_env
    from composer_plugins.teachers.runner import parse_config, run_replay

    p = section(params, "pairs", PAIRS_KEYS)
    replay = section(params, "replay")
    if not replay.get("teachers"):
        raise param_error(params, "replay.teachers", "at least one teacher is required (e.g. [{name: oracle}])")
    lines = {k[len("replay.") :]: v for k, v in getattr(params, "lines", {}).items() if k.startswith("replay.")}
    rc_data = {
        **{k: v for k, v in replay.items() if k not in ("output", "normalize", "consensus", "cache", "budget")},
        "traces": [str(traces)],
        "consensus": {"k": int(p.get("k", 2)), "compare": p.get("compare", "text")},
        "cache": {"path": str(cache)},
        "budget": {"max_usd": 0.0, "fresh": True, "durable_reservations": False},
        "normalize": {
            "enabled": bool(p.get("normalize", True)),
            **({"recipe": p["recipe"]} if p.get("recipe") else {}),
        },
        "output": {"pairs": str(out)},
        "run_id": "pipeline-pairs",
        "progress": False,
    }
    with tempfile.TemporaryDirectory(prefix="pairs-cache-") as td:
        # Work on a copy: the replay stage's cache is its DVC output and must stay byte-identical
        # (the engine writes a spend ledger and a lock file next to the database).
        if Path(cache).exists():
            shutil.copy2(cache, Path(td) / "cache.sqlite")
        rc_data["cache"] = {"path": str(Path(td) / "cache.sqlite")}
        src = _Config(rc_data, getattr(params, "source", None), lines)
        resolve_env(src, src)  # `{$env: NAME}` teacher settings, resolved only here and never written out
        rc = parse_config(src)
        summary = run_replay(rc, src)
    stats_path = Path(out).with_suffix(".stats.json")
    atomic_write_json(stats_path, _pinned(summary), sort_keys=True, default=str)
    return summary


def _pinned(obj: Any) -> Any:
    """``obj`` as the stage's DVC-pinned stats file holds it: no wall-clock field, paths relative to the stage's
    directory, so a repeated run in another clone writes the same bytes (docs/pipeline.md, "Reproducibility")."""
    if isinstance(obj, dict):
        return {
            k: os.path.relpath(v) if k == "recipe" and os.path.isabs(str(v)) else _pinned(v)
            for k, v in obj.items()
            if not is_wall_clock(k)
        }
    return [_pinned(v) for v in obj] if isinstance(obj, list) else obj
