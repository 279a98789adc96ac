"""Normalise preference pairs with data-juicer's own executor and ops (YAML recipe).

Pairs reach data-juicer's ``DefaultExecutor`` as flat text columns plus the full record as a JSON ``_payload``
column they are restored from; ``skip_op_error`` is always forced off, on every op (docs/replay.md,
"Normalisation with data-juicer").
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.core.io import atomic_write_jsonl, read_jsonl
from composer_plugins.teachers.pairs import normalize_action

DEFAULT_RECIPE = Path(__file__).parent / "recipes" / "pairs.yaml"
PAYLOAD_KEY = "_payload"
_RESERVED = frozenset({"text", "prompt", "chosen", "rejected", "state_id", "dedup_text", PAYLOAD_KEY})


class NormalizeError(ComposerPluginsError):
    """data-juicer could not run the recipe (bad recipe, failing op ...)."""


@dataclass
class NormalizeReport:
    """What the recipe did."""

    recipe: str
    n_in: int
    n_out: int
    dropped: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "elapsed_s": round(self.elapsed_s, 3)}


def to_dj_record(pair: Mapping[str, Any], columns: Sequence[str] = ()) -> dict[str, Any]:
    """The flat record data-juicer sees for ``pair`` (plus the top-level pair fields named in ``columns``)."""
    prompt = str(pair.get("prompt", ""))
    chosen = str(pair.get("chosen", ""))
    rejected = str(pair.get("rejected", ""))
    compare = pair.get("compare", "text")
    compare = compare if compare in ("text", "final_answer") else "text"
    chosen_key = normalize_action(pair.get("chosen_message") or chosen, compare)
    rejected_key = normalize_action(pair.get("rejected_message") or rejected, compare)
    extra = {c: pair.get(c) for c in columns if c not in _RESERVED}
    return {
        **extra,
        "text": f"{prompt}\n<|assistant|>\n{chosen}" if prompt else chosen,
        "prompt": prompt,
        "chosen": chosen,
        "rejected": rejected,
        "state_id": str(pair.get("state_id", "")),
        "dedup_text": "\x1e".join([prompt, chosen_key, rejected_key]),
        PAYLOAD_KEY: json.dumps(dict(pair), ensure_ascii=False),
    }


def from_dj_record(row: Mapping[str, Any]) -> dict[str, Any]:
    """The original pair back from a data-juicer output row."""
    if PAYLOAD_KEY not in row:
        raise NormalizeError(f"a data-juicer output row lost the {PAYLOAD_KEY!r} column; keep it in the recipe")
    return json.loads(row[PAYLOAD_KEY])


@contextlib.contextmanager
def _quiet_data_juicer() -> Iterator[None]:
    """Silence data-juicer's loguru output and the datasets progress bars for the duration."""
    from loguru import logger

    try:
        import datasets

        bars_were_on = datasets.utils.logging.is_progress_bar_enabled()
        datasets.disable_progress_bars()
    except Exception:  # pragma: no cover - datasets always present with data-juicer
        datasets, bars_were_on = None, False
    logger.disable("data_juicer")
    try:
        yield
    finally:
        logger.enable("data_juicer")
        if datasets is not None and bars_were_on:
            datasets.enable_progress_bars()


def normalize_pairs(
    pairs: Sequence[Mapping[str, Any]],
    recipe: str | os.PathLike[str] | None = None,
    *,
    work_dir: str | os.PathLike[str] | None = None,
    columns: Sequence[str] = (),
) -> tuple[list[dict[str, Any]], NormalizeReport]:
    """Run the data-juicer ``recipe`` over ``pairs``; returns the kept pairs (unchanged) and a report.

    ``recipe`` defaults to the shipped ``recipes/pairs.yaml``, ``work_dir`` to a temporary directory (removed
    after); ``columns`` are more top-level pair fields exposed to the recipe (e.g. ``agreement``).
    """
    recipe_path = Path(recipe) if recipe is not None else DEFAULT_RECIPE
    if not recipe_path.is_file():
        raise NormalizeError(f"data-juicer recipe not found: {recipe_path}")
    t0 = time.perf_counter()
    if not pairs:
        return [], NormalizeReport(str(recipe_path), 0, 0, [], time.perf_counter() - t0)
    ctx = tempfile.TemporaryDirectory(prefix="replay-dj-") if work_dir is None else contextlib.nullcontext(work_dir)
    with ctx as wd:
        wd = Path(wd)
        wd.mkdir(parents=True, exist_ok=True)
        in_path, out_path = wd / "pairs_in.jsonl", wd / "out" / "pairs_out.jsonl"
        atomic_write_jsonl(in_path, [to_dj_record(p, columns) for p in pairs])
        with _quiet_data_juicer():
            _run_executor(recipe_path, in_path, out_path, wd / "dj")
        rows = read_jsonl(out_path) if out_path.exists() else []
    kept = [from_dj_record(r) for r in rows]
    kept_ids = {str(p.get("state_id")) for p in kept}
    dropped = [str(p.get("state_id")) for p in pairs if str(p.get("state_id")) not in kept_ids]
    return kept, NormalizeReport(str(recipe_path), len(pairs), len(kept), dropped, time.perf_counter() - t0)


def _run_executor(recipe: Path, in_path: Path, out_path: Path, work_dir: Path) -> None:
    try:
        from data_juicer.config import init_configs
        from data_juicer.core import DefaultExecutor
    except ImportError as e:  # pragma: no cover - optional dependency
        raise NormalizeError(
            f"pair normalisation needs data-juicer ({e}). HINT: pip install 'composer-plugins[replay]'"
        ) from e
    flags = {"config": recipe, "dataset_path": in_path, "export_path": out_path, "work_dir": work_dir}
    args = [arg for k, v in {**flags, "skip_op_error": "false"}.items() for arg in (f"--{k}", str(v))]
    try:
        cfg = init_configs(args=args, load_configs_only=True)
    except SystemExit as e:  # jsonargparse exits on a bad recipe
        raise NormalizeError(f"{recipe}: data-juicer rejected the recipe (exit {e.code}); see the message above") from e
    except Exception as e:
        raise NormalizeError(f"{recipe}: data-juicer rejected the recipe: {type(e).__name__}: {e}") from e
    cfg.skip_op_error = False
    for op in cfg.process or []:
        for _name, op_args in op.items():
            if isinstance(op_args, dict):
                op_args["skip_op_error"] = False
    try:
        DefaultExecutor(cfg).run()
    except Exception as e:
        raise NormalizeError(f"{recipe}: data-juicer failed while running the recipe: {type(e).__name__}: {e}") from e
