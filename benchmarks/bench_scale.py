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
project's Lightning ``Trainer`` (:func:`~composer_plugins.training.lightning.trainer.build_trainer`).

Ratios: peak RSS / one fp32 logits tensor of the batch (``rows × (prompt + completion) × vocab``
floats, what one plain forward of the batch returns), peak RSS / TRL's, tokens/s / TRL's.

``--hint-distill KEY=VALUE`` (repeatable) adds one more configuration, ``grpo + hint_distill`` with
those ``losses.hint_distill`` settings (values parsed as YAML, passed to the config as they are:
``--hint-distill topk=100 --hint-distill teacher=ema``); ``--variants`` runs a subset.
``--shapes gpu-0.5b`` runs only the named shapes (then every listed variant runs on each, ``grpo+hint``
included on GPU), and ``--hint-all`` applies the ``--hint-distill`` settings to every hinted configuration
(``grpo+hint``, ``grpo+hint+replay``) instead of adding one: ``scripts/gpu_check.sh`` runs
``--shapes gpu-0.5b --hint-all --hint-distill teacher=ema --hint-distill topk=100``.

Run: ``python -m benchmarks.bench_scale [--quick] [--shapes cpu] [--variants grpo+hint] [--hint-distill topk=100]
[--hint-all] [--json out.json]``.
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
#: ``grpo + hint_distill`` with the ``--hint-distill`` settings (the child receives them as JSON).
HINT_OPTS = "grpo+hint+opts"
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


def _config(
    tmp: str, spec: dict[str, Any], model_dir: str, pairs: str, variant: str, hint_options: dict[str, Any] | None = None
) -> Any:
    from composer_plugins.training.config.train import loads_train_config

    gpu = spec["device"] == "cuda"
    hint = variant in ("grpo+hint", "grpo+hint+replay", HINT_OPTS)
    replay = variant == "grpo+hint+replay"
    hint_spec = json.dumps({"weight": 0.5, "enabled": hint, **(hint_options or {})})  # JSON is YAML
    text = f"""
output_dir: {tmp}/run
model: {{name_or_path: {model_dir}, dtype: float32}}
sft: {{enabled: false}}
losses:
  grpo: {{weight: 1.0}}
  hint_distill: {hint_spec}
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


def child(
    variant: str,
    spec: dict[str, Any],
    model_dir: str,
    pairs: str,
    steps: int,
    hint_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One configuration in this process: ``steps`` timed steps after one warm-up step."""
    import torch

    from benchmarks.bench_training import _tasks, composed_steps, trl_steps
    from composer_plugins.training.step.components import build_env

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(tmp, spec, model_dir, pairs, "grpo" if variant == "trl_grpo" else variant, hint_options)
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
            from composer_plugins.training.lightning.module import ComposerModule

            module = ComposerModule(cfg, env=env)
            composed_steps(module, cfg, batches[:1], 0)
            timed = composed_steps(module, cfg, batches[1:], 1)
            prompt_tokens = max(len(module.tokenizer(t["prompt"])["input_ids"]) for b in batches for t in b)
        secs = sum(x["s"] for x in timed)
        toks = sum(x["tokens"] for x in timed)
        return {
            "step_s": secs / len(timed),
            "tokens_per_s": toks / secs,
            "tokens_per_step": toks / len(timed),
            "max_prompt_tokens": prompt_tokens,
            **_peak(),
        }


def _prepare(tmp: Path, shape: str) -> tuple[str, str, int]:
    """The shaped model (random weights, tiny tokenizer) and a replay pairs file; returns (model, pairs, vocab)."""
    from composer_plugins.core.io import atomic_write_jsonl
    from composer_plugins.models.tiny import MODEL_SHAPES, build_shaped_model
    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.step.components import build_env
    from composer_plugins.training.step.policy import resolve_policy

    cfg, _ = loads_train_config(
        f"cache_dir: {os.environ.get('COMPOSER_CACHE_DIR', '.composer_cache')}\nsft: {{enabled: false}}"
    )
    env = build_env(cfg)
    tok_dir = resolve_policy(cfg, env)
    model = build_shaped_model(tok_dir, tmp / f"model-{shape}", shape)
    pairs = tmp / "pairs.jsonl"
    tasks = env.sample_tasks(16, "train", seed=3)
    wrong = [t["target"].replace(f"#### {t['answer']}", f"#### {int(t['answer']) + 1}") for t in tasks]
    atomic_write_jsonl(
        pairs,
        [{"prompt": t["prompt"], "chosen": t["target"], "rejected": w} for t, w in zip(tasks, wrong, strict=True)],
    )
    return str(model), str(pairs), int(MODEL_SHAPES[shape]["vocab_size"])


def _spawn(
    variant: str,
    spec_name: str,
    model: str,
    pairs: str,
    steps: int,
    timeout: float,
    hint_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "r.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_scale",
            "--child",
            variant,
            "--spec",
            spec_name,
            "--model",
            model,
            "--pairs",
            pairs,
            "--steps",
            str(steps),
            "--json",
            str(out),
            "--hint-options",
            json.dumps(hint_options or {}),
        ]
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


def hint_label(hint_options: dict[str, Any]) -> str:
    """``grpo+hint[topk=100,teacher=ema]``: the result key of the ``--hint-distill`` configuration."""
    return "grpo+hint[" + ",".join(f"{k}={v}" for k, v in hint_options.items()) + "]"


def parse_hint_options(items: list[str]) -> dict[str, Any]:
    """``["topk=100", "teacher=ema"]`` -> ``{"topk": 100, "teacher": "ema"}`` (values parsed as YAML)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--hint-distill {item!r}: expected KEY=VALUE, e.g. --hint-distill topk=100")
        out[key.strip()] = yaml.safe_load(value)
    return out


def run(
    quick: bool = False,
    variants: tuple[str, ...] = VARIANTS,
    hint_options: dict[str, Any] | None = None,
    shapes: tuple[str, ...] | None = None,
    hint_all: bool = False,
    config_timeout: float = 3600,
    partial: Path | None = None,
) -> dict[str, Any]:
    """The ``variants`` (and the ``hint_options`` configuration, CPU only) of every shape this machine has.

    ``shapes``: only these keys of :data:`SHAPES`, each with every listed variant. ``hint_all``: the
    ``hint_options`` go to every hinted variant (no extra configuration). ``config_timeout``: seconds one
    configuration's process may take. ``partial``: the results so far are written there after each
    configuration (so a run stopped from outside keeps what it measured). Returns ``{"name", "results",
    "ratios", "targets"}``.
    """
    import torch

    steps = 1 if quick else 2
    explicit = shapes is not None
    specs = (
        list(shapes)
        if shapes is not None
        else ["cpu"] + (["gpu-0.5b", "gpu-1.5b"] if torch.cuda.is_available() else [])
    )
    everywhere = dict(hint_options or {}) if hint_all else {}
    if hint_all:
        hint_options = None
    results: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as td:
        for name in specs:
            spec = SHAPES[name]
            model, pairs, vocab = _prepare(Path(td), spec["shape"])
            rows = spec["prompts"] * spec["generations"]
            labels = [v for v in VARIANTS if v in variants]
            for variant in labels:
                if name != "cpu" and variant == "grpo+hint" and not explicit:
                    continue  # on GPU: grpo, the full composition and TRL
                opts = everywhere if everywhere and variant in ("grpo+hint", "grpo+hint+replay") else None
                r = _spawn(variant, name, model, pairs, steps, config_timeout, opts)
                if opts:
                    r["hint_options"] = opts
                results[f"{name}/{variant}"] = r
                if partial is not None:
                    partial.write_text(json.dumps({"name": "scale", "partial": True, "results": results}, indent=2))
            if hint_options and name == "cpu":
                labels.append(hint_label(hint_options))
                results[f"{name}/{labels[-1]}"] = _spawn(
                    HINT_OPTS, name, model, pairs, steps, config_timeout, hint_options
                )
            trl = results.get(f"{name}/trl_grpo", {})
            # every composer configuration sees the same prompts: any of them gives the longest prompt
            prompt = max((int(results.get(f"{name}/{v}", {}).get("max_prompt_tokens") or 0) for v in labels), default=0)
            seq = spec["new_tokens"] + prompt
            logits_gib = rows * seq * vocab * 4 / 2**30
            results[f"{name}/fp32_logits_gib"] = logits_gib
            mem = "peak_cuda_gib" if name != "cpu" else "peak_rss_gib"
            for variant in [v for v in labels if v != "trl_grpo"]:
                r = results.get(f"{name}/{variant}", {})
                if mem in r:
                    ratios[f"{name}/{variant}_mem_vs_logits"] = r[mem] / logits_gib
                    if mem in trl:
                        ratios[f"{name}/{variant}_mem_vs_trl"] = r[mem] / trl[mem]
                if "tokens_per_s" in r and "tokens_per_s" in trl:
                    ratios[f"{name}/{variant}_speed_vs_trl"] = r["tokens_per_s"] / trl["tokens_per_s"]
    targets = {"cpu/" + hint_label(hint_options) + "_mem_vs_logits": "<= 0.6 (as grpo+hint)"} if hint_options else {}
    return {
        "name": "scale",
        "results": results,
        "ratios": ratios,
        "targets": {
            **targets,
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
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)"
    )
    p.add_argument(
        "--hint-distill",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more configuration: grpo + hint_distill with losses.hint_distill.KEY=VALUE "
        "(repeatable), e.g. topk=100, teacher=ema",
    )
    p.add_argument(
        "--shapes",
        default=None,
        help=f"comma-separated subset of {', '.join(SHAPES)} (default: cpu, and the GPU shapes "
        "when CUDA is present); every listed variant runs on each",
    )
    p.add_argument(
        "--hint-all",
        action="store_true",
        help="apply the --hint-distill settings to grpo+hint and grpo+hint+replay instead of adding a configuration",
    )
    p.add_argument(
        "--config-timeout", type=float, default=3600, help="seconds one configuration's process may take (default 3600)"
    )
    p.add_argument("--hint-options", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, choices=(*VARIANTS, HINT_OPTS), help=argparse.SUPPRESS)
    p.add_argument("--spec", default="cpu", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pairs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        res = child(a.child, SHAPES[a.spec], a.model, a.pairs, a.steps, json.loads(a.hint_options))
        Path(a.json).write_text(json.dumps(res))
        return 0
    variants = tuple(v.strip() for v in a.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown --variants {unknown}; available: {', '.join(VARIANTS)}")
    shapes = None
    if a.shapes is not None:
        shapes = tuple(x.strip() for x in a.shapes.split(",") if x.strip())
        bad = [x for x in shapes if x not in SHAPES]
        if bad:
            p.error(f"unknown --shapes {bad}; available: {', '.join(SHAPES)}")
    res = run(
        quick=a.quick,
        variants=variants,
        hint_options=parse_hint_options(a.hint_distill),
        shapes=shapes,
        hint_all=a.hint_all,
        config_timeout=a.config_timeout,
        partial=Path(a.json) if a.json else None,
    )
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
