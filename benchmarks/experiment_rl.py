"""Does the recipe work? Held-out accuracy at the SFT start, after RL only, and after RL + hint distillation.

For every seed: a short SFT warm start of the embedded tiny model on the GSM8K-format generator
(cached by config hash), then two RL runs from that same start with the same seed and data:
``rl`` (the ``grpo`` channel alone) and ``rl+hint`` (``grpo`` + ``hint_distill``). All three
policies are evaluated on the same held-out problems (greedy accuracy, pass@k, mean reward,
torchmetrics). Prints a table with mean ± std over seeds and writes the raw numbers as JSON.

Run: ``python -m benchmarks.experiment_rl --seeds 0 1 2`` (``--quick`` for a smoke run).
Any config key can be overridden: ``--set rollout.num_generations=8 trainer.max_steps=60``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The experiment's arms: name -> loss overrides.
ARMS: dict[str, list[str]] = {
    "rl": ["losses.hint_distill.enabled=false"],
    "rl+hint": [],
}


def _metrics_of(trainer_metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {k.split("/", 1)[1]: v for k, v in trainer_metrics.items() if k.startswith(prefix + "/")}


def run_seed(seed: int, config: str | None, overrides: list[str], out_root: Path) -> dict[str, Any]:
    """SFT start + both RL arms for one seed; returns ``{arm: {accuracy, pass@k, mean_reward, ...}}``."""
    from composer_plugins.training.config.train import load_train_config
    from composer_plugins.training.runs.run import run_train

    base = [f"seed={seed}", f"sft.seed={seed}", *overrides]
    row: dict[str, Any] = {"seed": seed}
    for arm, arm_over in ARMS.items():
        cfg, src = load_train_config(config, [*base, *arm_over, f"output_dir={out_root}/seed{seed}/{arm}"])
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, at_start=arm == "rl", at_end=True))
        t0 = time.time()
        res = run_train(cfg, src)
        if arm == "rl":
            row["sft"] = _metrics_of(res.start_metrics, "start")
        final = _metrics_of(res.metrics, "val")
        hist = res.history
        final["train_reward_first5"] = statistics.fmean(r["train/reward"] for r in hist[:5])
        final["train_reward_last5"] = statistics.fmean(r["train/reward"] for r in hist[-5:])
        if arm == "rl+hint":
            final["hint_loss_mean"] = statistics.fmean(r.get("train/hint_distill/loss", 0.0) for r in hist)
            final["hint_rows_mean"] = statistics.fmean(r.get("train/hint/rows", 0.0) for r in hist)
        final["seconds"] = time.time() - t0
        row[arm] = final
        print(f"seed {seed} {arm}: {json.dumps({k: round(v, 4) for k, v in final.items()})}", flush=True)
    print(f"seed {seed} sft: {json.dumps({k: round(v, 4) for k, v in row['sft'].items()})}", flush=True)
    return row


def _ms(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: one line per stage, mean ± std over seeds."""
    k = next(m for m in rows[0]["sft"] if m.startswith("pass_at_"))
    lines = [
        f"| stage | held-out accuracy (greedy) | Δ accuracy vs SFT start (paired) | {k} | mean reward | seeds |",
        "|---|---|---|---|---|---|",
    ]
    for stage, label in (("sft", "SFT start"), ("rl", "after RL only (grpo)"), ("rl+hint", "after RL + hint distill")):
        acc = [r[stage]["accuracy"] for r in rows]
        delta = [r[stage]["accuracy"] - r["sft"]["accuracy"] for r in rows]
        pk = [r[stage][k] for r in rows]
        mr = [r[stage]["mean_reward"] for r in rows]
        d = "—" if stage == "sft" else ("+" + _ms(delta) if statistics.fmean(delta) >= 0 else _ms(delta))
        lines.append(f"| {label} | {_ms(acc)} | {d} | {_ms(pk)} | {_ms(mr)} | {len(rows)} |")
    hint = [r["rl+hint"].get("hint_loss_mean", 0.0) for r in rows]
    lines.append("")
    lines.append(
        f"hint_distill loss (mean over steps): {_ms(hint)}; per-seed accuracy: "
        + ", ".join(
            f"seed {r['seed']}: {r['sft']['accuracy']:.3f} -> "
            f"{r['rl']['accuracy']:.3f} / {r['rl+hint']['accuracy']:.3f}"
            for r in rows
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--config", default=None, help="base config (default: the packaged configs/default.yaml)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--out", default="runs/experiment_rl")
    p.add_argument("--quick", action="store_true", help="a smoke run: few steps, small eval")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("COMPOSER_THREADS", "1")))
    config = a.config
    overrides = ["trainer.enable_progress_bar=false", "sft.progress=false", *a.set]
    if a.quick:
        overrides = ["trainer.max_steps=4", "eval.num_problems=32", "sft.steps=40", *overrides]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_seed(s, config, overrides, out) for s in a.seeds]
    text = table(rows)
    print()
    print(
        f"command: python -m benchmarks.experiment_rl --seeds {' '.join(map(str, a.seeds))}"
        + (f" --set {' '.join(a.set)}" if a.set else "")
        + (" --quick" if a.quick else "")
    )
    print(text)
    (out / "results.json").write_text(json.dumps({"rows": rows, "config": config, "overrides": overrides}, indent=2))
    (out / "results.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
