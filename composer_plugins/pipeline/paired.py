"""Paired comparison of study variants: each channel's effect as a per-seed paired difference.

Every variant of a study runs on the same seeds, from the same SFT model and on the same task
order (the order depends on the seed only), so the runs of one seed form a pair and the seed's
own luck cancels in ``metric(variant, seed) - metric(baseline, seed)``. Over the ``n`` seeds
both variants share, :func:`paired_effect` reports the mean difference, its standard error
``sd / sqrt(n)`` and the two-sided 95% interval ``mean ± t(0.975, n - 1) · se`` (Student t).

The held-out set has its own sampling error: an accuracy ``p`` measured on ``m`` problems has
standard error ``sqrt(p (1 - p) / m)`` (:func:`heldout_se`); a claimed effect should be larger
than it. :func:`verdict` reads an interval as *helps* (all above zero), *hurts* (all below) or
*no measurable effect* (it holds zero).

With a held-out learning curve (``eval.every_n_steps``: history.csv column
``train/heldout/accuracy``) two more paired measures of *speed* join final accuracy:
:func:`curve_auc`, the area under the held-out accuracy curve over the run's steps divided by its
length (the run's mean held-out accuracy, so a variant that gets there sooner scores higher), and
:func:`steps_to_target`, the first evaluated step at which a run reaches the baseline's final
accuracy of the same seed (a run that never does counts as censored at its last step plus one
evaluation interval). :func:`curve_effects` pairs both by seed.

``composer-plugins compare --paired`` prints :func:`format_paired` of the eval runs in MLflow.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = [
    "CURVE",
    "PairedEffect",
    "curve_auc",
    "curve_effects",
    "curve_points",
    "format_paired",
    "heldout_se",
    "paired_effect",
    "paired_rows",
    "steps_to_target",
    "t_critical",
    "verdict",
]


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
    low: float
    high: float
    variant_mean: float = math.nan
    baseline_mean: float = math.nan
    extra: dict[str, Any] = field(default_factory=dict)
    #: A smaller value is better (steps to a target): an interval above zero then *hurts*.
    lower_is_better: bool = False

    @property
    def n(self) -> int:
        return len(self.diffs)

    @property
    def verdict(self) -> str:
        return verdict(self.low, self.high, lower_is_better=self.lower_is_better)


def verdict(low: float, high: float, *, lower_is_better: bool = False) -> str:
    """``helps`` when the interval is above zero, ``hurts`` when below, else ``no measurable effect``.

    With ``lower_is_better`` (e.g. steps to reach a target) the two are swapped.
    """
    if math.isnan(low) or math.isnan(high):
        return "too few seeds"
    if low > 0:
        return "hurts" if lower_is_better else "helps"
    if high < 0:
        return "helps" if lower_is_better else "hurts"
    return "no measurable effect"


def paired_effect(variant: Mapping[int, float], baseline: Mapping[int, float], *, confidence: float = 0.95,
                  name: str = "variant", baseline_name: str = "baseline",
                  metric: str = "") -> PairedEffect:  # fmt: skip
    """Per-seed differences ``variant[s] - baseline[s]`` over the seeds both have, with mean, se and t interval.

    With one shared seed the standard error and interval are NaN (no spread to estimate);
    with none, ``ValueError`` names the seeds of each side.
    """
    seeds = sorted(set(variant) & set(baseline))
    if not seeds:
        raise ValueError(
            f"{name!r} and {baseline_name!r} share no seed (seeds {sorted(variant)} vs {sorted(baseline)}); "
            "a paired comparison needs both variants run on the same seeds"
        )
    diffs = [float(variant[s]) - float(baseline[s]) for s in seeds]
    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        se = low = high = math.nan
    else:
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
        se = sd / math.sqrt(n)
        half = t_critical(n - 1, confidence) * se
        low, high = mean - half, mean + half
    return PairedEffect(
        variant=name, baseline=baseline_name, metric=metric, seeds=seeds, diffs=diffs, mean=mean, se=se,
        low=low, high=high, variant_mean=sum(float(variant[s]) for s in seeds) / n,
        baseline_mean=sum(float(baseline[s]) for s in seeds) / n,
    )  # fmt: skip


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
        if v is None or s is None or x is None:
            continue
        x = float(x)
        if math.isnan(x):
            continue
        out.setdefault(str(v), {}).setdefault(int(s), x)  # records come newest first: keep the newest
    return out


def paired_rows(records: Sequence[Mapping[str, Any]], metric: str, baseline: str,
                variants: Sequence[str] | None = None, confidence: float = 0.95) -> list[PairedEffect]:  # fmt: skip
    """Every variant (but the baseline and the SFT start) against ``baseline`` on ``metric``, paired by seed."""
    table = by_variant_seed(records, metric)
    if baseline not in table:
        raise ValueError(f"baseline variant {baseline!r} has no runs with {metric!r}; variants: {sorted(table)}")
    names = list(variants) if variants else [v for v in table if v not in (baseline, "sft")]
    missing = [v for v in names if v not in table]
    if missing:
        raise ValueError(f"variant(s) {missing} have no runs with {metric!r}; variants: {sorted(table)}")
    return [paired_effect(table[v], table[baseline], confidence=confidence, name=v, baseline_name=baseline,
                          metric=metric) for v in names]  # fmt: skip


def _f(x: float, nd: int = 3, sign: bool = False) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"


def format_paired(effects: Sequence[PairedEffect], fmt: str = "markdown", heldout_n: int | None = None) -> str:
    """The paired table (markdown, text, json or csv); with ``heldout_n`` the held-out sampling error too."""
    if fmt == "json":
        return json.dumps([{**asdict(e), "n": e.n, "verdict": e.verdict} for e in effects], indent=2)
    head = ["variant", "vs", "metric", "seeds", "variant mean", "baseline mean", "paired diff (mean)", "se",
            "95% CI", "verdict"]  # fmt: skip
    if heldout_n:
        head.insert(6, f"held-out se (m={heldout_n})")
    rows = []
    for e in effects:
        ci = f"[{_f(e.low, sign=True)}, {_f(e.high, sign=True)}]"
        row = [e.variant, e.baseline, e.metric, str(e.n), _f(e.variant_mean), _f(e.baseline_mean),
               _f(e.mean, sign=True), _f(e.se), ci, e.verdict]  # fmt: skip
        if heldout_n:
            hse = heldout_se(e.baseline_mean, heldout_n)
            row.insert(6, _f(hse))
            if e.verdict in ("helps", "hurts") and abs(e.mean) < hse:
                row[-1] += " (but |effect| < held-out se)"
        rows.append(row)
    if fmt == "csv":
        return "\n".join(",".join(c.replace(",", ";") for c in r) for r in [head, *rows])
    if fmt == "markdown":
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = [
        "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(out)


# -- a study directory (evals/*.json, runs/*/history.csv) without MLflow ------------------------


#: ``{variant: {seed: history rows}}``
Histories = dict[str, dict[int, list[dict[str, float]]]]


def read_study_dir(root: str | Path, evals: str | Path = "evals",
                   runs: str | Path = "runs") -> tuple[list[dict[str, Any]], Histories]:  # fmt: skip
    """Eval records (``variant``, ``seed``, metrics) and histories ``{variant: {seed: rows}}`` of a study dir.

    ``evals`` and ``runs`` are relative to ``root`` (the stage layout of dvc.yaml: ``evals/*.json``,
    ``runs/<variant>-s<seed>/history.csv``).
    """
    from composer_plugins.pipeline.study import canonical_metric, history_column, parse_run_name

    root = Path(root)
    recs: list[dict[str, Any]] = []
    for f in sorted((root / evals).glob("*.json")):
        if f.stem == "sft":
            v, s = "sft", None
        else:
            v, s = parse_run_name(f.stem)
        m = json.loads(f.read_text()).get("metrics", {})
        recs.append({"variant": v, "seed": s, **{canonical_metric(k): x for k, x in m.items()}})
    hist: Histories = {}
    for f in sorted((root / runs).glob("*/history.csv")):
        try:
            v, s = parse_run_name(f.parent.name)
        except ValueError:
            continue  # not a study cell (e.g. a hand-made run directory)
        with f.open() as fh:
            rows = [
                {history_column(k): float(x) for k, x in r.items() if x not in ("", None)} for r in csv.DictReader(fh)
            ]
        hist.setdefault(v, {})[s] = rows
    return recs, hist


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
    hist: Mapping[str, Mapping[int, Sequence[Mapping[str, float]]]], column: str
) -> dict[str, dict[int, float]]:
    """``{variant: {seed: mean of column over the run's steps}}``."""
    out: dict[str, dict[int, float]] = {}
    for v, by_seed in hist.items():
        for s, rows in by_seed.items():
            xs = [r[column] for r in rows if column in r]
            if xs:
                out.setdefault(v, {})[s] = sum(xs) / len(xs)
    return out


#: The held-out learning-curve column of history.csv (training/curves.py).
CURVE = "train/heldout/accuracy"


def curve_points(rows: Sequence[Mapping[str, float]], column: str = CURVE) -> list[tuple[int, float]]:
    """``[(step, value)]`` of the steps where ``column`` was measured, in step order."""
    return sorted((int(r["step"]), float(r[column])) for r in rows if column in r and not math.isnan(float(r[column])))


def curve_auc(points: Sequence[tuple[int, float]], start: float | None = None) -> float:
    """Area under the curve ``points`` (trapezoids) divided by the steps it spans: its mean level.

    ``start`` is the value at step 0 (the shared starting policy); without it the area starts at the
    first measured step. One point: its value.
    """
    pts = ([(0, float(start))] if start is not None else []) + [(int(s), float(v)) for s, v in points]
    if not pts:
        return math.nan
    if len(pts) == 1:
        return pts[0][1]
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in itertools.pairwise(pts))
    return area / (pts[-1][0] - pts[0][0])


def steps_to_target(points: Sequence[tuple[int, float]], target: float) -> tuple[float, bool]:
    """``(first step with value >= target, reached)``; unreached: ``(last step + interval, False)`` (censored)."""
    for s, v in points:
        if v >= target - 1e-12:
            return float(s), True
    if not points:
        return math.nan, False
    steps = [s for s, _ in points]
    interval = steps[-1] - steps[-2] if len(steps) > 1 else max(1, steps[-1])
    return float(steps[-1] + interval), False


def curve_effects(hist: Histories, baseline: str, column: str = CURVE,
                  confidence: float = 0.95) -> list[PairedEffect]:  # fmt: skip
    """Per variant against ``baseline``, paired by seed: the final curve value, the AUC and the steps to target.

    The target of a seed is the baseline's final curve value at that seed. Each effect's ``extra`` holds
    ``censored``: how many of the variant's seeds never reached it.
    """
    curves = {v: {s: curve_points(rows, column) for s, rows in by_seed.items()} for v, by_seed in hist.items()}
    curves = {v: {s: p for s, p in by_seed.items() if p} for v, by_seed in curves.items()}
    if baseline not in curves or not curves[baseline]:
        return []
    target = {s: p[-1][1] for s, p in curves[baseline].items()}
    out: list[PairedEffect] = []
    names = [v for v in curves if v != baseline and curves[v]]
    base_final = {s: p[-1][1] for s, p in curves[baseline].items()}
    base_auc = {s: curve_auc(p) for s, p in curves[baseline].items()}
    base_steps = {s: steps_to_target(p, target[s])[0] for s, p in curves[baseline].items()}
    for v in names:
        shared = [s for s in curves[v] if s in target]
        if not shared:
            continue
        final = {s: curves[v][s][-1][1] for s in shared}
        auc = {s: curve_auc(curves[v][s]) for s in shared}
        reach = {s: steps_to_target(curves[v][s], target[s]) for s in shared}
        censored = sum(not ok for _, ok in reach.values())
        for metric, table, base in (("final", final, base_final), ("auc", auc, base_auc),
                                    ("steps_to_target", {s: r[0] for s, r in reach.items()}, base_steps)):  # fmt: skip
            e = paired_effect(table, base, confidence=confidence, name=v, baseline_name=baseline,
                              metric=f"{column} {metric}")  # fmt: skip
            if metric == "steps_to_target":
                e = replace(e, lower_is_better=True)
                e.extra["censored"] = censored
            out.append(e)
    return out


def study_report(root: str | Path, baseline: str = "rl_only", metric: str = "gsm8k/accuracy",
                 heldout_n: int | None = None, evals: str | Path = "evals",
                 runs: str | Path = "runs") -> str:  # fmt: skip
    """Markdown: the paired table of ``metric`` and of ``train/groups_with_signal`` (run mean), and signal per step."""
    recs, hist = read_study_dir(root, evals, runs)
    sft = [r for r in recs if r["variant"] == "sft"]
    out = []
    if sft and metric in sft[0]:
        se = f" (held-out se {heldout_se(sft[0][metric], heldout_n):.4f})" if heldout_n else ""
        out.append(f"SFT start: {metric} = {sft[0][metric]:.4f}{se}\n")
    out.append(format_paired(paired_rows(recs, metric, baseline), "markdown", heldout_n=heldout_n))
    sig = "train/groups_with_signal"
    means = run_means(hist, sig)
    if baseline in means:
        names = [v for v in means if v != baseline]
        eff = [paired_effect(means[v], means[baseline], name=v, baseline_name=baseline, metric=sig + " (run mean)")
               for v in names]  # fmt: skip
        out += ["", format_paired(eff, "markdown")]
    curve = curve_effects(hist, baseline)
    if curve:
        out += [
            "",
            f"Held-out learning curve ({CURVE}, greedy, fixed subset): final value, area under the curve over the "
            "run's steps divided by its length, and the first evaluated step reaching the baseline's final value of "
            "the same seed (never reached: censored at the last step + one interval; `censored` counts those seeds).",
            "",
            format_paired(curve, "markdown"),
        ]
        cens = {e.variant: e.extra["censored"] for e in curve if "censored" in e.extra}
        out += ["", "censored (never reached the target): " + ", ".join(f"{v} {n}" for v, n in cens.items())]
        cm = step_means(hist, CURVE)
        if cm:
            pts = {v: step_values(by_seed, CURVE) for v, by_seed in hist.items()}
            steps_all = sorted({s for p in pts.values() for s in p})
            head = ["step", *pts]
            lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
            for t in steps_all:
                cells = [f"{sum(p[t]) / len(p[t]):.3f}" if t in p else "" for p in pts.values()]
                lines.append("| " + " | ".join([str(t), *cells]) + " |")
            out += ["", f"{CURVE} per evaluated step (mean over seeds):", "", *lines]
    steps = step_means(hist, sig)
    if steps:
        n = max(len(x) for x in steps.values())
        head = ["step", *steps]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for i in range(n):
            lines.append(
                "| " + " | ".join([str(i + 1), *(f"{x[i]:.3f}" if i < len(x) else "" for x in steps.values())]) + " |"
            )
        out += ["", f"{sig} per step (mean over seeds):", "", *lines]
    return "\n".join(out)


def _se(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def plot_study(root: str | Path, out_dir: str | Path, metric: str = "gsm8k/accuracy",
               prefix: str = "sparse", baseline: str = "rl_only") -> list[Path]:  # fmt: skip
    """Two PNGs, ``<prefix>_accuracy.png``: ``metric`` per variant and seed (lines join a seed's runs), and
    ``<prefix>_groups_with_signal.png``: ``groups_with_signal`` per step (mean over seeds, ± se band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs, hist = read_study_dir(root)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = by_variant_seed([r for r in recs if r["variant"] != "sft"], metric)
    names = sorted(table, key=lambda v: v != baseline)  # the baseline first, then the study's order
    fig, ax = plt.subplots(figsize=(6, 3.5))
    sft = [r[metric] for r in recs if r["variant"] == "sft" and metric in r]
    if sft:
        ax.axhline(sft[0], color="grey", linestyle="--", linewidth=1, label="SFT start")
    for s in sorted({s for v in table.values() for s in v}):
        xs = [i for i, v in enumerate(names) if s in table[v]]
        ax.plot(xs, [table[names[i]][s] for i in xs], marker="o", alpha=0.7, label=f"seed {s}")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(f"held-out {metric}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [out / f"{prefix}_accuracy.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    sig = "train/groups_with_signal"
    for v, by_seed in hist.items():
        per_step = step_values(by_seed, sig)
        steps = list(per_step)
        means = [sum(per_step[t]) / len(per_step[t]) for t in steps]
        ses = [_se(per_step[t]) for t in steps]
        (line,) = ax.plot(steps, means, marker=".", label=v)
        low = [m - e for m, e in zip(means, ses, strict=True)]
        high = [m + e for m, e in zip(means, ses, strict=True)]
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel("groups_with_signal (mean ± se over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / f"{prefix}_groups_with_signal.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


USAGE = ("usage: python -m composer_plugins.pipeline.paired STUDY_DIR [BASELINE] [HELDOUT_N] "
         "[--plots DIR [--prefix NAME]]")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m composer_plugins.pipeline.paired STUDY_DIR [BASELINE] [HELDOUT_N] [--plots DIR]``."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    plots, prefix = None, "sparse"
    for flag in ("--plots", "--prefix"):
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                raise SystemExit(f"{flag} needs a value\n{USAGE}")
            if flag == "--plots":
                plots = args[i + 1]
            else:
                prefix = args[i + 1]
            del args[i : i + 2]
    if not args:
        raise SystemExit(USAGE)
    base = args[1] if len(args) > 1 else "rl_only"
    print(study_report(args[0], base, heldout_n=int(args[2]) if len(args) > 2 else None))
    if plots:
        for p in plot_study(args[0], plots, prefix=prefix, baseline=base):
            print(f"wrote {p}")


if __name__ == "__main__":
    main()
