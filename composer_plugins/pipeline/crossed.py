"""Tests with the warm starts and the held-out problems as samples (``study.blocking: random_start``).

:func:`crossed_effect` judges an effect over SFT starts built by one recipe and problems drawn by one generator;
:func:`start_effect` judges it within one start (``study.control: each_start``: the positive control's bars on
every start); :func:`crossed_family` is a report's family of them, Holm-corrected (what
:func:`.stats.study_effects` is for the other blockings).
They read each cell's per-problem results (``evals/<cell>.json``'s ``correct``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from composer_plugins.pipeline.stats import (
    PairedEffect,
    check_blocks,
    holm_tables,
    paired_seeds,
    t_effect,
)

__all__ = ["crossed_effect", "crossed_family", "crossed_tables", "start_effect"]


def crossed_effect(
    variant: Mapping[int, Sequence[float]],
    baseline: Mapping[int, Sequence[float]],
    blocks: Mapping[int, str],
    *,
    name: str = "variant",
    baseline_name: str = "baseline",
    metric: str = "",
) -> PairedEffect:
    """The warm starts *and* the held-out problems as random samples (``study.blocking: random_start``).

    ``variant``/``baseline``: ``{seed: per-problem scores}``, the same problems in the same order on both sides
    (a seed of the SFT side may repeat its start's one evaluation). The estimate, its two variances and its
    ``starts - 1`` degrees of freedom: docs/pipeline.md, "The ablation table". The per-problem variance is
    averaged over each start's cells, then over the starts (the analytic form of a paired bootstrap over problems).
    """
    seeds = paired_seeds(variant, baseline, name, baseline_name)
    lengths = {len(variant[s]) for s in seeds} | {len(baseline[s]) for s in seeds}
    if len(lengths) != 1:
        raise ValueError(f"{name!r} vs {baseline_name!r}: the cells scored different numbers of problems {lengths}")
    (m,) = lengths
    check_blocks(seeds, blocks, name, baseline_name)
    groups: dict[str, list[int]] = {}
    for s in seeds:
        groups.setdefault(str(blocks[s]), []).append(s)
    k = len(groups)
    per_problem = [0.0] * m  # per-problem difference, mean over each start's seeds, then over starts
    block_mean: dict[str, float] = {}
    for b, ss in groups.items():
        acc = [0.0] * m
        for s in ss:
            for i, (x, y) in enumerate(zip(variant[s], baseline[s], strict=True)):
                acc[i] += (float(x) - float(y)) / len(ss)
        block_mean[b] = sum(acc) / m
        for i in range(m):
            per_problem[i] += acc[i] / k
    diffs = [sum(float(x) for x in variant[s]) / m - sum(float(y) for y in baseline[s]) / m for s in seeds]
    mean = sum(block_mean.values()) / k
    if k < 2 or m < 2:
        se = se_starts = se_problems = math.nan
    else:
        se_starts = math.sqrt(sum((x - mean) ** 2 for x in block_mean.values()) / (k - 1) / k)
        se_problems = math.sqrt(sum((d - mean) ** 2 for d in per_problem) / (m - 1) / m)
        se = math.sqrt(se_starts**2 + se_problems**2)

    def side(values: Mapping[int, Sequence[float]]) -> float:
        return sum(sum(sum(float(x) for x in values[s]) / m for s in ss) / len(ss) for ss in groups.values()) / k

    extra = {
        "blocks": {b: {"seeds": ss, "mean": block_mean[b]} for b, ss in groups.items()},
        "se_starts": se_starts,
        "se_problems": se_problems,
        "problems": m,
    }
    vmean, bmean = side(variant), side(baseline)
    e = PairedEffect(
        name,
        baseline_name,
        metric,
        seeds,
        diffs,
        mean,
        se,
        variant_mean=vmean,
        baseline_mean=bmean,
        df=k - 1,
        extra=extra,
    )
    return t_effect(e)


def crossed_tables(
    problems: Mapping[str, Mapping[int, Sequence[float]]],
    baseline: str,
    metric: str,
    blocks: Mapping[int, str],
    each_start: Sequence[str] = (),
) -> dict[str, list[PairedEffect]]:
    """``final`` (each variant minus ``baseline``) and ``start`` (``baseline`` minus the SFT start) as
    :func:`crossed_effect` tests, from per-problem scores. ``each_start`` (``study.control: each_start``) adds the
    same test of each of those variants (``baseline``: its move from the SFT start) within every warm start
    (:func:`start_effect`), so a bar can be applied to every start.
    """
    if baseline not in problems:
        raise ValueError(f"baseline variant {baseline!r} has no per-problem scores; variants: {sorted(problems)}")
    base = problems[baseline]
    tables = {
        "final": [
            crossed_effect(problems[v], base, blocks, name=v, baseline_name=baseline, metric=metric)
            for v in problems
            if v not in (baseline, "sft")
        ]
    }
    if problems.get("sft"):
        tables["start"] = [
            crossed_effect(base, problems["sft"], blocks, name=baseline, baseline_name="sft", metric=metric)
        ]
    pairs = [(v, baseline) if v != baseline else (baseline, "sft") for v in each_start]
    tables["each_start"] = [
        start_effect(problems[v], problems[b], [s for s in sorted(blocks) if blocks[s] == st], st, v, b, metric)
        for v, b in pairs
        if v in problems and b in problems
        for st in dict.fromkeys(blocks[s] for s in sorted(blocks))
        if any(blocks[s] == st and s in problems[v] and s in problems[b] for s in blocks)
    ]
    if not tables["each_start"]:
        del tables["each_start"]
    return tables


def start_effect(
    variant: Mapping[int, Sequence[float]],
    baseline: Mapping[int, Sequence[float]],
    seeds: Sequence[int],
    start: str,
    name: str,
    baseline_name: str,
    metric: str = "",
) -> PairedEffect:
    """One warm start's paired difference over the held-out problems (its seeds averaged per problem): the
    problems are the sample (se = their differences' SD / sqrt(n), n − 1 degrees of freedom). ``extra['start']``
    names the start."""
    seeds = [s for s in seeds if s in variant and s in baseline]
    m = len(variant[seeds[0]])
    d = [sum(float(variant[s][i]) - float(baseline[s][i]) for s in seeds) / len(seeds) for i in range(m)]
    mean = sum(d) / m
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (m - 1)) if m > 1 else math.nan
    vmean, bmean = (sum(sum(float(x) for x in side[s]) / m for s in seeds) / len(seeds) for side in (variant, baseline))
    se = sd / math.sqrt(m)
    extra = {"start": start}
    e = PairedEffect(
        name, baseline_name, metric, seeds, d, mean, se, variant_mean=vmean, baseline_mean=bmean, df=m - 1, extra=extra
    )
    # one problem: no spread, the interval is the point and p says whether it is 0 (t_effect's se = 0 case)
    return t_effect(e) if m > 1 else replace(e, low=mean, high=mean, p=1.0 if mean == 0 else 0.0)


def crossed_family(
    problems: Mapping[str, Mapping[int, Sequence[float]]],
    baseline: str,
    metric: str,
    blocks: Mapping[int, str],
    margin: float | None = None,
    each_start: Sequence[str] = (),
) -> dict[str, list[PairedEffect]]:
    """:func:`crossed_tables`, Holm-corrected as one family (accuracy tests four-valued with ``margin``)."""
    return holm_tables(crossed_tables(problems, baseline, metric, blocks, each_start), margin)
