"""Each live loss channel's gradient norm at a study's starting policy, on the same rollouts.

A channel's weight sets its share of every optimizer step only together with the size of its
gradient, and with ``trainer.gradient_clip_val`` the channels share one clipped update: an
auxiliary channel whose gradient is larger than the RL channel's takes most of each step. This
measures that share where it matters, at the policy a variant starts from, on the rollouts and
replay pairs of its first steps (docs/results.md, "Why replay hurt").

Run it in a study directory after ``dvc repro`` has written ``models/sft`` and ``data/pairs.jsonl``::

    python ../../scripts/grad_share.py --variant replay --steps 8      # studies/<name>/
    python scripts/grad_share.py --variant no_hint                     # the repository's study

It prints, per step, ``{channel: ||weight * grad L_channel||}`` and, for every channel other than
``--reference`` (default ``grpo``), the ratio of its norm to the reference channel's (mean, median).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import yaml


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params.yaml", help="the study's params.yaml")
    ap.add_argument("--variant", required=True, help="a study.variants key")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=8, help="training batches measured (the run's first ones)")
    ap.add_argument("--reference", default="grpo", help="the channel the others are compared with")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the figures to this JSON file")
    a = ap.parse_args(argv)

    from composer_plugins.pipeline import stages
    from composer_plugins.training.config.train import train_config_from_dict
    from composer_plugins.training.lightning.module import ComposerModule
    from composer_plugins.training.rollout.rewards import TaskStream, task_drawer
    from composer_plugins.training.step.components import build_env
    from composer_plugins.training.step.policy import load_policy_for

    params = yaml.safe_load(Path(a.params).read_text())
    cfg = train_config_from_dict(stages.train_config(params, a.variant, a.seed))
    env = build_env(cfg)
    policy, tok = load_policy_for(cfg, env)
    torch.manual_seed(cfg.seed)
    module = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env)
    live = [c for c in module.composer.channels if c.weight != 0.0]
    names = [c.name for c in live]
    if a.reference not in names:
        print(f"--reference {a.reference!r} is not a live channel of {a.variant!r}: {names}", file=sys.stderr)
        return 2
    stream = iter(TaskStream(task_drawer(env, cfg, "train"), cfg.rollout.prompts_per_step, a.steps, seed=cfg.seed))
    weights = {c.name: c.weight for c in live}
    per_step: list[dict[str, float]] = []
    for step in range(a.steps):
        seed = module.step_seed(step)
        rb = module.make_rollout_batch(next(stream)["tasks"], seed)
        norms: dict[str, float] = {}
        for ch in live:  # one channel at a time, at its configured weight, on the same rollouts
            for c in live:
                c.weight = weights[c.name] if c is ch else 0.0
            module.policy.zero_grad(set_to_none=True)
            loss, _ = module.loss_on(rb, seed)
            loss.backward()
            sq = sum(float((p.grad.float() ** 2).sum()) for p in module.policy.parameters() if p.grad is not None)
            norms[ch.name] = sq**0.5
        for c in live:
            c.weight = weights[c.name]
        per_step.append(norms)
        print(step + 1, {k: round(v, 4) for k, v in norms.items()})
    summary: dict[str, dict[str, float]] = {}
    for n in names:
        if n == a.reference:
            continue
        r = [s[n] / max(s[a.reference], 1e-12) for s in per_step]
        summary[n] = {"mean_ratio": statistics.mean(r), "median_ratio": statistics.median(r)}
        print(f"{n} / {a.reference} gradient norm: mean {statistics.mean(r):.2f}, median {statistics.median(r):.2f}")
    if a.json_out:
        out = {"variant": a.variant, "per_step": per_step, "ratios": summary}
        Path(a.json_out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
