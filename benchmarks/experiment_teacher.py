"""Does on-policy distillation from a stronger external teacher help? A small paired experiment (not a timed test).

The student is the default config's SFT warm start; the teacher is the same tiny architecture SFT'd
``--teacher-sft-factor`` times longer (a stronger policy, built and cached the same way). From the one
student start, for every seed (the RL seed: rollouts, task order), the arms:

* ``rl_only``: ``grpo`` alone;
* ``grpo+teacher``: ``grpo`` + ``teacher_distill`` (the teacher as a ``causal_lm`` scorer, top-20, reverse KL);
* ``teacher_only``: ``teacher_distill`` alone (``grpo`` weight 0);
* ``hint+teacher``: ``grpo`` + ``hint_distill`` + ``teacher_distill``.

Each final policy is evaluated greedily on the same held-out problems; the table gives each arm's
accuracy (mean ± std over seeds) and its paired difference to ``rl_only`` per seed, with the cost
side (teacher calls, seconds per step). Writes the raw numbers as JSON.

Run: ``python -m benchmarks.experiment_teacher --seeds 0 1 2 --out runs/experiment_teacher``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _teacher(path: str, topk: int) -> str:
    return f"[{{kind: causal_lm, id: teacher, model_path: {path}, topk: {topk}}}]"


def arms(teacher: str, topk: int, weight: float) -> dict[str, list[str]]:
    t = [f"losses.teacher_distill.weight={weight}", f"losses.teacher_distill.teachers={_teacher(teacher, topk)}"]
    return {
        "rl_only": ["losses.hint_distill.enabled=false"],
        "grpo+teacher": ["losses.hint_distill.enabled=false", *t],
        "teacher_only": ["losses.hint_distill.enabled=false", "losses.grpo.weight=0.0", *t],
        "hint+teacher": t,
    }


def _val(metrics: dict[str, float]) -> dict[str, float]:
    return {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("val/")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", default=None, help="a subset of the arms (default: all)")
    p.add_argument("--out", default="runs/experiment_teacher")
    p.add_argument("--teacher-sft-factor", type=float, default=4.0)
    p.add_argument("--topk", type=int, default=20)
    p.add_argument("--weight", type=float, default=1.0, help="the teacher_distill channel's weight")
    p.add_argument("--set", nargs="*", default=[], help="config overrides for every run (key=value)")
    a = p.parse_args(argv)
    from composer_plugins.training.config.train import load_train_config
    from composer_plugins.training.runs.run import run_eval, run_train
    from composer_plugins.training.step.policy import resolve_policy

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = ["eval.num_problems=200", "eval.k=1", "eval.num_samples=1", "trainer.checkpoint_every_n_steps=0", *a.set]
    cfg, src = load_train_config(None, [*base, f"output_dir={out}/probe"])
    student = resolve_policy(cfg)
    t_steps = int(cfg.sft.steps * a.teacher_sft_factor)
    tcfg, tsrc = load_train_config(None, [*base, f"sft.steps={t_steps}", f"output_dir={out}/teacher"])
    teacher = resolve_policy(tcfg)
    report: dict[str, Any] = {"student": student, "teacher": teacher, "teacher_sft_steps": t_steps, "rows": []}
    report["student_eval"] = run_eval(cfg, src, checkpoint=student, output=str(out / "student_eval.json"))
    report["teacher_eval"] = run_eval(tcfg, tsrc, checkpoint=teacher, output=str(out / "teacher_eval.json"))
    print("student", report["student_eval"], "teacher", report["teacher_eval"], flush=True)
    table = arms(teacher, a.topk, a.weight)
    chosen = a.arms or list(table)
    for seed in a.seeds:
        row: dict[str, Any] = {"seed": seed}
        for arm in chosen:
            c, s = load_train_config(None, [*base, f"seed={seed}", *table[arm], f"output_dir={out}/s{seed}/{arm}"])
            c = dataclasses.replace(c, eval=dataclasses.replace(c.eval, at_start=False, at_end=True))
            t0 = time.time()
            res = run_train(c, s)
            hist = res.history
            val = _val(res.metrics)
            val["seconds_per_step"] = (time.time() - t0) / max(len(hist), 1)
            if "teacher" in arm:
                val["teacher_loss_mean"] = statistics.fmean(r.get("train/teacher_distill/loss", 0.0) for r in hist)
                val["teacher_calls"] = hist[-1].get("train/teacher/teacher/calls", 0.0)
                val["teacher_seconds"] = hist[-1].get("train/teacher/teacher/seconds", 0.0)
                val["teacher_skipped_steps"] = sum(r.get("train/teacher/teacher/skipped", 0.0) for r in hist)
            row[arm] = val
            print(seed, arm, json.dumps(val), flush=True)
            (out / "report.json").write_text(json.dumps({**report, "rows": [*report["rows"], row]}, indent=2))
        report["rows"].append(row)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(summary(report, chosen))
    return 0


def summary(report: dict[str, Any], chosen: list[str]) -> str:
    """Per arm: held-out accuracy mean ± std, and the paired difference to rl_only (mean ± std, per seed)."""
    rows = report["rows"]
    key = next((k for k in rows[0].get("rl_only", {}) if k.endswith("/accuracy")), None) if rows else None
    lines = [f"student {report['student_eval']}", f"teacher {report['teacher_eval']}", f"metric {key}"]
    for arm in chosen:
        acc = [r[arm][key] for r in rows if arm in r and key in r[arm]]
        if not acc:
            continue
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        line = f"{arm:<14} acc {statistics.fmean(acc):.3f} ± {sd:.3f} (n={len(acc)})"
        if arm != "rl_only":
            d = [r[arm][key] - r["rl_only"][key] for r in rows if arm in r and "rl_only" in r]
            dsd = statistics.stdev(d) if len(d) > 1 else 0.0
            line += f"  paired diff {statistics.fmean(d):+.3f} ± {dsd:.3f}  per seed {[round(x, 3) for x in d]}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
