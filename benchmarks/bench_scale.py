"""Memory and speed of the composed RL step at a real vocabulary, against TRL ``GRPOTrainer``.

Each configuration runs in its own process (peak RSS is per process) on the same locally built
model (random weights, the tiny tokenizer; ids past the tokenizer decode to nothing), the same
prompts and the same batch:

* **CPU proxy** (every machine): the real Qwen2.5 vocabulary (151,936) with a small body
  (hidden 64, 2 layers), 4 prompts × 8 generations × 128 new tokens, fp32.
* **GPU** (when CUDA is present): Qwen2.5-0.5B and Qwen2.5-1.5B shapes, 8 × 8 × 256, bf16 mixed
  precision; peak ``torch.cuda.max_memory_allocated``.

Configurations: composer ``grpo``; ``grpo + hint_distill`` (every row fails, so every row is
hinted and gets a teacher forward); ``grpo + hint_distill + replay`` (4 DPO pairs per step); TRL
``GRPOTrainer`` (``loss_type="grpo"``, ``beta=0``). Both sides score completions with the same
seeded random reward in [0, 1), so every group has non-zero advantages. Composer runs through the
project's Lightning ``Trainer`` (:func:`~composer_plugins.training.train.build_trainer`).

Ratios: peak RSS / one fp32 logits tensor of the batch (``rows × (prompt + completion) × vocab``
floats, what one plain forward of the batch returns), peak RSS / TRL's, tokens/s / TRL's.

Run: ``python -m benchmarks.bench_scale [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("grpo", "grpo+hint", "grpo+hint+replay", "trl_grpo")
SHAPES = {
    "cpu": {"shape": "cpu-proxy", "prompts": 4, "generations": 8, "new_tokens": 128, "device": "cpu"},
    "gpu-0.5b": {"shape": "qwen2.5-0.5b", "prompts": 8, "generations": 8, "new_tokens": 256, "device": "cuda"},
    "gpu-1.5b": {"shape": "qwen2.5-1.5b", "prompts": 8, "generations": 8, "new_tokens": 256, "device": "cuda"},
}


class RandomRewardEnv:
    """The GSM8K env with a seeded uniform reward in [0, 1): non-zero group advantages for any policy."""

    def __init__(self, base: Any, seed: int = 0) -> None:
        self.base = base
        self.rng = random.Random(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def reward(self, prompts: Any, completions: Any, **kwargs: Any) -> list[float]:
        return [self.rng.random() for _ in completions]


def _trl_reward(rng: random.Random) -> Any:
    def random_reward(prompts: Any = None, completions: Any = None, **kwargs: Any) -> list[float]:
        return [rng.random() for _ in completions]

    return random_reward


def _config(tmp: str, spec: dict[str, Any], model_dir: str, pairs: str, variant: str) -> Any:
    from composer_plugins.training.train import loads_train_config

    gpu = spec["device"] == "cuda"
    hint = variant in ("grpo+hint", "grpo+hint+replay")
    replay = variant == "grpo+hint+replay"
    text = f"""
output_dir: {tmp}/run
model: {{name_or_path: {model_dir}, dtype: float32}}
sft: {{enabled: false}}
losses:
  grpo: {{weight: 1.0}}
  hint_distill: {{weight: 0.5, enabled: {str(hint).lower()}}}
  replay: {{name: replay_dpo, weight: 0.1, enabled: {str(replay).lower()}}}
hints: {{provider: {{name: template, reveal_answer: true}}}}
replay: {{pairs_path: {pairs}, pairs_per_step: 4}}
rollout: {{prompts_per_step: {spec["prompts"]}, num_generations: {spec["generations"]},
          max_new_tokens: {spec["new_tokens"]}, temperature: 1.0, success_threshold: 1.0}}
trainer: {{max_steps: 1000, checkpoint_every_n_steps: 0, enable_progress_bar: false,
          accelerator: {"gpu" if gpu else "cpu"}, precision: {"bf16-mixed" if gpu else "32-true"}}}
eval: {{at_start: false, at_end: false}}
"""
    cfg, _ = loads_train_config(text)
    return cfg


def _peak() -> dict[str, float]:
    out = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    import torch

    if torch.cuda.is_available():
        out["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def child(variant: str, spec: dict[str, Any], model_dir: str, pairs: str, steps: int) -> dict[str, Any]:
    """One configuration in this process: ``steps`` timed steps after one warm-up step."""
    import torch

    from benchmarks.bench_training import _tasks, composed_steps, trl_steps
    from composer_plugins.training.train import build_env

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(tmp, spec, model_dir, pairs, "grpo" if variant == "trl_grpo" else variant)
        env = RandomRewardEnv(build_env(cfg), seed=0)
        batches = _tasks(env.base, cfg, steps + 1)
        prompt_tokens = 0
        if variant == "trl_grpo":
            env.reward_fn = lambda: _trl_reward(env.rng)  # type: ignore[attr-defined]
            res = trl_steps(model_dir, env, cfg, batches, device=spec["device"])
            if isinstance(res, str):
                return {"error": res}
            timed = res[1:]
        else:
            from composer_plugins.training.module import ComposerModule

            module = ComposerModule(cfg, env=env)
            composed_steps(module, cfg, batches[:1], 0)
            timed = composed_steps(module, cfg, batches[1:], 1)
            prompt_tokens = max(len(module.tokenizer(t["prompt"])["input_ids"]) for b in batches for t in b)
        secs = sum(x["s"] for x in timed)
        toks = sum(x["tokens"] for x in timed)
        return {"step_s": secs / len(timed), "tokens_per_s": toks / secs, "tokens_per_step": toks / len(timed),
                "max_prompt_tokens": prompt_tokens, **_peak()}  # fmt: skip


def _prepare(tmp: Path, shape: str) -> tuple[str, str, int]:
    """The shaped model (random weights, tiny tokenizer) and a replay pairs file; returns (model, pairs, vocab)."""
    from composer_plugins.models.tiny import MODEL_SHAPES, build_shaped_model
    from composer_plugins.training.train import build_env, loads_train_config, resolve_policy

    cfg, _ = loads_train_config(
        f"cache_dir: {os.environ.get('COMPOSER_CACHE_DIR', '.composer_cache')}\nsft: {{enabled: false}}"
    )
    env = build_env(cfg)
    tok_dir = resolve_policy(cfg, env)
    model = build_shaped_model(tok_dir, tmp / f"model-{shape}", shape)
    pairs = tmp / "pairs.jsonl"
    with pairs.open("w") as f:
        for t in env.sample_tasks(16, "train", seed=3):
            wrong = t["target"].replace(f"#### {t['answer']}", f"#### {int(t['answer']) + 1}")
            f.write(json.dumps({"prompt": t["prompt"], "chosen": t["target"], "rejected": wrong}) + "\n")
    return str(model), str(pairs), int(MODEL_SHAPES[shape]["vocab_size"])


def _spawn(variant: str, spec_name: str, model: str, pairs: str, steps: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "r.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "benchmarks.bench_scale", "--child", variant, "--spec", spec_name,
               "--model", model, "--pairs", pairs, "--steps", str(steps), "--json", str(out)]  # fmt: skip
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
        res = json.loads(out.read_text())
        res["process_s"] = time.perf_counter() - t0
        return res


def run(quick: bool = False) -> dict[str, Any]:
    """Every configuration of every shape this machine has; returns ``{"name", "results", "ratios", "targets"}``."""
    import torch

    steps = 1 if quick else 2
    specs = ["cpu"] + (["gpu-0.5b", "gpu-1.5b"] if torch.cuda.is_available() else [])
    results: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as td:
        for name in specs:
            spec = SHAPES[name]
            model, pairs, vocab = _prepare(Path(td), spec["shape"])
            rows = spec["prompts"] * spec["generations"]
            for variant in VARIANTS:
                if name != "cpu" and variant == "grpo+hint":
                    continue  # on GPU: grpo, the full composition and TRL
                r = _spawn(variant, name, model, pairs, steps, timeout=3600)
                results[f"{name}/{variant}"] = r
            base = results.get(f"{name}/grpo", {})
            trl = results.get(f"{name}/trl_grpo", {})
            seq = spec["new_tokens"] + int(base.get("max_prompt_tokens") or 0)
            logits_gib = rows * seq * vocab * 4 / 2**30
            results[f"{name}/fp32_logits_gib"] = logits_gib
            mem = "peak_cuda_gib" if name != "cpu" else "peak_rss_gib"
            for variant in VARIANTS[:3]:
                r = results.get(f"{name}/{variant}", {})
                if mem in r:
                    ratios[f"{name}/{variant}_mem_vs_logits"] = r[mem] / logits_gib
                    if mem in trl:
                        ratios[f"{name}/{variant}_mem_vs_trl"] = r[mem] / trl[mem]
                if "tokens_per_s" in r and "tokens_per_s" in trl:
                    ratios[f"{name}/{variant}_speed_vs_trl"] = r["tokens_per_s"] / trl["tokens_per_s"]
    return {
        "name": "scale",
        "results": results,
        "ratios": ratios,
        "targets": {
            "cpu/grpo+hint_mem_vs_logits": "<= 0.6 (peak RSS vs one fp32 logits tensor of the batch)",
            "cpu/grpo+hint_mem_vs_trl": "<= 0.5 (peak RSS vs TRL grpo)",
            "cpu/grpo_speed_vs_trl": ">= 0.9 (completion tokens/s vs TRL grpo)",
            "gpu-0.5b/grpo+hint+replay_mem_vs_trl": "<= 1.5 (peak CUDA memory vs TRL grpo)",
            "gpu-0.5b/grpo_speed_vs_trl": ">= 1.0",
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one timed step per configuration instead of two")
    p.add_argument("--json", default=None, help="also write the result dict here")
    p.add_argument("--child", default=None, choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--spec", default="cpu", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pairs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        res = child(a.child, SHAPES[a.spec], a.model, a.pairs, a.steps)
        Path(a.json).write_text(json.dumps(res))
        return 0
    res = run(quick=a.quick)
    print(f"{'configuration':<28} {'step s':>8} {'tok/s':>8} {'peak RSS GiB':>13} {'peak CUDA GiB':>14}")
    for k, r in res["results"].items():
        if isinstance(r, dict):
            if "error" in r:
                print(f"{k:<28} error: {r['error'][:200]}")
                continue
            cuda = f"{r['peak_cuda_gib']:>14.2f}" if "peak_cuda_gib" in r else f"{'-':>14}"
            print(f"{k:<28} {r['step_s']:>8.2f} {r['tokens_per_s']:>8.1f} {r['peak_rss_gib']:>13.2f} {cuda}")
        else:
            print(f"{k:<28} {r:.2f} GiB")
    for k, v in res["ratios"].items():
        print(f"{k}: {v:.3f}  (target {res['targets'].get(k, '-')})")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
