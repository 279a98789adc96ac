"""The report stage: metrics.json, the DVC plot files, the ablation table and the paired report."""

from __future__ import annotations

import csv
import fnmatch
import json
import math
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_plugins.core.errors import ConfigError
from composer_plugins.core.io import atomic_write_json
from composer_plugins.pipeline import study
from composer_plugins.pipeline.common import PATHS, is_num, md_table
from composer_plugins.pipeline.stage_eval import eval_envs, start_run
from composer_plugins.training.lightning import tracking


def collect(evals_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every ``<evals_dir>/*.json`` written by :func:`evaluate`, flattened to ablation records."""
    recs = []
    for p in sorted(Path(evals_dir).glob("*.json")):
        d = json.loads(p.read_text())
        rec = {"run": d["run"], "variant": d["variant"], "seed": d["seed"], "channels": d["channels"]}
        rec.update({study.canonical_metric(k): v for k, v in d["metrics"].items()})
        recs.append(rec)
    return recs


#: The external teacher's held-out evaluation (the ``eval_teacher`` stage), reported beside the variants.
TEACHER_EVAL = "results/teacher.json"


def teacher_metrics(path: str | os.PathLike[str] = TEACHER_EVAL) -> dict[str, float] | None:
    """The held-out metrics of the positive control's external teacher (``None`` when it was not evaluated)."""
    p = Path(path)
    if not p.is_file():
        return None
    m = json.loads(p.read_text()).get("metrics") or {}
    return {study.canonical_metric(k): float(v) for k, v in m.items() if is_num(v) and not k.startswith("sft/")}


def teacher_eval_file(model: str | os.PathLike[str]) -> Path | None:
    """The held-out eval of the teacher model at ``model`` (a path from here): ``<d>/results/teacher.json`` of the
    study ``d`` above it whose eval names this model (``../b/models/teacher/model`` -> ``../b/results/teacher.json``);
    ``None``: not measured."""
    p = Path(os.path.normpath(model))
    for d in p.parents:
        f = d / TEACHER_EVAL
        if f.is_file() and os.path.normpath(d / str(json.loads(f.read_text()).get("model", ""))) == str(p):
            return f
    return None


def policy(fraction: float) -> str:
    """``rollout.on_policy_fraction`` in words: 1 on-policy, 0 off-policy, else mixed."""
    return "on-policy" if fraction >= 1 else "off-policy" if fraction <= 0 else f"mixed ({fraction:g} on-policy)"


def cell_used(params: Mapping[str, Any], root: Path, variant: str, metric: str) -> dict[str, Any]:
    """What ``variant``'s cells of the study at ``root`` (a path from here, ``params`` its params) train with, read
    from their own config as the train stage builds it (:func:`.stage_train.train_config`): the channels, on- or
    off-policy, each teacher distilled from (its path from here, its measured ``metric`` or "not measured") and
    the warm start (its model, SFT seed and steps, and ``metric`` from ``<root>/evals/sft.json``)."""
    from composer_plugins.pipeline.stage_train import channel_flags, train_config
    from composer_plugins.training.config.loss_specs import losses_mapping

    cfg = train_config(params, variant, study.seeds(params)[0], pairs=None)
    flags = channel_flags(cfg)
    on = [k for k, v in flags.items() if v]
    frac = float((cfg.get("rollout") or {}).get("on_policy_fraction", 1.0))
    kind = "distillation" if on and all(c.endswith("distill") for c in on) else "RL"
    losses = losses_mapping(cfg.get("losses"), pre="train.") or {}
    teachers = []
    for t in (t for k in on if isinstance(losses.get(k), Mapping) for t in losses[k].get("teachers") or []):
        path = t.get("model_path")
        model = os.path.normpath(root / path) if path else str(t.get("id") or t.get("kind"))
        ev = teacher_eval_file(model) if path else None
        acc = (teacher_metrics(ev) or {}).get(metric) if ev else None
        teachers.append({"model": model, metric: "not measured" if acc is None else _r(acc)})
    sft = json.loads(f.read_text()) if (f := root / PATHS["evals"] / "sft.json").is_file() else {}
    acc = (sft.get("metrics") or {}).get(metric)
    return {
        "description": f"{policy(frac)} {kind}",
        "channels": "+".join(on) or "none",
        "on_policy_fraction": frac,
        "trains_on": "its own samples"
        if frac >= 1
        else "the dataset's reference completions"
        if frac <= 0
        else f"its own samples on {frac:g} of the steps, the dataset's reference completions on the rest",
        "teachers": teachers,
        "start": {
            "study": root.as_posix(),
            "model": os.path.normpath(root / cfg["model"]["name_or_path"]),
            "sft_seed": int((cfg.get("sft") or {}).get("seed", 0)),
            "sft_steps": (cfg.get("sft") or {}).get("steps"),
            metric: None if acc is None else _r(acc),
        },
    }


def cells_used(
    params: Mapping[str, Any], roots: Sequence[Path], metric: str
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """``({variant: arm}, starts)``: :func:`cell_used` of every variant over the warm starts' studies ``roots``
    (each with its own ``params.yaml``; ``params`` for ``.``). A field the starts disagree on lists each value."""
    cells: dict[str, list[dict[str, Any]]] = {}
    starts = []
    for root in roots:
        own = root == Path(".") or not (root / "params.yaml").is_file()
        rp = params if own else study.load_params(root / "params.yaml")
        mine = {v: cell_used(rp, root, v, metric) for v in study.variants(params) if v in study.variants(rp)}
        for v, c in mine.items():
            cells.setdefault(v, []).append(c)
        starts += [c["start"] for c in list(mine.values())[:1]]
    arms = {}
    for v, cs in cells.items():
        arm = {k: _one([c[k] for c in cs]) for k in ("description", "channels", "on_policy_fraction", "trains_on")}
        seen = {t["model"]: t for c in cs for t in c["teachers"]}
        arms[v] = {**arm, "teachers": list(seen.values()), "starts": [c["start"]["study"] for c in cs]}
    return arms, starts


def _one(xs: Sequence[Any]) -> Any:
    return xs[0] if all(x == xs[0] for x in xs) else list(dict.fromkeys(xs))


def _s(x: Any) -> str:
    """A table cell: a number to 3 places, ``None`` as "not measured", a list joined."""
    if isinstance(x, list):
        return "; ".join(_s(y) for y in x)
    return "not measured" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def used_md(arms: Mapping[str, Mapping[str, Any]], starts: Sequence[Mapping[str, Any]], metric: str) -> str:
    """Markdown: what each arm trained with (:func:`cells_used`) and each warm start, for results/paired.md."""
    head = ["variant", "what it does", "channels", "trains on", f"teacher ({metric})", "warm starts"]
    teachers = {v: ", ".join(f"{t['model']} ({_s(t[metric])})" for t in a["teachers"]) for v, a in arms.items()}
    rows = [
        [v, _s(a["description"]), _s(a["channels"]), _s(a["trains_on"]), teachers[v] or "none", ", ".join(a["starts"])]
        for v, a in arms.items()
    ]
    head2 = ["warm start", "model", "SFT seed", "SFT steps", metric, "RL seeds"]
    rows2 = [[s["study"], s["model"], *map(str, (s["sft_seed"], s["sft_steps"])), _s(s[metric])] for s in starts]
    rows2 = [[*r, ", ".join(map(str, s.get("seeds", [])))] for r, s in zip(rows2, starts, strict=True)]
    return (
        f"What each arm trained with (each cell's own train config):\n\n{md_table(head, rows)}\n\n"
        f"The warm starts:\n\n{md_table(head2, rows2)}\n\n"
    )


def paired_summary(
    params: Mapping[str, Any],
    fam: Mapping[str, Sequence[Any]],
    arms: Mapping[str, Mapping[str, Any]],
    starts: Sequence[Mapping[str, Any]],
    metric: str,
    effects_csv: Path,
) -> dict[str, Any]:
    """``results/paired.json`` (its fields: docs/pipeline.md, "Where results land"); ``effects_csv`` gets the tests
    as the forest plot's rows (``test`` names the arm by what it does)."""
    bars = study.bars(params)
    tests = []
    for e in (e for part in fam.values() for e in part):
        lo, hi = (e.low, e.high) if math.isnan(e.adj_low) else (e.adj_low, e.adj_high)
        t = {"variant": e.variant, "vs": e.baseline, "metric": e.metric, "effect": _r(e.mean), "lo": _r(lo)}
        t.update(hi=_r(hi), p=_r(e.p), p_holm=_r(e.p_adjusted), verdict=e.verdict, n=e.n)
        if e.metric == metric and e.variant in bars:
            t.update(bar=bars[e.variant], passes=bool(lo >= bars[e.variant]))
        if "blocks" in e.extra:  # each warm start's mean difference
            t["per_start"] = {b: _r(x["mean"]) for b, x in e.extra["blocks"].items()}
        if "start" in e.extra:  # a test within one warm start (study.control: each_start)
            t["start"] = e.extra["start"]
        tests.append(t)
    control = control_result(bars, tests)
    if control["passes"] is False:  # a control that fails its bars calibrates nothing: say so on every channel
        for t in tests:
            if t["variant"] not in bars and t["metric"] == metric:
                t["verdict"] = f"uncalibrated: {t['verdict']}"
    with effects_csv.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["test", "metric", "effect", "lo", "hi", "verdict", "bar"])
        for t in tests:
            what = _s(arms.get(t["variant"], {}).get("description", ""))
            name = f"{t['variant']} ({what}) − {t['vs']}" if what else f"{t['variant']} − {t['vs']}"
            w.writerow([name, t["metric"], t["effect"], t["lo"], t["hi"], t["verdict"], t.get("bar", "")])
    keys = ("variant", "vs", "metric", "bar", "lo", "passes", "start")
    return {
        "metric": metric,
        "task": (params.get("train") or {}).get("env"),
        "baseline": study.baseline(params),
        "family": next((e.family for part in fam.values() for e in part), 0),  # Holm's m
        "starts": list(starts),
        "arms": dict(arms),
        "bars": [{k: t[k] for k in keys if k in t} for t in tests if "bar" in t],
        "control": control,
        "tests": tests,
    }


def control_result(bars: Mapping[str, float], tests: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The positive control's outcome: ``passes`` is ``None`` without ``study.bars``, else whether every bar has a
    test whose Holm-level lower bound reaches it; ``text`` says so (and that the channels' verdicts are then
    uncalibrated)."""
    if not bars:
        return {"passes": None, "text": "No positive control (study.bars is empty)."}
    got: dict[str, list[Mapping[str, Any]]] = {}
    for t in (t for t in tests if "bar" in t):
        got.setdefault(t["variant"], []).append(t)
    for v, ts in got.items():  # bars applied to each start (study.control: each_start) judge on those tests
        if any("start" in t for t in ts):
            got[v] = [t for t in ts if "start" in t]
    parts = []
    for v, bar in bars.items():
        if v not in got:
            parts.append(f"{v}: no test (fails)")
            continue
        ts = got[v]
        where = f" on each of {len(ts)} starts" if "start" in ts[0] else ""
        low = min(ts, key=lambda t: t["lo"] if t["lo"] is not None else -math.inf)
        ok_v = all(t["passes"] for t in ts)
        parts.append(
            f"{v} − {ts[0]['vs']}{where}: Holm-level lower bound {_s(low['lo'])}"
            + (f" (lowest, {low['start']})" if where else "")
            + f" against {bar:+.2f}"
            + (" (passes)" if ok_v else " (fails)")
        )
    ok = all(v in got and all(t["passes"] for t in got[v]) for v in bars)
    head = "The positive control passes" if ok else "The positive control fails"
    tail = "." if ok else "; every channel's verdict below is uncalibrated."
    return {"passes": ok, "text": f"{head}: {'; '.join(parts)}{tail}"}


def report(
    params: Mapping[str, Any],
    evals_dir: str | os.PathLike[str] = PATHS["evals"],
    runs_dir: str | os.PathLike[str] = PATHS["runs"],
    metrics_out: str | os.PathLike[str] = "metrics.json",
    plots_dir: str | os.PathLike[str] = "plots",
    table_out: str | os.PathLike[str] = "results/ablation.md",
) -> dict[str, Any]:
    """Aggregate every study cell: ``metrics.json`` (per variant mean/std), plots and the ablation table.

    What each file holds (``used``, the ``teacher`` row, results/paired.*): docs/pipeline.md, "Where results land".
    """
    roots = [Path("."), *study.warm_starts(params)]  # this warm start's study, then the pooled ones
    recs = [{**r, "root": root.as_posix()} for root in roots for r in collect(root / evals_dir)]
    if not recs:
        raise ConfigError(f"no evaluation results in {evals_dir}/; run the eval stages first")
    order = {"sft": -1, **{v: i for i, v in enumerate(study.variants(params))}}
    recs.sort(key=lambda r: (order.get(r["variant"], len(order)), r["variant"], r["seed"]))
    metrics_names = [m for m in study.HEADLINE_METRICS if any(m in r for r in recs)]
    rows = study.ablation_rows(recs, metrics_names, group_by=("variant", "channels"))
    # metrics.json: {variant: {metric: {mean, std}}, ...} (flattened by DVC as variant.metric.mean)
    out: dict[str, Any] = {
        row["variant"]: {"n": row["n"], **{m: {"mean": _r(row[m][0]), "std": _r(row[m][1])} for m in metrics_names}}
        for row in rows
    }
    # plots: one bar per variant for the headline metric, and the curves of every run (long format)
    pdir = Path(plots_dir)
    pdir.mkdir(parents=True, exist_ok=True)
    with (pdir / "ablation.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "channels", "n", *metrics_names, *[f"{m} std" for m in metrics_names]])
        for row in rows:
            means, stds = ([_r(row[m][i]) for m in metrics_names] for i in (0, 1))
            w.writerow([row["variant"], row["channels"], row["n"], *means, *stds])
    metric = metrics_names[0] if metrics_names else "gsm8k/accuracy"
    arms, starts = cells_used(params, roots, metric)
    for st in starts:  # the RL seeds each start's cells ran
        st["seeds"] = sorted({r["seed"] for r in recs if r["variant"] != "sft" and r["root"] == st["study"]})
    label = {v: f"{v} ({_s(a['description'])})" for v, a in arms.items()}
    write_curves([root / runs_dir for root in roots], pdir / "train_curves.csv", pdir / "curves", label)
    note = ""
    used = {
        t["model"]: [v for v, a in arms.items() if t in a["teachers"]] for a in arms.values() for t in a["teachers"]
    }
    for model, who in used.items():
        ev = teacher_eval_file(model)
        t = teacher_metrics(ev) if ev else None
        shown = f"{', '.join(f'{m} {t[m]:.3f}' for m in metrics_names if m in t)} ({ev})" if t else "not measured"
        note += f"\n{', '.join(who)} distilled from the teacher {model}: {shown}.\n"
        if t and len(used) == 1:  # the one teacher every teacher cell used, measured
            out["teacher"] = {
                "n": 1,
                "model": model,
                **{m: {"mean": _r(t[m]), "std": 0.0} for m in metrics_names if m in t},
            }
    own = teacher_metrics(TEACHER_EVAL)
    if own and not any(teacher_eval_file(m) == Path(TEACHER_EVAL) for m in used):
        note += (
            f"\nThis study's own teacher stage ({TEACHER_EVAL}: {metric} {_s(own.get(metric))}) is used by no cell.\n"
        )
    for v, a in arms.items():  # as strings: `dvc metrics show` drops lists
        teachers = "; ".join(f"{t['model']} ({_s(t[metric])})" for t in a["teachers"]) or "none"
        if v in out:
            out[v]["used"] = {**a, "teachers": teachers, "starts": ", ".join(a["starts"])}
    with (pdir / "heldout.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "accuracy", "lo", "hi", "n"])
        for row in (r for r in rows if metric in r):
            mean, std = row[metric]
            se = std / math.sqrt(row["n"]) if row["n"] > 1 else 0.0
            name = label.get(row["variant"], f"{row['variant']} ({row['n']} warm starts)" if se else row["variant"])
            w.writerow([name, _r(mean), _r(mean - se), _r(mean + se), row["n"]])
        if "teacher" in out and metric in out["teacher"]:
            x = out["teacher"][metric]["mean"]
            w.writerow([f"teacher {out['teacher']['model']}", x, x, x, 1])
    table = study.format_table(rows, metrics_names, group_by=("variant", "channels"))
    header = "# Ablation: loss channels on/off × seeds (held-out, mean ± sample std over seeds)\n\n"
    study.write_text(table_out, header + table + "\n" + note)
    paired_text, fam = _paired_report(
        params, out, roots, evals_dir, runs_dir, metrics_names, used_md(arms, starts, metric)
    )
    paired_text += note
    atomic_write_json(metrics_out, out, sort_keys=True)
    paired_out = Path(table_out).with_name("paired.md")
    summary = paired_summary(params, fam, arms, starts, metric, pdir / "effects.csv")
    if summary["control"]["passes"] is not None:
        head, sep, rest = paired_text.partition("\n\n")
        paired_text = f"{head}{sep}**{summary['control']['text']}**\n\n{rest}"
    study.write_text(paired_out, paired_text)
    atomic_write_json(paired_out.with_suffix(".json"), summary)
    _log_report(params, out, [metrics_out, table_out, paired_out, paired_out.with_suffix(".json"), pdir])
    return {"metrics": out, "table": table, "rows": rows, "paired": paired_text}


#: The per-step training curve whose run mean metrics.json and the paired table carry per variant.
SIGNAL = "train/groups_with_signal"
#: Per-step columns whose run mean (mean/std over seeds) metrics.json carries per variant.
RUN_MEANS = (SIGNAL, "train/hint/teacher_margin", "train/hint/fraction", "train/reward")


def _paired_report(
    params: Mapping[str, Any],
    out: dict[str, Any],
    roots: Sequence[Path],
    evals_dir: str | os.PathLike[str],
    runs_dir: str | os.PathLike[str],
    metrics_names: Sequence[str],
    used: str = "",
) -> tuple[str, dict[str, list[Any]]]:
    """Add the run means of :data:`RUN_MEANS` and the paired effects against ``study.baseline`` to metrics.json's
    ``out`` (``paired_vs_<baseline>``, ``minus_sft``, ``each_start``), reading the studies at ``roots``
    (:func:`.paired.read_study_dir`). Returns results/paired.md (``used`` after its title) and the test family.
    """
    from composer_plugins.pipeline import paired

    recs, hist = paired.read_study_dir(roots, evals_dir, runs_dir)
    blocked = study.blocking(params)  # study.blocking: warm_start / random_start (by the seed's warm start)
    blocks = paired.seed_blocks(recs) if blocked != "none" else None
    each_start = list(study.bars(params)) if study.control(params) == "each_start" else []
    signal = paired.run_means(hist, SIGNAL)
    for col in RUN_MEANS:  # run means over steps, mean/std over seeds
        for v, by_seed in (signal if col == SIGNAL else paired.run_means(hist, col)).items():
            if v in out:
                mean, std = study.mean_std(list(by_seed.values()))
                out[v][col] = {"mean": _r(mean), "std": _r(std)}
    base = study.baseline(params)
    title = "# Paired effects: each variant minus the baseline, per seed (docs/results.md)\n\n" + used
    if base is None:
        return title + "No paired baseline: set `study.baseline` to a variant of `study.variants`.\n", {}
    names = [v for v in study.variants(params) if v != base]
    metric = metrics_names[0] if metrics_names else "gsm8k/accuracy"
    for m in [*metrics_names, SIGNAL]:
        table = signal if m == SIGNAL else paired.by_variant_seed(recs, m)
        if base not in table or m == metric:
            continue
        for v in names:
            if v in table and v in out:
                e = paired.paired_effect(table[v], table[base], name=v, baseline_name=base, metric=m, blocks=blocks)
                out[v].setdefault(f"paired_vs_{base}", {})[m] = _effect_row(e)
    delta = study.threshold_delta(params)
    start = paired.warm_start_values(recs, metric)
    margin = study.equivalence_margin(params)
    fam = paired.report_family(
        recs, hist, base, metric, blocked, delta=delta, start=start, margin=margin, each_start=each_start
    )
    for part, effects in fam.items():
        for e in effects:
            if e.variant not in out:
                continue
            key = {"signal": SIGNAL, "curve": "curve/" + e.metric.partition(" ")[2]}.get(part, metric)
            row = {**_effect_row(e), "p_holm": _r(e.p_adjusted), "verdict": e.verdict}
            row.update(variant_mean=_r(e.variant_mean), baseline_mean=_r(e.baseline_mean))
            row.update({k: (_r(x) if isinstance(x, float) else x) for k, x in e.extra.items()})
            if part == "each_start":  # one start's test: {vs: {start: row}} (study.control: each_start)
                out[e.variant].setdefault("each_start", {}).setdefault(e.baseline, {})[e.extra["start"]] = row
                continue
            out[e.variant].setdefault("minus_sft" if part == "start" else f"paired_vs_{base}", {})[key] = row
    heldout_n = eval_envs(params).get("gsm8k", {}).get("num_problems")
    columns = {c for by_seed in hist.values() for rows in by_seed.values() for r in rows for c in r}
    fractions = sorted(c for c in columns if c.startswith(FRACTION_COLUMNS))
    gap_file = Path(GAP_FILE)  # `composer-plugins study gap` (before RL), when it was run
    gap = json.loads(gap_file.read_text()) if gap_file.exists() else None
    text = paired.study_report(
        roots,
        base,
        metric,
        heldout_n=heldout_n,
        evals=evals_dir,
        runs=runs_dir,
        delta=delta,
        fractions=fractions,
        gap=gap,
        margin=margin,
        blocking=blocked,
        each_start=each_start,
    )
    return title + text + "\n", fam


#: The gap predictor's result (``composer-plugins study gap``), read by the report when present.
GAP_FILE = "results/gap.json"


#: Per-step history columns of each channel's active-row fraction (the paired report lists their run means).
FRACTION_COLUMNS = ("train/hint/fraction", "train/teacher_distill/fraction", "train/grpo/fraction")


def _effect_row(e: Any) -> dict[str, Any]:
    """A paired effect as metrics.json holds it: mean difference, se, interval and p, rounded."""
    return {"diff": _r(e.mean), "se": _r(e.se), "low": _r(e.low), "high": _r(e.high), "p": _r(e.p)}


def _r(v: Any) -> Any:
    if v is None:
        return None
    v = float(v)
    return None if v != v else round(v, 6)


#: ``history.csv`` columns plotted per step (docs/metrics.md names): the run's totals, then each
#: channel's ``loss`` and ``pairs`` (a third-party channel's columns match the same patterns).
CURVE_PATTERNS: tuple[str, ...] = (
    "train/reward",
    "train/loss",
    "train/accuracy",
    "train/groups_with_signal",
    "train/hint/rows",
    "train/hint/fraction",
    "train/hint/teacher_margin",
    "train/heldout/accuracy",
    "train/*/loss",
    "train/*/pairs",
)


def curve_columns(columns: Iterable[str]) -> list[str]:
    """The columns of :data:`CURVE_PATTERNS` among ``columns`` (full names), in pattern order."""
    cols = list(dict.fromkeys(columns))
    out: list[str] = []
    for pat in CURVE_PATTERNS:
        out += [c for c in cols if c not in out and fnmatch.fnmatchcase(c, pat) and c.count("/") == pat.count("/")]
    return out


def curve_file(metric: str) -> str:
    """``train/grpo/loss`` -> ``train.grpo.loss.csv`` (one file per curve under ``plots/curves/``)."""
    return metric.replace("/", ".") + ".csv"


def write_curves(
    runs_dir: Path | Sequence[Path],
    out: Path,
    curves_dir: Path | None = None,
    labels: Mapping[str, str] | None = None,
) -> int:
    """Per-step curves of every run for DVC plots; returns the number of rows of ``out``.

    From each run's ``history.csv``: ``out``, the table ``step, run, variant, seed, arm`` + every curve column;
    ``curves_dir``, one ``<metric>.csv`` each; ``arm`` = ``labels[variant]`` (docs/pipeline.md, "Where results land").
    """
    rows: list[dict[str, Any]] = []
    seen: list[str] = []
    dirs = [runs_dir] if isinstance(runs_dir, Path) else list(runs_dir)
    for hist in sorted(h for d in dirs for h in d.glob("*/history.csv")):
        name = hist.parent.name
        try:
            variant, seed = study.parse_run_name(name)
        except ValueError:
            variant, seed = name, -1
        with hist.open() as f:
            for r in csv.DictReader(f):
                vals = {study.history_column(k): v for k, v in r.items() if k}
                seen += [k for k in vals if k not in seen]
                row: dict[str, Any] = {"step": int(float(vals["step"])), "run": name, "variant": variant, "seed": seed}
                row["arm"] = (labels or {}).get(variant, variant)
                row.update({k: _r(v) for k, v in vals.items() if k != "step" and v not in ("", None)})
                rows.append(row)
    cols = curve_columns(seen)
    keys = ["step", "run", "variant", "seed", "arm"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*keys, *cols], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    if curves_dir is not None:
        if curves_dir.exists():
            shutil.rmtree(curves_dir)  # a channel switched off must not leave a stale curve behind
        curves_dir.mkdir(parents=True)
        for col in cols:
            with (curves_dir / curve_file(col)).open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=[*keys, col], extrasaction="ignore")
                w.writeheader()
                w.writerows(r for r in rows if r.get(col) is not None)
    return len(rows)


def _log_report(params: Mapping[str, Any], metrics: Mapping[str, Any], artifacts: Sequence[Any]) -> str | None:
    if not tracking.mlflow_enabled(params):
        return None
    client, rid = start_run(params, "report", tracking.run_tags())
    from mlflow.entities import Metric

    flat = tracking.flatten(metrics, sep="/")
    client.log_batch(
        rid, metrics=[Metric(study.canonical_metric(k), float(v), 0, 0) for k, v in flat.items() if is_num(v)]
    )
    for a in artifacts:
        p = Path(a)
        if p.is_dir():
            client.log_artifacts(rid, str(p), artifact_path=p.name)
        elif p.exists():
            client.log_artifact(rid, str(p))
    client.set_terminated(rid, "FINISHED")
    return rid
