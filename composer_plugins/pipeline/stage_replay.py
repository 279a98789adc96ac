"""The replay stage's config: params.yaml's ``replay`` section plus the stage's paths."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from composer_plugins.pipeline.common import PATHS_REPLAY, param_error, section


def replay_config(params: Mapping[str, Any]) -> dict[str, Any]:
    """The ``replay run`` config of the replay stage: ``params['replay']`` plus the pipeline's paths.

    The stage fills the teacher cache (a persistent DVC output) and writes the raw
    responses and a summary; agreement-k extraction and normalisation are the ``pairs`` stage,
    whose ``pairs.k`` / ``pairs.compare`` are the one consensus setting (the raw pairs use it too).
    """
    r = section(params, "replay")
    if not r.get("teachers"):
        raise param_error(params, "replay.teachers", "at least one teacher is required (e.g. [{name: oracle}])")
    p = section(params, "pairs")
    out = Path(PATHS_REPLAY["out"])
    return {
        **r,
        "consensus": {"k": int(p.get("k", 2)), "compare": p.get("compare", "text")},
        "run_id": r.get("run_id") or "pipeline-replay",
        "traces": [PATHS_REPLAY["traces"]],
        "cache": {**(r.get("cache") or {}), "path": PATHS_REPLAY["cache"]},
        "normalize": {"enabled": False},
        "output": {
            "pairs": (out / "raw_pairs.jsonl").as_posix(),
            "responses": (out / "responses.jsonl").as_posix(),
            "summary": (out / "summary.json").as_posix(),
        },
    }
