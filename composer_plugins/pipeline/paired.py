"""The paired report of a study: its tables (markdown, text, json, csv), read from a study directory, and plots.

The statistics it prints (paired effects, Holm, curve AUC, time to threshold) are :mod:`.stats`, whose
names this module re-exports. ``composer-plugins compare --paired`` prints :func:`format_paired` of the
eval runs in MLflow; ``python -m composer_plugins.pipeline.paired STUDY_DIR`` the report of a study dir.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from composer_plugins.pipeline.common import md_table, text_table
from composer_plugins.pipeline.stats import (
    ALPHA,
    CURVE,
    CURVE_FILE,
    DEFAULT_DELTA,
    Histories,
    PairedEffect,
    by_variant_seed,
    curve_auc,
    curve_effects,
    curve_points,
    curve_start,
    gap_correlation,
    heldout_se,
    holm,
    paired_effect,
    paired_rows,
    run_means,
    step_means,
    step_values,
    steps_to_target,
    study_effects,
    t_critical,
    t_pvalue,
    time_to_threshold,
    verdict,
)
from composer_plugins.pipeline.study import canonical_metric, history_column, parse_run_name

__all__ = [
    "ALPHA",
    "CURVE",
    "CURVE_FILE",
    "DEFAULT_DELTA",
    "Histories",
    "PairedEffect",
    "by_variant_seed",
    "curve_auc",
    "curve_effects",
    "curve_points",
    "curve_start",
    "format_paired",
    "gap_correlation",
    "heldout_se",
    "holm",
    "main",
    "paired_effect",
    "paired_rows",
    "plot_study",
    "read_study_dir",
    "run_means",
    "seed_blocks",
    "step_means",
    "step_values",
    "steps_to_target",
    "study_effects",
    "study_report",
    "t_critical",
    "t_pvalue",
    "time_to_threshold",
    "verdict",
]


def _f(x: float | None, nd: int = 3, sign: bool = False) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"


def format_paired(effects: Sequence[PairedEffect], fmt: str = "markdown", heldout_n: int | None = None) -> str:
    """The paired table (markdown, text, json or csv); with ``heldout_n`` the held-out sampling error too."""
    if fmt == "json":
        return json.dumps([{**asdict(e), "n": e.n, "verdict": e.verdict} for e in effects], indent=2)
    head = [
        "variant",
        "vs",
        "metric",
        "seeds",
        "variant mean",
        "baseline mean",
        "paired diff (mean)",
        "se",
        "95% CI",
        "verdict",
    ]
    corrected = any(e.correction for e in effects)
    if corrected:
        head[-1:] = ["p", "Holm p", "Holm-level CI", "verdict (Holm)"]
    if heldout_n:
        head.insert(6, f"held-out se (m={heldout_n})")
    rows = []
    for e in effects:
        ci = f"[{_f(e.low, sign=True)}, {_f(e.high, sign=True)}]"
        row = [
            e.variant,
            e.baseline,
            e.metric,
            str(e.n),
            _f(e.variant_mean),
            _f(e.baseline_mean),
            _f(e.mean, sign=True),
            _f(e.se),
            ci,
            e.verdict,
        ]
        if corrected:
            adj = f"[{_f(e.adj_low, sign=True)}, {_f(e.adj_high, sign=True)}]"
            row[-1:] = [_f(e.p, 4), _f(e.p_adjusted, 4), adj, e.verdict]
        if heldout_n:
            hse = heldout_se(e.baseline_mean, heldout_n)
            row.insert(6, _f(hse))
            if e.verdict in ("helps", "hurts") and abs(e.mean) < hse:
                row[-1] += " (but |effect| < held-out se)"
        rows.append(row)
    if fmt == "csv":
        return "\n".join(",".join(c.replace(",", ";") for c in r) for r in [head, *rows])
    return md_table(head, rows) if fmt == "markdown" else text_table(head, rows)


def read_study_dir(
    root: str | Path | Sequence[str | Path], evals: str | Path = "evals", runs: str | Path = "runs"
) -> tuple[list[dict[str, Any]], Histories]:
    """Eval records (``variant``, ``seed``, metrics) and histories ``{variant: {seed: rows}}`` of a study dir
    (``evals``, ``runs`` relative to it). Several roots (``study.warm_starts``) are pooled: each record names its
    ``warm_start`` (the root), and a seed may occur in one root only."""
    if not isinstance(root, str | Path):
        roots = [Path(r) for r in root]
        parts = [read_study_dir(r, evals, runs) for r in roots]
        owner: dict[int, Path] = {}
        for r, (recs, _) in zip(roots, parts, strict=True):
            for s in {x["seed"] for x in recs if x["seed"] is not None}:
                if s in owner:
                    raise ValueError(
                        f"seed {s} has cells in both {owner[s]} and {r}: each SFT warm start's study needs seeds of "
                        "its own (study.seeds in its overrides.yaml), so that cells pair by seed"
                    )
                owner[s] = r
        hist: Histories = {}
        for _, h in parts:
            for v, by_seed in h.items():
                hist.setdefault(v, {}).update(by_seed)
        return [x for recs, _ in parts for x in recs], hist
    root = Path(root)
    recs: list[dict[str, Any]] = []
    for f in sorted((root / evals).glob("*.json")):
        v, s = ("sft", None) if f.stem == "sft" else parse_run_name(f.stem)
        data = json.loads(f.read_text())
        recs.append(
            {
                "variant": v,
                "seed": s,
                "warm_start": root.as_posix(),
                "correct": dict(data.get("correct") or {}),
                **{canonical_metric(k): x for k, x in data.get("metrics", {}).items()},
            }
        )
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
        start = f.parent / CURVE_FILE
        if start.exists() and not any(int(r.get("step", -1)) == 0 for r in rows):
            with start.open() as fh:
                zero = [float(r["value"]) for r in csv.DictReader(fh) if int(float(r["step"])) == 0]
            if zero:  # the starting policy's curve point (history.csv rows start at step 1)
                rows.insert(0, {"step": 0.0, CURVE: zero[0]})
        hist.setdefault(v, {})[s] = rows
    return recs, hist


def warm_start_values(recs: Sequence[Mapping[str, Any]], metric: str) -> float | dict[int, float] | None:
    """The SFT start's ``metric``: one value, or ``{seed: value}`` when the records pool several warm starts."""
    sft = {r.get("warm_start"): r[metric] for r in recs if r["variant"] == "sft" and metric in r}
    if len(sft) <= 1:
        return next(iter(sft.values()), None)
    return {
        int(r["seed"]): float(sft[r.get("warm_start")])
        for r in recs
        if r["variant"] != "sft" and r.get("seed") is not None and r.get("warm_start") in sft
    }


def problem_scores(recs: Sequence[Mapping[str, Any]], metric: str) -> dict[str, dict[int, list[float]]]:
    """``{variant: {seed: per-problem 0/1}}`` for ``metric``'s env (``gsm8k/accuracy`` -> ``gsm8k``) from each
    eval's ``correct`` string; the SFT start's under ``"sft"``, keyed by every seed run from it."""
    env = metric.split("/", 1)[0]

    def bits(r: Mapping[str, Any]) -> list[float] | None:
        c = (r.get("correct") or {}).get(env)
        return [1.0 if ch == "1" else 0.0 for ch in c] if isinstance(c, str) and c else None

    out: dict[str, dict[int, list[float]]] = {}
    sft = {r.get("warm_start"): b for r in recs if r["variant"] == "sft" and (b := bits(r)) is not None}
    for r in recs:
        if r["variant"] == "sft" or r.get("seed") is None or (b := bits(r)) is None:
            continue
        out.setdefault(str(r["variant"]), {})[int(r["seed"])] = b
        if r.get("warm_start") in sft:
            out.setdefault("sft", {})[int(r["seed"])] = sft[r.get("warm_start")]
    return out


def report_family(
    recs: Sequence[Mapping[str, Any]],
    hist: Histories,
    baseline: str,
    metric: str,
    mode: str,
    *,
    delta: float = DEFAULT_DELTA,
    start: float | Mapping[int, float] | None = None,
    margin: float | None = None,
    each_start: Sequence[str] = (),
) -> dict[str, list[PairedEffect]]:
    """Every test of a study report, Holm-corrected as one family, for ``study.blocking`` ``mode``:
    :func:`study_effects`, or with ``random_start`` :func:`.crossed.crossed_family`."""
    blocks = seed_blocks(recs) if mode != "none" else None
    if mode == "random_start":
        from composer_plugins.pipeline.crossed import crossed_family

        return crossed_family(problem_scores(recs, metric), baseline, metric, blocks or {}, margin, each_start)
    return study_effects(recs, hist, baseline, metric, delta=delta, start=start, margin=margin, blocks=blocks)


def seed_blocks(recs: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """``{seed: warm start}`` of a pooled study's records (:func:`read_study_dir` names each record's root)."""
    return {int(r["seed"]): str(r.get("warm_start", ".")) for r in recs if r.get("seed") is not None}


def study_report(
    root: str | Path | Sequence[str | Path],
    baseline: str = "rl_only",
    metric: str = "gsm8k/accuracy",
    heldout_n: int | None = None,
    evals: str | Path = "evals",
    runs: str | Path = "runs",
    delta: float = DEFAULT_DELTA,
    fractions: Sequence[str] = (),
    gap: Mapping[str, Any] | None = None,
    margin: float | None = None,
    blocking: bool | str = False,
    each_start: Sequence[str] = (),
) -> str:
    """Markdown: the paired tables (``metric``, ``train/groups_with_signal``, the held-out curve), Holm-corrected.

    What they show: docs/pipeline.md, "The ablation table". ``blocking``: ``study.blocking`` (:func:`report_family`);
    ``fractions``: history columns whose run means per variant it lists; ``gap``: ``results/gap.json`` (:mod:`.gap`).
    """
    recs, hist = read_study_dir(root, evals, runs)
    out = []
    start = warm_start_values(recs, metric)
    for r in (r for r in recs if r["variant"] == "sft" and metric in r):
        se = f" (held-out se {heldout_se(r[metric], heldout_n):.4f})" if heldout_n else ""
        where = f" (warm start {r['warm_start']})" if isinstance(start, Mapping) else ""
        out.append(f"SFT start{where}: {metric} = {r[metric]:.4f}{se}\n")
    mode = ("warm_start" if blocking else "none") if isinstance(blocking, bool) else blocking
    blocks = seed_blocks(recs) if mode != "none" else None
    fam = report_family(
        recs, hist, baseline, metric, mode, delta=delta, start=start, margin=margin, each_start=each_start
    )
    sig, curve = "train/groups_with_signal", fam.get("curve", [])
    m = next((e.family for t in fam.values() for e in t), 0)
    out.append(
        f"Verdicts: Holm's family-wise correction over the {m} tests of this report (every table below; "
        f"family-wise error {ALPHA}). *helps*/*hurts* only where the Holm-adjusted p is below {ALPHA}, i.e. the "
        "interval at the test's Holm level excludes zero; the 95% CI column is the uncorrected per-test interval."
        + (
            f" Otherwise an accuracy test is *equivalent within ±{margin:g}* where its Holm-level interval lies inside "
            f"(-{margin:g}, {margin:g}) (two one-sided tests, δ = study.equivalence_margin), else *inconclusive*.\n"
            if margin is not None
            else "\n"
        )
    )
    if mode == "random_start":
        out.append(
            f"Starts and problems random (study.blocking: random_start): each effect is the mean over the "
            f"{len(set(blocks.values())) if blocks else 0} warm starts of each start's mean paired difference; its "
            "se adds the starts' sampling variance (the per-start means' variance over the number of starts) and "
            "the held-out problems' (the per-problem differences' variance over the number of problems), t on "
            "starts − 1 degrees of freedom. The verdicts are about SFT starts built by this recipe and problems drawn "
            "by this generator. Only the final accuracy tests and the baseline's move from its start form the "
            "family. Each start's mean difference is listed after the tables.\n"
        )
    elif blocks is not None and len(set(blocks.values())) > 1:
        out.append(
            f"Blocked by warm start (study.blocking): each effect is the mean of the {len(set(blocks.values()))} "
            "starts' mean differences, each start weighing the same; its se comes from the seeds' spread around "
            "their own start's mean (pooled within-start variance, seeds − starts degrees of freedom). A difference "
            "between the starts is part of the effect, not of its noise: the verdicts are about these warm starts, "
            "not SFT starts in general. Each start's mean difference is listed after the tables.\n"
        )
    out.append(format_paired(fam["final"], "markdown", heldout_n=heldout_n))
    if "signal" in fam:
        out += ["", format_paired(fam["signal"], "markdown")]
    if curve:
        thr = next((e.extra for e in curve if "threshold" in e.extra), None)
        what = (
            (
                f"and the first evaluated step reaching the threshold {thr['threshold']:.3f} (the step-0 value + "
                f"δ = {thr['delta']:.3f}, the same for both arms; a run of either arm that never reaches it is "
                "censored at its last step + one interval)"
            )
            if thr and "thresholds" not in thr
            else (
                f"and the first evaluated step reaching its seed's threshold (that seed's step-0 value + δ = "
                f"{thr['delta']:.3f}, the same for both arms; per seed: "
                + ", ".join(f"{s} {x:.3f}" for s, x in sorted(thr["thresholds"].items()))
                + "; a run of either arm that never reaches it is censored at its last step + one interval)"
            )
            if thr
            else "(no step-0 value: no time to threshold)"
        )
        head = (
            f"Held-out learning curve ({CURVE}, greedy, fixed subset): final value, area under the curve from "
            f"step 0 divided by the run's length, {what}."
        )
        out += ["", head, "", format_paired(curve, "markdown")]
        cens = [(e.variant, e.extra["censored"], e.extra["censored_baseline"]) for e in curve if "censored" in e.extra]
        if cens:
            out += [
                "",
                "censored (never reached the threshold), variant / baseline seeds: "
                + ", ".join(f"{v} {a} / {baseline} {b}" for v, a, b in cens),
            ]
        pts = {v: step_values(by_seed, CURVE) for v, by_seed in hist.items()}
        steps_all = sorted({s for p in pts.values() for s in p})
        if steps_all:
            rows = [
                [str(t), *(f"{sum(p[t]) / len(p[t]):.3f}" if t in p else "" for p in pts.values())] for t in steps_all
            ]
            out += ["", f"{CURVE} per evaluated step (mean over seeds):", "", md_table(["step", *pts], rows)]
    if "start" in fam:
        out += [
            "",
            f"Does RL move the start? {baseline} minus its seed's SFT warm start ({metric}; in the family above):",
            "",
            format_paired(fam["start"], "markdown", heldout_n=heldout_n),
        ]
    if fam.get("each_start"):
        out += [
            "",
            f"The positive control within each warm start (study.control: each_start; {metric}, the held-out "
            "problems as the sample, in the family above):",
            "",
            format_paired(fam["each_start"], "markdown", heldout_n=heldout_n),
            "",
            "Starts, in the order of the rows: " + ", ".join(e.extra["start"] for e in fam["each_start"]) + ".",
        ]
    per_start = [e for part in ("final", "start") for e in fam.get(part, []) if "blocks" in e.extra]
    if per_start:
        starts = list(per_start[0].extra["blocks"])
        head = ["variant", "vs", *(f"{b} (seeds {per_start[0].extra['blocks'][b]['seeds']})" for b in starts), "effect"]
        rows = []
        for e in per_start:
            cells = [_f(e.extra["blocks"].get(b, {}).get("mean", math.nan), sign=True) for b in starts]
            rows.append([e.variant, e.baseline, *cells, _f(e.mean, sign=True)])
        out += ["", f"Each warm start's mean difference ({metric}; the blocked effect is their mean):", ""]
        out.append(md_table(head, rows))
    cols = [c for c in fractions if any(c in r for by_seed in hist.values() for rows in by_seed.values() for r in rows)]
    if cols:
        rows = []
        for v in hist:
            rm = [run_means({v: hist[v]}, c, missing=0.0).get(v, {}) for c in cols]
            rows.append([v, *(_f(sum(x.values()) / len(x)) if x else "0.000" for x in rm)])
        out += ["", "Active rows per channel (run mean of each per-step fraction, mean over seeds):", ""]
        out.append(md_table(["variant", *cols], rows))
    if gap and gap.get("variants"):
        effects = {e.variant: e.mean for e in fam["final"]}
        head = ["variant", "teacher", "margin (nats/token)", "fix rate", "coverage", f"final effect vs {baseline}"]
        eff = {v: _f(x, sign=True) for v, x in effects.items()}
        rows = [
            [v, t, _f(g.get("margin"), sign=True), _f(g.get("fix_rate")), _f(g.get("coverage")), eff.get(v, "n/a")]
            for v, teachers in gap["variants"].items()
            for t, g in teachers.items()
        ]
        corr = [
            f"{k} r = {_f(gap_correlation(gap, effects, k)['pearson_r'], 2, sign=True)} "
            f"(n = {gap_correlation(gap, effects, k)['n']})"
            for k in ("margin", "fix_rate")
        ]
        out += [
            "",
            f"Gap predictor (before RL, {gap.get('num_prompts')} training prompts, from {gap.get('model')}): "
            "each teacher's gap to the student beside the variant's final effect; correlation over the "
            "variants with a teacher (mean over its teachers): " + "; ".join(corr) + ".",
            "",
            md_table(head, rows),
        ]
    steps = step_means(hist, sig)
    if steps:
        n = max(len(x) for x in steps.values())
        rows = [[str(i + 1), *(f"{x[i]:.3f}" if i < len(x) else "" for x in steps.values())] for i in range(n)]
        out += ["", f"{sig} per step (mean over seeds):", "", md_table(["step", *steps], rows)]
    return "\n".join(out)


def _se(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def plot_study(
    root: str | Path,
    out_dir: str | Path,
    metric: str = "gsm8k/accuracy",
    prefix: str = "sparse",
    baseline: str = "rl_only",
) -> list[Path]:
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


USAGE = (
    "usage: python -m composer_plugins.pipeline.paired STUDY_DIR [BASELINE] [HELDOUT_N] [--plots DIR [--prefix NAME]]"
)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m composer_plugins.pipeline.paired STUDY_DIR [BASELINE] [HELDOUT_N] [--plots DIR]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    opts = {"--plots": None, "--prefix": "sparse"}
    for flag in opts:
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args):
                raise SystemExit(f"{flag} needs a value\n{USAGE}")
            opts[flag] = args[i + 1]
            del args[i : i + 2]
    if not args:
        raise SystemExit(USAGE)
    base = args[1] if len(args) > 1 else "rl_only"
    print(study_report(args[0], base, heldout_n=int(args[2]) if len(args) > 2 else None))
    if opts["--plots"]:
        for p in plot_study(args[0], opts["--plots"], prefix=opts["--prefix"], baseline=base):
            print(f"wrote {p}")


if __name__ == "__main__":
    main()
