"""``composer-plugins compare``: the ablation table (channels on/off × seeds) from the MLflow store.

It reads the eval stages' runs (tagged ``dvc.stage=eval@<variant>-<seed>`` or ``eval_sft``, params
``study.channels``, ``study.variant``, ``study.seed``) back: :func:`fetch_eval_records`; the newest-run rule and
the default groups (channels + :func:`varying_params`): docs/pipeline.md, "The ablation table".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from composer_plugins.pipeline import study
from composer_plugins.training.lightning import tracking

#: MLflow param names written by the eval stage (and read back here).
P_CHANNELS = "study.channels"
P_VARIANT = "study.variant"
P_SEED = "study.seed"


def fetch_eval_records(
    tracking_uri: str,
    experiment: str,
    *,
    filters: Mapping[str, str] | None = None,
    group_by: Sequence[str] = ("channels",),
    all_runs: bool = False,
) -> list[dict[str, Any]]:
    """Flat records (one per finished eval run) from ``experiment`` in the store at ``tracking_uri``.

    Each record has ``channels``, ``variant``, ``seed``, ``run_id``, ``start_time``, every param (as
    ``param:<name>``) and every metric. ``filters``: tag equalities. Unless ``all_runs``, the newest run per
    (group, seed) only.
    """
    client = tracking.client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    clauses = ["attributes.status = 'FINISHED'", *(f"tags.`{k}` = '{v}'" for k, v in (filters or {}).items())]
    runs = client.search_runs(
        [exp.experiment_id], filter_string=" and ".join(clauses), max_results=5000, order_by=["start_time DESC"]
    )
    records: list[dict[str, Any]] = []
    for r in runs:
        stage = r.data.tags.get(tracking.TAG_STAGE, "")
        if not (stage == "eval" or stage.startswith(("eval@", "eval_"))):
            continue
        p = r.data.params
        rec: dict[str, Any] = {
            "channels": p.get(P_CHANNELS, "?"),
            "variant": p.get(P_VARIANT) or r.data.tags.get(tracking.TAG_VARIANT, "?"),
            "seed": _int(p.get(P_SEED, r.data.tags.get(tracking.TAG_SEED))),
            "run_id": r.info.run_id,
            "start_time": r.info.start_time,
            "stage": stage,
            "exp": r.data.tags.get(tracking.TAG_EXP, ""),
            "commit": r.data.tags.get(tracking.TAG_COMMIT, ""),
        }
        rec.update({f"param:{k}": v for k, v in p.items()})
        rec.update(r.data.metrics)
        records.append(rec)
    if all_runs:
        return records
    newest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rec in records:  # newest first: each (group, seed) keeps its first
        newest.setdefault((*[_group_value(rec, g) for g in group_by], rec["seed"]), rec)
    return list(newest.values())


#: Params that differ between the runs of one cell by construction (never a "varying param" column).
_RUN_PARAMS = ("study.seed", "train.seed", "train.output_dir", "study.variant")
_RUN_PREFIXES = ("train.mlflow.", "study.channel")


def varying_params(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Logged params that take two values for the same channels and seed: what an experiment changed (not the
    params that follow the variant or the seed, ``train.output_dir``)."""
    values: dict[str, dict[tuple[Any, Any], set[str]]] = {}
    for r in records:
        cell = (r.get("channels"), r.get("seed"))
        for k, v in r.items():
            name = k.removeprefix("param:")
            if k.startswith("param:") and name not in _RUN_PARAMS and not name.startswith(_RUN_PREFIXES):
                values.setdefault(name, {}).setdefault(cell, set()).add(str(v))
    # a param some runs did not log at all (written by an older version) is not a difference
    return sorted(n for n, cells in values.items() if any(len(vs) > 1 for vs in cells.values()))


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _group_value(rec: Mapping[str, Any], key: str) -> Any:
    return rec[key] if key in rec else rec.get(f"param:{key}")


def compare_table(
    records: Sequence[Mapping[str, Any]],
    metrics: Sequence[str] = study.HEADLINE_METRICS,
    group_by: Sequence[str] = ("channels",),
    fmt: str = "text",
    *,
    beside: bool = False,
    variant_order: Sequence[str] = (),
) -> str:
    """The ablation table of ``records`` as text, markdown, JSON or CSV.

    Rows are ordered by headline mean; with ``beside`` they are ordered by ``group_by`` instead (the
    baseline's row next to each experiment's row for the same channels) and an ``exp`` column names
    the ``dvc exp`` of each row's runs (``baseline`` for runs of a plain ``dvc repro``). When the first
    group is ``variant``, ``variant_order`` (``sft`` then ``study.variants``: results/ablation.md's order)
    orders the rows; variants it does not name follow in the order their oldest run was logged.
    """
    recs = [{**r, **{g: _group_value(r, g) for g in group_by}} for r in records]
    rows = study.ablation_rows(recs, metrics, group_by)
    if beside:
        for row in rows:
            names = sorted({r.get("exp") or "baseline" for r in recs if all(r.get(g) == row[g] for g in group_by)})
            row["exp"] = ",".join(names)
        # channel groups in the order their oldest run was logged (records come newest first)
        seen = dict.fromkeys(str(r.get(group_by[0])) for r in reversed(recs))
        if group_by[0] == "variant":
            seen = dict.fromkeys([*(str(v) for v in variant_order), *seen])
        first = {k: i for i, k in enumerate(seen)}
        rows.sort(
            key=lambda r: (
                first.get(str(r.get(group_by[0])), 0),
                r["exp"] != "baseline",
                [str(r.get(g)) for g in group_by[1:]],
            )
        )
        group_by = (*group_by, "exp")
    else:
        rows.sort(key=lambda r: -_sortable(r[metrics[0]][0]) if metrics else 0)
    if fmt == "json":
        return json.dumps(
            [
                {
                    **{k: v for k, v in r.items() if k not in metrics},
                    **{m: {"mean": _nan_none(r[m][0]), "std": _nan_none(r[m][1])} for m in metrics},
                }
                for r in rows
            ],
            indent=2,
        )
    if fmt == "csv":
        head = [*group_by, "n", *[f"{m}_{s}" for m in metrics for s in ("mean", "std")]]
        lines = [",".join(head)]
        for r in rows:
            vals = [str(r[g]) for g in group_by] + [str(r["n"])]
            vals += [f"{r[m][i]:.6g}" for m in metrics for i in (0, 1)]
            lines.append(",".join(vals))
        return "\n".join(lines)
    return study.format_table(rows, metrics, group_by, fmt)


def _sortable(v: float) -> float:
    return -math.inf if v is None or math.isnan(v) else v


def _nan_none(v: float) -> float | None:
    return None if v is None or math.isnan(v) else v
