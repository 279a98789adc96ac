"""The report stage: metrics.json, the DVC plot files, the ablation table and the paired report."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_plugins.core.errors import ConfigError
from composer_plugins.core.io import atomic_write_json
from composer_plugins.pipeline import study
from composer_plugins.pipeline.common import PATHS, is_num
from composer_plugins.pipeline.stage_eval import eval_envs
from composer_plugins.training import tracking


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


def report(
    params: Mapping[str, Any],
    evals_dir: str | os.PathLike[str] = PATHS["evals"],
    runs_dir: str | os.PathLike[str] = PATHS["runs"],
    metrics_out: str | os.PathLike[str] = "metrics.json",
    plots_dir: str | os.PathLike[str] = "plots",
    table_out: str | os.PathLike[str] = "results/ablation.md",
    teacher_eval: str | os.PathLike[str] = TEACHER_EVAL,
) -> dict[str, Any]:
    """Aggregate every study cell: ``metrics.json`` (per variant mean/std), plots and the ablation table.

    With ``teacher_eval`` (the external teacher's held-out evaluation) metrics.json gets a ``teacher`` row and
    both tables a line naming its accuracy: the positive control's teacher is measured before it is used.
    """
    roots = [Path("."), *study.warm_starts(params)]  # this warm start's study, then the pooled ones
    recs = [r for root in roots for r in collect(root / evals_dir)]
    if not recs:
        raise ConfigError(f"no evaluation results in {evals_dir}/; run the eval stages first")
    order = {"sft": -1, **{v: i for i, v in enumerate(study.variants(params))}}
    recs.sort(key=lambda r: (order.get(r["variant"], len(order)), r["variant"], r["seed"]))
    metrics_names = [m for m in study.HEADLINE_METRICS if any(m in r for r in recs)]
    rows = study.ablation_rows(recs, metrics_names, group_by=("variant", "channels"))
    # metrics.json: {variant: {metric: {mean, std}}, ...} (flattened by DVC as variant.metric.mean)
    out: dict[str, Any] = {}
    for row in rows:
        out[row["variant"]] = {
            "n": row["n"],
            **{m: {"mean": _r(row[m][0]), "std": _r(row[m][1])} for m in metrics_names},
        }
    Path(metrics_out).parent.mkdir(parents=True, exist_ok=True)
    # plots: one bar per variant for the headline metric, and the curves of every run (long format)
    pdir = Path(plots_dir)
    pdir.mkdir(parents=True, exist_ok=True)
    with (pdir / "ablation.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "channels", "n", *[f"{m}" for m in metrics_names], *[f"{m} std" for m in metrics_names]])
        for row in rows:
            w.writerow(
                [
                    row["variant"],
                    row["channels"],
                    row["n"],
                    *[_r(row[m][0]) for m in metrics_names],
                    *[_r(row[m][1]) for m in metrics_names],
                ]
            )
    write_curves([root / runs_dir for root in roots], pdir / "train_curves.csv", pdir / "curves")
    table = study.format_table(rows, metrics_names, group_by=("variant", "channels"))
    header = "# Ablation: loss channels on/off × seeds (held-out, mean ± sample std over seeds)\n\n"
    teacher = teacher_metrics(teacher_eval)
    note = ""
    if teacher is not None:
        out["teacher"] = {"n": 1, **{m: {"mean": _r(teacher[m]), "std": 0.0} for m in metrics_names if m in teacher}}
        shown = ", ".join(f"{m} {teacher[m]:.3f}" for m in metrics_names if m in teacher)
        note = f"\nThe external teacher of the teacher variants ({teacher_eval}, not a variant): {shown}.\n"
    study.write_text(table_out, header + table + "\n" + note)
    paired_text = _paired_report(params, out, roots, evals_dir, runs_dir, metrics_names) + note
    atomic_write_json(metrics_out, out, sort_keys=True)
    paired_out = Path(table_out).with_name("paired.md")
    study.write_text(paired_out, paired_text)
    _log_report(params, out, [metrics_out, table_out, paired_out, pdir])
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
) -> str:
    """Add ``train/groups_with_signal`` and the paired effects against ``study.baseline`` to ``out``.

    ``out`` is metrics.json's ``{variant: {...}}``: each variant gets the run mean of
    ``train/groups_with_signal`` (mean/std over seeds) and, when ``study.baseline`` names a variant,
    ``paired_vs_<baseline>``: ``{metric: {diff, se, low, high}}`` (per-seed differences, Student t 95%
    interval; :mod:`.paired`). ``roots``: the study directory, then every pooled warm start's
    (``study.warm_starts``), as :func:`.paired.read_study_dir` reads them. Returns the markdown of
    ``results/paired.md``.
    """
    from composer_plugins.pipeline import paired

    recs, hist = paired.read_study_dir(roots, evals_dir, runs_dir)
    blocked = study.blocking(params)  # study.blocking: warm_start blocks every test by the seed's warm start
    blocks = paired.seed_blocks(recs) if blocked else None
    signal = paired.run_means(hist, SIGNAL)
    for col in RUN_MEANS:  # run means over steps, mean/std over seeds
        for v, by_seed in (signal if col == SIGNAL else paired.run_means(hist, col)).items():
            if v in out:
                mean, std = study.mean_std(list(by_seed.values()))
                out[v][col] = {"mean": _r(mean), "std": _r(std)}
    base = study.baseline(params)
    title = "# Paired effects: each variant minus the baseline, per seed (docs/results.md)\n\n"
    if base is None:
        return title + "No paired baseline: set `study.baseline` to a variant of `study.variants`.\n"
    names = [v for v in study.variants(params) if v != base]
    metric = metrics_names[0] if metrics_names else "gsm8k/accuracy"
    for m in [*metrics_names, SIGNAL]:
        table = signal if m == SIGNAL else paired.by_variant_seed(recs, m)
        if base not in table or m == metric:
            continue
        for v in names:
            if v in table and v in out:
                e = paired.paired_effect(table[v], table[base], name=v, baseline_name=base, metric=m, blocks=blocks)
                out[v].setdefault(f"paired_vs_{base}", {})[m] = {
                    "diff": _r(e.mean),
                    "se": _r(e.se),
                    "low": _r(e.low),
                    "high": _r(e.high),
                    "p": _r(e.p),
                }
    delta = study.threshold_delta(params)
    start = paired.warm_start_values(recs, metric)
    # the report's family of tests (final accuracy, signal, curve), Holm-corrected together
    margin = study.equivalence_margin(params)
    fam = paired.study_effects(recs, hist, base, metric, delta=delta, start=start, margin=margin, blocks=blocks)
    for part, effects in fam.items():
        for e in effects:
            if e.variant not in out:
                continue
            key = (
                metric
                if part in ("final", "start")
                else SIGNAL
                if part == "signal"
                else "curve/" + e.metric.split(" ", 1)[1]
            )
            row = {
                "diff": _r(e.mean),
                "se": _r(e.se),
                "low": _r(e.low),
                "high": _r(e.high),
                "p": _r(e.p),
                "p_holm": _r(e.p_adjusted),
                "verdict": e.verdict,
                "variant_mean": _r(e.variant_mean),
                "baseline_mean": _r(e.baseline_mean),
            }
            row.update({k: (_r(x) if isinstance(x, float) else x) for k, x in e.extra.items()})
            out[e.variant].setdefault("minus_sft" if part == "start" else f"paired_vs_{base}", {})[key] = row
    heldout_n = eval_envs(params).get("gsm8k", {}).get("num_problems")
    fractions = sorted(
        {
            c
            for by_seed in hist.values()
            for rows in by_seed.values()
            for r in rows
            for c in r
            if c.startswith(FRACTION_COLUMNS)
        }
    )
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
    )
    return title + text + "\n"


#: The gap predictor's result (``composer-plugins study gap``), read by the report when present.
GAP_FILE = "results/gap.json"


#: Per-step history columns of each channel's active-row fraction (the paired report lists their run means).
FRACTION_COLUMNS = ("train/hint/fraction", "train/teacher_distill/fraction", "train/grpo/fraction")


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
    import fnmatch

    cols = list(dict.fromkeys(columns))
    out: list[str] = []
    for pat in CURVE_PATTERNS:
        out += [c for c in cols if c not in out and fnmatch.fnmatchcase(c, pat) and c.count("/") == pat.count("/")]
    return out


def curve_file(metric: str) -> str:
    """``train/grpo/loss`` -> ``train.grpo.loss.csv`` (one file per curve under ``plots/curves/``)."""
    return metric.replace("/", ".") + ".csv"


def write_curves(runs_dir: Path | Sequence[Path], out: Path, curves_dir: Path | None = None) -> int:
    """Per-step curves of every run for DVC plots; returns the number of rows of ``out``.

    ``out`` (``plots/train_curves.csv``) is the long table ``step, run, variant, seed`` + every
    curve column; ``curves_dir`` (``plots/curves/``) gets one ``<metric>.csv`` per curve
    (``step, run, variant, seed, <metric>``), which dvc.yaml plots as a directory: a channel that
    logs ``<channel>/loss`` gets its plot without any change to dvc.yaml. Reads
    ``<runs_dir>/<variant>-s<seed>/history.csv`` (old unprefixed columns are read under their current names).
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
                row.update({k: _r(v) for k, v in vals.items() if k != "step" and v not in ("", None)})
                rows.append(row)
    cols = curve_columns(seen)
    keys = ["step", "run", "variant", "seed"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*keys, *cols], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    if curves_dir is not None:
        import shutil

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
    uri = tracking.tracking_uri(params)
    client = tracking.client(uri)
    exp_id = tracking.ensure_experiment(client, tracking.experiment_name(params), uri)
    tags = tracking.run_tags()
    if tags[tracking.TAG_STAGE] == "manual":
        tags[tracking.TAG_STAGE] = "report"
    run = client.create_run(exp_id, run_name=tracking.run_name("report"), tags=tags)
    rid = run.info.run_id
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
