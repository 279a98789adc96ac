"""Backend overheads: our composed losses inside TRL, VeRL and PRIME-RL vs the upstream's own loss.

* **trl**: ``ComposerGRPOTrainer._compute_loss`` + backward vs ``GRPOTrainer._compute_loss`` + backward on
  the same generation batch of a tiny Qwen2 (policy channel only, so both compute the same loss).
* **verl**: ``composer_grpo`` (functional per-token loss, weights read off ``agg_loss``) vs VeRL's own
  ``vanilla`` PPO loss, forward + backward on random ``(B, T)`` log-probs, ``seq-mean-token-mean``.
* **prime_rl**: our ``loss_fn`` vs the functional ``dppo_kl_loss`` (PRIME-RL's default loss) per sample,
  aggregated PRIME-RL's way over ``B`` samples.

Each ratio is ours / upstream's in the same run (best of ``repeats``). Run:
``python -m benchmarks.bench_backends [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

NAME = "backends"
TARGETS = {
    "trl_composed_vs_grpotrainer_time": "<= 1.15 (the composed loss adds bookkeeping only)",
    "verl_composer_grpo_vs_vanilla_time": "<= 2.0 (one extra agg_loss probe per call)",
    "prime_rl_loss_fn_vs_dppo_time": "<= 1.3 (metric conversion only)",
}


def _best_pair(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Best-of-``repeats`` times of ``a`` and ``b``, run alternately (so load drift hits both alike)."""
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((a, b)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


def _bench_trl(quick: bool, repeats: int) -> dict[str, float]:
    from composer_plugins_trl.backend import ComposerGRPOTrainer
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from composer_plugins.models.tiny import TinyModelConfig, build_tiny_model, load_policy

    corpus = [f"Q: {a}+{b}=? A: {a + b}" for a in range(20) for b in range(20)]
    with tempfile.TemporaryDirectory() as d:
        size = 64 if quick else 128
        path = build_tiny_model(
            TinyModelConfig(
                vocab_size=300, hidden_size=size, intermediate_size=2 * size, num_layers=2, num_heads=4, num_kv_heads=2
            ),
            corpus,
            d,
        )
        model, tok = load_policy(path)
        G, C = 8, 16 if quick else 32
        args = GRPOConfig(
            output_dir=d,
            per_device_train_batch_size=G * 2,
            num_generations=G,
            max_completion_length=C,
            max_steps=1,
            use_cpu=True,
            report_to="none",
            bf16=False,
            save_strategy="no",
            loss_type="dapo",
            disable_tqdm=True,
        )
        ds = Dataset.from_list([{"prompt": f"Q: {a}+{a}=? A:"} for a in range(16)])
        tr = ComposerGRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **k: [float(len(c) % 3) for c in completions],
            args=args,
            train_dataset=ds,
            processing_class=tok,
        )
        tr.model.train()
        tr.current_gradient_accumulation_steps = 1
        inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))

        def ours() -> float:
            loss = tr._compute_loss(tr.model, inputs)
            loss.backward()
            return float(loss.detach())

        def theirs() -> float:
            loss = GRPOTrainer._compute_loss(tr, tr.model, inputs)
            loss.backward()
            return float(loss.detach())

        a, b = ours(), theirs()  # warm-up (and the same value)
        t_ours, t_theirs = _best_pair(ours, theirs, repeats)
        return {"trl_composed_s": t_ours, "trl_grpotrainer_s": t_theirs, "trl_abs_loss_diff": abs(a - b)}


def _bench_verl(quick: bool, repeats: int) -> dict[str, float]:
    from composer_plugins_verl import backend as CV
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    B, T = (64, 512) if quick else (128, 1024)
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(T) < torch.randint(T // 4, T, (B, 1), generator=g)).float()
    old = -torch.rand(B, T, generator=g) * 2
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    cfg = CV.make_actor_config("x", "seq-mean-token-mean")

    def call(name: str) -> Callable[[], float]:
        fn = get_policy_loss_fn(name)

        def run() -> float:
            lp = (old + 0.1 * torch.randn(B, T, generator=torch.Generator().manual_seed(1))).requires_grad_(True)
            loss, _ = fn(old, lp, adv, mask.bool(), "seq-mean-token-mean", cfg, None)
            loss.backward()
            return float(loss.detach())

        return run

    ours, vanilla = call("composer_grpo"), call("vanilla")
    ours(), vanilla()
    t_ours, t_vanilla = _best_pair(ours, vanilla, repeats)
    return {"verl_composer_grpo_s": t_ours, "verl_vanilla_s": t_vanilla}


def _bench_prime(quick: bool, repeats: int) -> dict[str, float]:
    from composer_plugins_prime_rl import backend as P

    from composer_plugins.losses import functional as F

    B, T = (32, 256) if quick else (128, 1024)
    g = torch.Generator().manual_seed(0)
    inf = -torch.rand(B, T, generator=g) * 2
    tr = (inf + 0.1 * torch.randn(B, T, generator=g)).requires_grad_(True)
    adv = torch.randn(B, generator=g).unsqueeze(-1).expand(B, T)
    mask = torch.ones(B, T, dtype=torch.bool)
    samples = P.samples_from_batch(tr, inf, adv, mask)

    def ours() -> float:
        loss, _ = P.aggregate(samples, P.loss_fn)
        loss.backward()
        return float(loss.detach())

    def dppo(s: Any, **_: Any) -> Any:
        out = F.dppo_kl_loss(s.trainer_logprobs, s.inference_logprobs, s.advantages, s.loss_mask)
        return P.LossOutputs(loss=out.loss, metrics=out.metrics)  # PRIME-RL's default returns its metrics too

    def base() -> float:
        loss, _ = P.aggregate(samples, dppo)
        loss.backward()
        return float(loss.detach())

    ours(), base()
    t_ours, t_base = _best_pair(ours, base, repeats)
    return {"prime_rl_loss_fn_s": t_ours, "prime_rl_dppo_s": t_base}


def run(quick: bool = False) -> dict[str, Any]:
    """Time each backend's composed loss against the upstream's own; return results, ratios, targets."""
    torch.set_num_threads(1)
    repeats = 7 if quick else 15
    results: dict[str, float] = {}
    for part in (_bench_trl, _bench_verl, _bench_prime):
        results.update(part(quick, repeats))
    ratios = {
        "trl_composed_vs_grpotrainer_time": results["trl_composed_s"] / results["trl_grpotrainer_s"],
        "verl_composer_grpo_vs_vanilla_time": results["verl_composer_grpo_s"] / results["verl_vanilla_s"],
        "prime_rl_loss_fn_vs_dppo_time": results["prime_rl_loss_fn_s"] / results["prime_rl_dppo_s"],
    }
    return {"name": NAME, "results": results, "ratios": ratios, "targets": TARGETS}


def _print(report: dict[str, Any]) -> None:
    print("bench_backends")
    for k, v in report["results"].items():
        print(f"  {k:<32}{v:>12.5f}")
    for k, v in report["ratios"].items():
        print(f"  {k:<40}{v:>7.3f}   target {report['targets'][k]}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    report = run(quick=a.quick)
    print(json.dumps(report, indent=2)) if a.json else _print(report)


if __name__ == "__main__":
    main()
