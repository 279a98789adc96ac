"""The study: variants (loss channels on/off) × seeds, and the ablation table over them.

It reads ``params.yaml``'s ``study`` section (docs/pipeline.md, "Stages"); :func:`ablation_rows` aggregates
held-out metrics per variant over seeds (mean ± sample std) for ``composer-plugins report`` and ``compare``.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_plugins.core.config import Config, load_config, yaml_load
from composer_plugins.pipeline.common import PATHS, is_num, md_table, param_error, text_table

#: Held-out metrics shown in the ablation table, in order (the first is the headline).
#: Names follow the one scheme of docs/metrics.md (MLflow-safe, the same in every sink).
HEADLINE_METRICS: tuple[str, ...] = ("gsm8k/accuracy", "code/pass_at_1", "feature_deletion/mean_reward")

#: Names used before the one naming scheme, mapped to theirs (old JSON, MLflow runs, metrics.json).
_RENAMED = {
    "train/reward_mean_all": "train/reward_mean_over_steps",
    "feature_deletion/reward": "feature_deletion/mean_reward",
    # the report's old metrics.json keys ('/' and '@' flattened away)
    "gsm8k_accuracy": "gsm8k/accuracy",
    "code_pass_at_1": "code/pass_at_1",
    "feature_deletion_reward": "feature_deletion/mean_reward",
}

#: First segments of a full metric name; a history.csv column without one is an old unprefixed column.
_TOP = ("train", "sft", "val", "start")


def canonical_metric(name: str) -> str:
    """The name of a metric in the one naming scheme (docs/metrics.md); old spellings map onto it (``@`` ->
    ``_at_``, then :data:`_RENAMED`). Current names come back unchanged."""
    name = name.replace("@", "_at_")
    return _RENAMED.get(name, name)


def history_column(name: str) -> str:
    """A ``history.csv`` column in the one scheme: old unprefixed columns (``reward``, ``grpo/loss``) get ``train/``."""
    name = canonical_metric(name)
    if name == "step" or name.split("/", 1)[0] in _TOP:
        return name
    return canonical_metric(f"train/{name}")


def load_params(
    path: str | os.PathLike[str] = "params.yaml", overrides: Iterable[str] = (), resolve_secrets: bool = False
) -> Config:
    """Load ``params.yaml`` (with ``key.sub=value`` overrides) as a located :class:`Config`.

    ``{$env: NAME}`` values stay unresolved unless ``resolve_secrets``: a stage that does not
    call a teacher must not need (or ever hold) its API key.
    """
    return load_config(path, overrides, resolve_secrets=resolve_secrets)


REPLACE_MARKER = "_replace"


def merge_params(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``override`` merged in: mappings recursively, everything else replaced, and an
    override mapping holding ``_replace: true`` replacing instead (docs/pipeline.md, "CI: the reduced params file")."""
    out = copy.deepcopy(dict(base))
    for k, v in override.items():
        if isinstance(v, Mapping) and v.get(REPLACE_MARKER):
            out[k] = {kk: copy.deepcopy(vv) for kk, vv in v.items() if kk != REPLACE_MARKER}
        elif isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge_params(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def write_merged_params(
    base: str | os.PathLike[str], override: str | os.PathLike[str], out: str | os.PathLike[str]
) -> Path:
    """Write ``base`` (YAML) merged with ``override`` (YAML, :func:`merge_params` rules) to ``out``."""
    import yaml

    b = yaml_load(Path(base).read_text()) or {}
    o = yaml_load(Path(override).read_text()) or {}
    text = f"# {Path(base).name} merged with {Path(override).name}\n"
    text += yaml.safe_dump(merge_params(b, o), sort_keys=False)
    return write_text(out, text)


def run_name(variant: str, seed: int | str) -> str:
    """Directory/run name of one study cell: ``<variant>-s<seed>``."""
    return f"{variant}-s{seed}"


def parse_run_name(name: str) -> tuple[str, int]:
    """Inverse of :func:`run_name`."""
    variant, _, seed = name.rpartition("-s")
    if not variant or not seed.lstrip("-").isdigit():
        raise ValueError(f"{name!r} is not a study run name of the form <variant>-s<seed>")
    return variant, int(seed)


def variants(params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``study.variants`` (``{"full": {}}`` when absent)."""
    v = (params.get("study") or {}).get("variants")
    if v is None:
        return {"full": {}}
    if not isinstance(v, Mapping) or not v:
        raise param_error(params, "study.variants", "must be a non-empty mapping of variant name -> train overrides")
    return {str(k): dict(x or {}) for k, x in v.items()}


def seeds(params: Mapping[str, Any]) -> list[int]:
    """``study.seeds`` (``[train.seed or 0]`` when absent)."""
    s = (params.get("study") or {}).get("seeds")
    if s is None:
        return [int((params.get("train") or {}).get("seed", 0))]
    if not isinstance(s, list) or not all(isinstance(x, int) for x in s):
        raise param_error(params, "study.seeds", f"must be a list of integers, got {s!r}")
    return list(s)


def warm_starts(params: Mapping[str, Any]) -> list[Path]:
    """``study.warm_starts``: the study directories (relative to this one) of the other SFT warm starts, each with
    seeds of its own, pooled into this one's report."""
    ws = (params.get("study") or {}).get("warm_starts") or []
    if not isinstance(ws, list) or not all(isinstance(w, str) and w for w in ws):
        raise param_error(params, "study.warm_starts", f"must be a list of study directories, got {ws!r}")
    missing = [w for w in ws if not (Path(w) / PATHS["evals"]).is_dir()]
    if missing:
        raise param_error(
            params, "study.warm_starts", f"{missing} hold no {PATHS['evals']}/: run those studies' cells first"
        )
    return [Path(w) for w in ws]


def baseline(params: Mapping[str, Any]) -> str | None:
    """``study.baseline``: the variant every other one is paired against (``None`` when unset)."""
    b = (params.get("study") or {}).get("baseline")
    if b is None:
        return None
    names = list(variants(params))
    if str(b) not in names:
        raise param_error(params, "study.baseline", f"{b!r} is not a variant of study.variants.", valid=names)
    return str(b)


#: ``study.threshold_delta`` when unset (an accuracy gain over the start).
DEFAULT_THRESHOLD_DELTA = 0.04


def threshold_delta(params: Mapping[str, Any]) -> float:
    """``study.threshold_delta``: time to threshold counts the steps to reach the start's held-out value + this."""
    d = _fraction(params, "threshold_delta", "an accuracy gain")
    return DEFAULT_THRESHOLD_DELTA if d is None else d


def equivalence_margin(params: Mapping[str, Any]) -> float | None:
    """``study.equivalence_margin`` δ (``None``: unset): a non-significant accuracy effect is *equivalent within ±δ*
    when its Holm-level interval lies inside (-δ, δ), else *inconclusive*. Fixed before the study runs."""
    return _fraction(params, "equivalence_margin", "an accuracy difference")


def _fraction(params: Mapping[str, Any], key: str, what: str) -> float | None:
    d = (params.get("study") or {}).get(key)
    if d is not None and (not is_num(d) or not 0 < float(d) < 1):
        raise param_error(params, f"study.{key}", f"must be a number in (0, 1) ({what}), got {d!r}")
    return None if d is None else float(d)


def bars(params: Mapping[str, Any]) -> dict[str, float]:
    """``study.bars`` (``{}`` when unset): the positive control's bars, ``{variant: bar}``; when one passes:
    docs/pipeline.md, "Where results land" (``results/paired.json``)."""
    b = (params.get("study") or {}).get("bars") or {}
    if not isinstance(b, Mapping) or not all(is_num(x) and -1 < float(x) < 1 for x in b.values()):
        raise param_error(params, "study.bars", f"must map variants to accuracy differences in (-1, 1), got {b!r}")
    names = list(variants(params))
    for v in b:
        if v not in names:
            raise param_error(params, f"study.bars.{v}", "is not a variant of study.variants.", valid=names)
    return {str(k): float(x) for k, x in b.items()}


#: ``study.blocking``'s values: ``none`` pools every seed as one sample; ``warm_start`` blocks them by warm start.
BLOCKING = ("none", "warm_start", "random_start")


def blocking(params: Mapping[str, Any]) -> str:
    """``study.blocking`` (default ``none``), one of :data:`BLOCKING`, fixed before the study runs: ``warm_start``
    blocks a pooled study's seeds by warm start (:func:`.stats.paired_effect`), ``random_start`` takes the starts
    and the held-out problems as samples (:func:`.crossed.crossed_effect`)."""
    b = (params.get("study") or {}).get("blocking", "none")
    if b not in BLOCKING:
        raise param_error(params, "study.blocking", f"unknown blocking {b!r}.", valid=list(BLOCKING))
    return str(b)


#: ``study.control``'s values: where the positive control's bars apply.
CONTROL = ("pooled", "each_start")


def control(params: Mapping[str, Any]) -> str:
    """``study.control`` (default ``pooled``): ``each_start`` applies every ``study.bars`` bar to each warm start
    separately (that start's paired difference over the held-out problems, :func:`.crossed.start_effect`, in the
    report's Holm family): the control passes only where it holds on every start. Needs
    ``study.blocking: random_start`` (the per-problem results). Fixed before the study runs."""
    c = (params.get("study") or {}).get("control", "pooled")
    if c not in CONTROL:
        raise param_error(params, "study.control", f"unknown control {c!r}.", valid=list(CONTROL))
    if c == "each_start" and blocking(params) != "random_start":
        raise param_error(params, "study.control", "each_start needs study.blocking: random_start.")
    return str(c)


def variant_overrides(params: Mapping[str, Any], variant: str) -> dict[str, Any]:
    """The ``train`` overrides of ``variant``; a located error naming the valid variants otherwise."""
    v = variants(params)
    if variant not in v:
        raise param_error(params, f"study.variants.{variant}", "unknown variant.", valid=list(v))
    return v[variant]


# -- aggregation ------------------------------------------------------------------------------


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value; NaN for none)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, 0.0
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var)


def ablation_rows(
    records: Sequence[Mapping[str, Any]],
    metrics: Sequence[str] = HEADLINE_METRICS,
    group_by: Sequence[str] = ("channels",),
) -> list[dict[str, Any]]:
    """Aggregate flat per-run records over seeds: one row per ``group_by`` group (in first-seen order) with ``n``
    (number of seeds), ``seeds`` and ``<metric>`` -> ``(mean, std)``."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault(tuple(r.get(k) for k in group_by), []).append(r)
    rows = []
    for key, rs in groups.items():
        row: dict[str, Any] = dict(zip(group_by, key, strict=True))
        row["n"] = len(rs)
        row["seeds"] = sorted({r.get("seed") for r in rs}, key=lambda s: (s is None, s))
        for m in metrics:
            row[m] = mean_std([r[m] for r in rs if r.get(m) is not None])
        rows.append(row)
    return rows


def _cell(v: tuple[float, float]) -> str:
    m, s = v
    return "n/a" if math.isnan(m) else f"{m:.3f} ± {s:.3f}"


def format_table(
    rows: Sequence[Mapping[str, Any]],
    metrics: Sequence[str] = HEADLINE_METRICS,
    group_by: Sequence[str] = ("channels",),
    fmt: str = "markdown",
) -> str:
    """Render :func:`ablation_rows` as a markdown (``fmt="markdown"``) or plain-text table."""
    headers = [*group_by, "seeds", *[f"{m} (mean ± std)" for m in metrics]]
    body = [
        [
            *(str(r.get(k)) for k in group_by),
            f"{r['n']} ({','.join(str(s) for s in r['seeds'])})",
            *(_cell(r[m]) for m in metrics),
        ]
        for r in rows
    ]
    return md_table(headers, body) if fmt == "markdown" else text_table(headers, body)


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` (parents created); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p
