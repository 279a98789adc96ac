"""The study's statistics: per-seed paired effects, Holm's correction, curve AUC and time to threshold with censoring.

Every variant runs on the same seeds, from the same SFT model and task order, so the runs of one seed form a
pair and the seed's own luck cancels in ``metric(variant, seed) - metric(baseline, seed)``. The tests, the
Holm family and the time-to-threshold censoring: docs/pipeline.md, "The ablation table"; the tables: :mod:`.paired`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from composer_plugins.pipeline.study import DEFAULT_THRESHOLD_DELTA

#: The family-wise error rate of :func:`holm`.
ALPHA = 0.05


def t_critical(df: int, confidence: float = 0.95) -> float:
    """Two-sided Student t critical value with ``df`` degrees of freedom (``t.ppf((1 + c) / 2, df)``)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom (2 seeds), got df={df}")
    from scipy.stats import t

    return float(t.ppf((1.0 + confidence) / 2.0, df))


@dataclass(frozen=True)
class PairedEffect:
    """One variant against the baseline, paired by seed."""

    variant: str
    baseline: str
    metric: str
    seeds: list[int]
    diffs: list[float]
    mean: float
    se: float
    #: The Student-t 95% interval (:func:`t_effect`; NaN with fewer than 2 seeds).
    low: float = math.nan
    high: float = math.nan
    variant_mean: float = math.nan
    baseline_mean: float = math.nan
    extra: dict[str, Any] = field(default_factory=dict)
    #: A smaller value is better (steps to a threshold): an effect above zero then *hurts*.
    lower_is_better: bool = False
    #: Two-sided paired t-test p-value of "mean difference = 0" (NaN with fewer than 2 seeds).
    p: float = math.nan
    #: Set by :func:`holm`: the correction's name, the family's size, the adjusted p-value and the
    #: interval at this test's Holm step level (``1 - alpha / (m - rank)``).
    correction: str = ""
    family: int = 0
    p_adjusted: float = math.nan
    adj_low: float = math.nan
    adj_high: float = math.nan
    #: The equivalence margin δ (``study.equivalence_margin``; NaN: none): a test that is not significant is
    #: *equivalent within ±δ* when its Holm-level interval lies inside (-δ, δ), else *inconclusive*.
    margin: float = math.nan
    #: The t test's degrees of freedom: ``n - 1`` paired seeds, or ``n - B`` when the seeds are blocked by warm
    #: start (:func:`paired_effect`'s ``blocks``); ``None`` means ``n - 1``.
    df: int | None = None

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def dof(self) -> int:
        return self.n - 1 if self.df is None else self.df

    @property
    def verdict(self) -> str:
        if not self.correction:
            return verdict(self.low, self.high, lower_is_better=self.lower_is_better)
        if math.isnan(self.p_adjusted):
            return "too few seeds"
        if self.p_adjusted >= ALPHA and math.isnan(self.margin):
            return "no measurable effect"
        if self.p_adjusted >= ALPHA:  # two one-sided tests at the Holm level: the interval inside (-δ, δ)
            inside = -self.margin < self.adj_low and self.adj_high < self.margin
            return f"equivalent within ±{self.margin:g}" if inside else "inconclusive"
        better = (self.mean < 0) if self.lower_is_better else (self.mean > 0)
        return "helps" if better else "hurts"


def verdict(low: float, high: float, *, lower_is_better: bool = False) -> str:
    """``helps`` when the interval is above zero, ``hurts`` when below (swapped with ``lower_is_better``)."""
    if math.isnan(low) or math.isnan(high):
        return "too few seeds"
    if low > 0:
        return "hurts" if lower_is_better else "helps"
    if high < 0:
        return "helps" if lower_is_better else "hurts"
    return "no measurable effect"


def paired_effect(
    variant: Mapping[int, float],
    baseline: Mapping[int, float],
    *,
    name: str = "variant",
    baseline_name: str = "baseline",
    metric: str = "",
    blocks: Mapping[int, str] | None = None,
) -> PairedEffect:
    """Per-seed differences ``variant[s] - baseline[s]`` over the seeds both have, with mean, se and 95% t interval.

    One shared seed: se and interval NaN; none: ``ValueError``. ``blocks`` (``{seed: warm start}``) makes it the
    blocked test of docs/pipeline.md ("The ablation table", ``study.blocking: warm_start``) when the seeds span two
    or more blocks; ``extra["blocks"]`` then holds each block's seeds and mean difference.
    """
    seeds = paired_seeds(variant, baseline, name, baseline_name)
    diffs = [float(variant[s]) - float(baseline[s]) for s in seeds]
    n = len(diffs)
    if blocks is not None:
        check_blocks(seeds, blocks, name, baseline_name)
        if len({blocks[s] for s in seeds}) > 1:
            return _blocked_effect(variant, baseline, seeds, diffs, blocks, name, baseline_name, metric)
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) / math.sqrt(n) if n > 1 else math.nan
    vmean, bmean = (sum(float(side[s]) for s in seeds) / n for side in (variant, baseline))
    e = PairedEffect(name, baseline_name, metric, seeds, diffs, mean, se, variant_mean=vmean, baseline_mean=bmean)
    return t_effect(e)


def paired_seeds(variant: Mapping[int, Any], baseline: Mapping[int, Any], name: str, baseline_name: str) -> list[int]:
    """The seeds both sides ran, sorted; ``ValueError`` naming each side's seeds when they share none."""
    seeds = sorted(set(variant) & set(baseline))
    if not seeds:
        raise ValueError(
            f"{name!r} and {baseline_name!r} share no seed (seeds {sorted(variant)} vs {sorted(baseline)}); "
            "a paired comparison needs both variants run on the same seeds"
        )
    return seeds


def check_blocks(seeds: Sequence[int], blocks: Mapping[int, str], name: str, baseline_name: str) -> None:
    """``ValueError`` naming the seeds that ``blocks`` (``{seed: warm start}``) gives no warm start."""
    unblocked = [s for s in seeds if s not in blocks]
    if unblocked:
        raise ValueError(f"seed(s) {unblocked} of {name!r} vs {baseline_name!r} belong to no warm start (blocks)")


def t_effect(e: PairedEffect) -> PairedEffect:
    """``e`` with the Student-t 95% interval and two-sided p-value of its mean difference on its degrees of freedom
    (:attr:`PairedEffect.dof`), left NaN when its ``se`` is (too few samples to estimate a spread)."""
    if math.isnan(e.se):
        return e
    half = t_critical(e.dof) * e.se
    return replace(e, low=e.mean - half, high=e.mean + half, p=t_pvalue(e.mean, e.se, e.dof))


def _blocked_effect(
    variant: Mapping[int, float],
    baseline: Mapping[int, float],
    seeds: list[int],
    diffs: list[float],
    blocks: Mapping[int, str],
    name: str,
    baseline_name: str,
    metric: str,
) -> PairedEffect:
    """:func:`paired_effect` over seeds blocked by warm start (its ``blocks``): mean of block means, within-block se."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(seeds):
        groups.setdefault(str(blocks[s]), []).append(i)
    k, n = len(groups), len(diffs)
    block_mean = {b: sum(diffs[i] for i in ix) / len(ix) for b, ix in groups.items()}
    mean = sum(block_mean.values()) / k
    df = n - k
    if df < 1:  # every block has one seed: no within-block spread to estimate
        se = math.nan
    else:
        within = sum((diffs[i] - block_mean[b]) ** 2 for b, ix in groups.items() for i in ix) / df
        se = math.sqrt(within * sum(1.0 / len(ix) for ix in groups.values())) / k

    def side(values: Mapping[int, float]) -> float:
        return sum(sum(float(values[seeds[i]]) for i in ix) / len(ix) for ix in groups.values()) / k

    extra = {"blocks": {b: {"seeds": [seeds[i] for i in ix], "mean": block_mean[b]} for b, ix in groups.items()}}
    vmean, bmean = side(variant), side(baseline)
    e = PairedEffect(
        name, baseline_name, metric, seeds, diffs, mean, se, variant_mean=vmean, baseline_mean=bmean, df=df, extra=extra
    )
    return t_effect(e)


def t_pvalue(mean: float, se: float, df: int) -> float:
    """Two-sided p-value of a paired t-test of ``mean = 0`` (``se`` 0: 0 when the mean is not 0, else 1)."""
    if se == 0:
        return 1.0 if mean == 0 else 0.0
    from scipy.stats import t

    return float(2.0 * t.sf(abs(mean / se), df))


def holm(effects: Sequence[PairedEffect], alpha: float = ALPHA) -> list[PairedEffect]:
    """The effects (same order) with Holm's family-wise correction over those with a p-value (NaN: too few seeds).

    Sorted by p, the ``i``-th (0-based) of ``m`` is tested at ``alpha / (m - i)``; its adjusted p-value is
    ``max_{j <= i} min(1, (m - j) p_(j))`` (monotone, so a verdict needs every smaller p rejected too),
    and its interval is the t interval at confidence ``1 - alpha / (m - i)``.
    """
    idx = [i for i, e in enumerate(effects) if not math.isnan(e.p)]
    m = len(idx)
    out = list(effects)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda k: effects[k].p)):
        e = effects[i]
        running = max(running, min(1.0, (m - rank) * e.p))
        half = t_critical(e.dof, 1.0 - alpha / (m - rank)) * e.se
        out[i] = replace(
            e, correction="holm", family=m, p_adjusted=running, adj_low=e.mean - half, adj_high=e.mean + half
        )
    for i, e in enumerate(out):
        if i not in idx:
            out[i] = replace(e, correction="holm", family=m)
    return out


def heldout_se(p: float, m: int) -> float:
    """Binomial standard error of an accuracy ``p`` measured on ``m`` held-out problems."""
    if m <= 0:
        raise ValueError(f"the held-out set must have at least one problem, got {m}")
    p = min(max(float(p), 0.0), 1.0)
    return math.sqrt(p * (1.0 - p) / m)


def by_variant_seed(records: Sequence[Mapping[str, Any]], metric: str) -> dict[str, dict[int, float]]:
    """``{variant: {seed: value}}`` of ``metric`` from flat run records (``variant``, ``seed``, metric)."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        v, s, x = r.get("variant"), r.get("seed"), r.get(metric)
        if v is not None and s is not None and x is not None and not math.isnan(float(x)):
            out.setdefault(str(v), {}).setdefault(int(s), float(x))  # records come newest first: keep the newest
    return out


def paired_rows(
    records: Sequence[Mapping[str, Any]],
    metric: str,
    baseline: str,
    blocks: Mapping[int, str] | None = None,
) -> list[PairedEffect]:
    """Every variant (but the baseline and the SFT start) against ``baseline`` on ``metric``, paired by seed
    (blocked by warm start with ``blocks``: :func:`paired_effect`)."""
    table = by_variant_seed(records, metric)
    if baseline not in table:
        raise ValueError(f"baseline variant {baseline!r} has no runs with {metric!r}; variants: {sorted(table)}")
    return [
        paired_effect(table[v], table[baseline], name=v, baseline_name=baseline, metric=metric, blocks=blocks)
        for v in table
        if v not in (baseline, "sft")
    ]


CURVE = "train/heldout/accuracy"
#: Every point of a run's held-out curve, step 0 (the starting policy) included (training/lightning/curves.py).
CURVE_FILE = "heldout_curve.csv"

#: ``{variant: {seed: history rows}}``
Histories = dict[str, dict[int, list[dict[str, float]]]]


def step_values(by_seed: Mapping[int, Sequence[Mapping[str, float]]], column: str) -> dict[int, list[float]]:
    """``{step: [column of each seed's run at that step]}``, steps in order."""
    per_step: dict[int, list[float]] = {}
    for rows in by_seed.values():
        for r in rows:
            if column in r:
                per_step.setdefault(int(r["step"]), []).append(r[column])
    return dict(sorted(per_step.items()))


def step_means(hist: Mapping[str, Mapping[int, Sequence[Mapping[str, float]]]], column: str) -> dict[str, list[float]]:
    """``{variant: [mean over seeds of column at step 1, 2, ...]}``."""
    return {v: [sum(xs) / len(xs) for xs in step_values(by_seed, column).values()] for v, by_seed in hist.items()}


def run_means(
    hist: Mapping[str, Mapping[int, Sequence[Mapping[str, float]]]], column: str, missing: float | None = None
) -> dict[str, dict[int, float]]:
    """``{variant: {seed: mean of column over the run's steps}}``; ``missing``: the value of a step without it."""
    out: dict[str, dict[int, float]] = {}
    for v, by_seed in hist.items():
        for s, rows in by_seed.items():
            if missing is None:
                xs = [r[column] for r in rows if column in r]
            else:
                xs = [r.get(column, missing) for r in rows if r.get("step", 1) >= 1]
            if xs:
                out.setdefault(v, {})[s] = sum(xs) / len(xs)
    return out


def curve_points(rows: Sequence[Mapping[str, float]], column: str = CURVE) -> list[tuple[int, float]]:
    """``[(step, value)]`` of the steps where ``column`` was measured, in step order."""
    return sorted((int(r["step"]), float(r[column])) for r in rows if column in r and not math.isnan(float(r[column])))


def curve_auc(points: Sequence[tuple[int, float]], start: float | None = None) -> float:
    """Area under ``points`` (trapezoids, from step 0 at ``start`` if given) over the steps it spans: its mean level."""
    pts = ([(0, float(start))] if start is not None else []) + [(int(s), float(v)) for s, v in points]
    if not pts:
        return math.nan
    if len(pts) == 1:
        return pts[0][1]
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in itertools.pairwise(pts))
    return area / (pts[-1][0] - pts[0][0])


#: ``study.threshold_delta`` when unset: the threshold of :func:`time_to_threshold` is the start + this.
DEFAULT_DELTA = DEFAULT_THRESHOLD_DELTA


def time_to_threshold(points: Sequence[tuple[int, float]], threshold: float) -> tuple[float, bool]:
    """``(first step with value >= threshold, reached)``; unreached: ``(last step + the run's last evaluation
    interval, False)``, censored at the next evaluation it did not have."""
    for s, v in points:
        if v >= threshold - 1e-12:
            return float(s), True
    if not points:
        return math.nan, False
    steps = [s for s, _ in points]
    interval = steps[-1] - steps[-2] if len(steps) > 1 else max(1, steps[-1])
    return float(steps[-1] + interval), False


#: The old name (steps to reach a target value).
steps_to_target = time_to_threshold


def curve_start(points: Sequence[tuple[int, float]]) -> float | None:
    """The curve's step-0 value (the starting policy's), ``None`` when the run did not record one."""
    return points[0][1] if points and points[0][0] == 0 else None


def start_of(
    start: float | Mapping[int, float] | None, seed: int, points: Sequence[tuple[int, float]] = ()
) -> float | None:
    """Seed ``seed``'s starting value: its curve's step 0 when recorded, else ``start`` (one value, or per seed)."""
    recorded = curve_start(points)
    if recorded is not None:
        return recorded
    return start.get(seed) if isinstance(start, Mapping) else start


def curve_effects(
    hist: Histories,
    baseline: str,
    delta: float = DEFAULT_DELTA,
    start: float | Mapping[int, float] | None = None,
    blocks: Mapping[int, str] | None = None,
) -> list[PairedEffect]:
    """Per variant against ``baseline``, paired by seed: the held-out curve's final value, AUC from step 0 and time
    to the threshold ``start + delta`` (:func:`start_of`). Time-to-threshold effects' ``extra`` holds ``threshold``
    and each arm's censored count (``censored``, ``censored_baseline``).
    """
    curves = {v: {s: curve_points(rows) for s, rows in by_seed.items()} for v, by_seed in hist.items()}
    curves = {v: {s: p for s, p in by_seed.items() if p} for v, by_seed in curves.items()}
    if baseline not in curves or not curves[baseline]:
        return []
    s0 = {s: start_of(start, s, curves[baseline][s]) for s in curves[baseline]}  # each seed's step-0 value
    out: list[PairedEffect] = []
    names = [v for v in curves if v != baseline and curves[v]]
    base_final = {s: p[-1][1] for s, p in curves[baseline].items()}
    base_auc = {s: curve_auc(p, None if curve_start(p) is not None else s0[s]) for s, p in curves[baseline].items()}
    thr = {s: x + float(delta) for s, x in s0.items() if x is not None}
    threshold = sum(thr.values()) / len(thr) if thr and len(thr) == len(s0) else None
    base_reach = {s: time_to_threshold(p, thr[s]) for s, p in curves[baseline].items()} if threshold else {}
    for v in names:
        shared = [s for s in curves[v] if s in base_final]
        if not shared:
            continue
        final = {s: curves[v][s][-1][1] for s in shared}
        auc = {s: curve_auc(curves[v][s], None if curve_start(curves[v][s]) is not None else s0[s]) for s in shared}
        tables = [("final", final, base_final), ("auc", auc, base_auc)]
        reach = {}
        if threshold is not None:
            reach = {s: time_to_threshold(curves[v][s], thr[s]) for s in shared}
            tables.append(
                ("time_to_threshold", {s: r[0] for s, r in reach.items()}, {s: r[0] for s, r in base_reach.items()})
            )
        for metric, table, base in tables:
            e = paired_effect(table, base, name=v, baseline_name=baseline, metric=f"{CURVE} {metric}", blocks=blocks)
            if metric == "time_to_threshold":
                e = replace(e, lower_is_better=True)
                e.extra.update(
                    threshold=threshold,  # the mean over seeds where their warm starts differ (``thresholds``)
                    delta=float(delta),
                    censored=sum(not reach[s][1] for s in e.seeds),
                    censored_baseline=sum(not base_reach[s][1] for s in e.seeds),
                )
                if len(set(thr.values())) > 1:
                    e.extra["thresholds"] = {s: thr[s] for s in e.seeds}
            out.append(e)
    return out


def study_effects(
    recs: Sequence[Mapping[str, Any]],
    hist: Histories,
    baseline: str,
    metric: str = "gsm8k/accuracy",
    delta: float = DEFAULT_DELTA,
    start: float | Mapping[int, float] | None = None,
    margin: float | None = None,
    blocks: Mapping[int, str] | None = None,
) -> dict[str, list[PairedEffect]]:
    """Every test a study report makes, Holm-corrected as one family (docs/pipeline.md, "The ablation table").

    Tables: ``final`` (``metric`` per variant), ``signal`` (run mean of ``train/groups_with_signal``), ``curve``
    (:func:`curve_effects`) and, given the SFT ``start`` (one value or ``{seed: value}``), ``start``: the baseline
    minus its seed's warm start. ``margin``: :func:`holm_tables`; ``blocks``: :func:`paired_effect`.
    """
    tables: dict[str, list[PairedEffect]] = {"final": paired_rows(recs, metric, baseline, blocks=blocks)}
    sig = "train/groups_with_signal"
    means = run_means(hist, sig)
    if baseline in means:
        tables["signal"] = [
            paired_effect(
                means[v], means[baseline], name=v, baseline_name=baseline, metric=sig + " (run mean)", blocks=blocks
            )
            for v in means
            if v != baseline
        ]
    curve = curve_effects(hist, baseline, delta=delta, start=start, blocks=blocks)
    if curve:
        tables["curve"] = curve
    base = by_variant_seed(recs, metric).get(baseline, {})
    sft = {s: x for s in base if (x := start_of(start, s)) is not None}
    if len(sft) > 1:
        tables["start"] = [paired_effect(base, sft, name=baseline, baseline_name="sft", metric=metric, blocks=blocks)]
    return holm_tables(tables, margin)


def holm_tables(tables: dict[str, list[PairedEffect]], margin: float | None) -> dict[str, list[PairedEffect]]:
    """``tables`` with Holm's correction over all their tests (accuracy tests four-valued with ``margin``)."""
    if margin is not None:
        for k, t in tables.items():
            tables[k] = [
                replace(e, margin=0.0 if k in ("signal", "start", "each_start") or e.lower_is_better else margin)
                for e in t
            ]
    corrected = iter(holm([e for t in tables.values() for e in t]))
    return {k: list(itertools.islice(corrected, len(t))) for k, t in tables.items()}


def gap_correlation(gap: Mapping[str, Any], effects: Mapping[str, float], key: str = "margin") -> dict[str, Any]:
    """Per variant its teachers' mean ``key`` beside its effect, and the Pearson correlation over the variants."""
    rows = []
    for v, teachers in (gap.get("variants") or {}).items():
        vals = [t[key] for t in teachers.values() if isinstance(t, Mapping) and _finite(t.get(key))]
        if vals and v in effects:
            rows.append((v, sum(vals) / len(vals), effects[v]))
    xs, ys = [x for _, x, _ in rows], [y for _, _, y in rows]
    r = math.nan
    if len(xs) >= 3:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
        sy = math.sqrt(sum((y - my) ** 2 for y in ys))
        if sx > 0 and sy > 0:
            r = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / (sx * sy)
    return {"rows": rows, "pearson_r": r, "n": len(xs)}


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(float(x))
