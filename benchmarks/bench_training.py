"""Throughput of one RL training step: ``ComposerModule`` under Lightning vs a raw PyTorch loop vs TRL.

All three run the same policy (the SFT-warm-started embedded tiny model), the same prompts, the
same group size, sampling settings and completion budget. Per step they generate ``G`` completions
per prompt (HF ``generate``, KV cache), score them with the env, compute group advantages, run the
policy forward/backward on the loss and take an optimizer step.

* ``composed``: :class:`~composer_plugins.training.lightning.module.ComposerModule` driven by the project's
  Lightning ``Trainer`` (:func:`~composer_plugins.training.lightning.trainer.build_trainer`: checkpoints off,
  progress bar off, grad clipping on); the step time is measured between consecutive batch starts,
  so Lightning's loop overhead (logging, hooks) is included.
* ``raw``: the same computation written as a plain loop over the primitives (generate, reward,
  ``group_advantages``, hidden-state forward with chunked log-probs, the channel's loss, ``backward``,
  ``clip_grad_norm_``, ``step``).
* ``trl``: TRL's ``GRPOTrainer`` (``loss_type="grpo"``, ``beta=0``) on the same model and batch.

Tokens/s counts generated completion tokens per second of step wall time. Sampling is seeded
identically in ``composed`` and ``raw`` so both process exactly the same tokens. Timings are the
median over steps after a warm-up step; the machine may be shared, so the two are interleaved
in rounds and each ratio is the median of per-round ratios.

Run: ``python -m benchmarks.bench_training [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cfg(tmp: str, quick: bool, hint: bool) -> Any:
    from composer_plugins.training.config.train import loads_train_config

    losses = "grpo: {weight: 1.0}\n  hint_distill: {weight: 0.5, enabled: %s}" % ("true" if hint else "false")
    text = f"""
output_dir: {tmp}/run
cache_dir: {os.environ.get("COMPOSER_CACHE_DIR", ".composer_cache")}
losses:
  {losses}
rollout: {{prompts_per_step: {4 if quick else 8}, num_generations: 8, max_new_tokens: 48}}
trainer: {{max_steps: 1000, checkpoint_every_n_steps: 0, enable_progress_bar: false, num_threads: 1}}
eval: {{at_start: false, at_end: false}}
sft: {{progress: false}}
"""
    cfg, _ = loads_train_config(text)
    return cfg


def _tasks(env: Any, cfg: Any, steps: int) -> list[list[dict[str, Any]]]:
    from composer_plugins.training.rollout.rewards import derive_seed, task_drawer

    draw = task_drawer(env, cfg, "train")
    return [draw(cfg.rollout.prompts_per_step, derive_seed(cfg.seed, 0, i)) for i in range(steps)]


class _Stream:
    def __init__(self, batches: list[list[dict[str, Any]]], offset: int) -> None:
        self.batches, self.offset = batches, offset

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for i, b in enumerate(self.batches):
            yield {"index": self.offset + i, "tasks": b}


def composed_steps(
    module: Any, cfg: Any, batches: list[list[dict[str, Any]]], offset: int, callbacks: list[Any] | None = None
) -> list[dict[str, float]]:
    """Run ``batches`` through ``ComposerModule`` + the project's Trainer (one ``fit``, ``callbacks`` added);
    per-step seconds and tokens."""
    from lightning.pytorch.callbacks import Callback

    from composer_plugins.training.lightning.trainer import build_trainer

    marks: list[float] = []
    tokens: list[float] = []

    class Timer(Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            marks.append(time.perf_counter())

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *a: Any) -> None:
            tokens.append(pl_module.last_step_stats["completion_tokens"])

        def on_train_end(self, *a: Any) -> None:
            marks.append(time.perf_counter())

    import dataclasses

    c = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=len(batches)))
    module.cfg = c
    trainer = build_trainer(c, extra_callbacks=[Timer(), *(callbacks or [])], logger=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=_Stream(batches, offset))
    module.cfg = cfg
    return [{"s": marks[i + 1] - marks[i], "tokens": tokens[i]} for i in range(len(batches))]


def raw_steps(
    policy: Any,
    tok: Any,
    env: Any,
    channels: list[Any],
    cfg: Any,
    batches: list[list[dict[str, Any]]],
    offset: int,
    opt: Any,
    hint_provider: Any = None,
) -> list[dict[str, float]]:
    """The same step as a plain PyTorch loop over the primitives."""
    import torch

    from composer_plugins.losses import functional as F
    from composer_plugins.models.generation import generate_completions, tokenize_prompts
    from composer_plugins.models.logprobs import completion_hidden, completion_logprobs, lm_head_weight
    from composer_plugins.training.rollout.rewards import derive_seed, env_rewards, task_prompt, teacher_contexts

    r = cfg.rollout
    out = []
    params = [p for p in policy.parameters() if p.requires_grad]
    for i, tasks in enumerate(batches):
        t0 = time.perf_counter()
        seed = derive_seed(cfg.seed, 1, offset + i)
        prompts = [task_prompt(t) for t in tasks]
        ro = generate_completions(
            policy,
            tok,
            prompts,
            r.num_generations,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=seed,
            max_prompt_length=r.max_prompt_length,
        )
        rewards = env_rewards(env, tasks, ro.completions, r.num_generations)
        rewards = torch.tensor(rewards, device=ro.completion_ids.device)
        adv = F.group_advantages(rewards, r.num_generations)
        want_hidden = hint_provider is not None
        args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        logps, hidden = completion_logprobs(policy, *args, temperature=r.temperature, return_hidden=True)
        mo: dict[str, Any] = {"logprobs": logps}
        b: dict[str, Any] = {
            "advantages": adv,
            "completion_mask": ro.completion_mask.float(),
            "old_logprobs": logps.detach(),
        }
        if want_hidden:
            failed = (rewards < r.success_threshold).nonzero().flatten().tolist()
            ctxs = teacher_contexts(
                env, hint_provider, [tasks[j // r.num_generations] for j in failed], [ro.completions[j] for j in failed]
            )
            rows = [j for j, c in zip(failed, ctxs, strict=True) if c is not None]
            hp = [c for c in ctxs if c is not None]
            if rows:
                idx = torch.tensor(rows)
                h_ids, h_mask = tokenize_prompts(tok, hp, cfg.hints.max_context_length, ro.completion_ids.device)
                with torch.no_grad():
                    teacher = completion_hidden(policy, h_ids, h_mask, ro.completion_ids[idx], ro.completion_mask[idx])
                mo["student_hidden"] = hidden[idx]  # the channel divides the logits by its temperature
                mo["teacher_hidden"] = teacher
                b["sampling_temperature"] = r.temperature
                mo["lm_head_weight"] = lm_head_weight(policy)
                b["hint_mask"] = ro.completion_mask[idx].float()
        loss = None
        for ch in channels:
            if ch.missing_inputs({**b, **mo}):
                continue
            li, _ = ch({**b, **mo})
            loss = ch.weight * li if loss is None else loss + ch.weight * li
        assert loss is not None
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.trainer.gradient_clip_val)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append({"s": time.perf_counter() - t0, "tokens": float(ro.num_completion_tokens)})
    return out


def trl_steps(
    path: str,
    env: Any,
    cfg: Any,
    batches: list[list[dict[str, Any]]],
    device: str = "cpu",
    args: dict[str, Any] | None = None,
    setup: Any = None,
) -> list[dict[str, float]] | str:
    """TRL ``GRPOTrainer`` on the same model and batch; per-step seconds and completion tokens.

    ``device="cuda"`` trains on the GPU in bf16 mixed precision; otherwise on the CPU in fp32. ``args``: more
    ``GRPOConfig`` settings; ``setup(trainer)``: called once the trainer is built (callbacks, wrappers).
    """
    try:
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:  # pragma: no cover - trl is a dev dependency
        return f"unavailable: {e}"
    r = cfg.rollout
    rows = [dict(t) for b in batches for t in b]
    ds = Dataset.from_list(
        [{k: (v if isinstance(v, str | int | float) else json.dumps(v)) for k, v in t.items()} for t in rows]
    )
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    steps: list[dict[str, float]] = []
    marks: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append({"s": time.perf_counter() - marks[-1]})

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=r.prompts_per_step * r.num_generations,
            num_generations=r.num_generations,
            max_completion_length=r.max_new_tokens,
            max_steps=len(batches),
            learning_rate=cfg.optim.lr,
            logging_steps=1,
            report_to=[],
            use_cpu=device == "cpu",
            bf16=device == "cuda",
            save_strategy="no",
            temperature=r.temperature,
            top_k=r.top_k or 0,
            top_p=r.top_p,
            beta=0.0,
            loss_type="grpo",
            disable_tqdm=True,
            dataloader_num_workers=0,
            max_grad_norm=cfg.trainer.gradient_clip_val,
            shuffle_dataset=False,
            seed=cfg.seed,
            **(args or {}),
        )
        trainer = GRPOTrainer(
            model=path,
            reward_funcs=env.reward_fn() if hasattr(env, "reward_fn") else env.reward,
            args=args,
            train_dataset=ds,
            processing_class=tok,
            callbacks=[Timer()],
        )
        if setup is not None:
            setup(trainer)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    n = r.prompts_per_step * r.num_generations
    for s, h in zip(steps, logs, strict=False):
        s["tokens"] = float(h["completions/mean_length"]) * n
    return steps


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns ``{"name", "results", "ratios", "targets"}``."""
    import lightning as L
    import torch

    from composer_plugins.models.tiny import load_policy
    from composer_plugins.training.lightning.module import ComposerModule
    from composer_plugins.training.step.components import build_channels, build_env, configured_hint_provider
    from composer_plugins.training.step.policy import resolve_policy

    torch.set_num_threads(1)
    rounds = 2 if quick else 3
    per_round = 2 if quick else 3
    results: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for hint in (False, True):
            tag = "grpo+hint" if hint else "grpo"
            cfg = _cfg(tmp, quick, hint)
            env = build_env(cfg)
            path = resolve_policy(cfg, env)
            batches = _tasks(env, cfg, rounds * per_round + 1)
            L.seed_everything(0, verbose=False)
            p1, t1 = load_policy(path)
            module = ComposerModule(cfg, policy=p1, tokenizer=t1, env=env)
            p2, t2 = load_policy(path)
            chans = build_channels(cfg)
            hp = configured_hint_provider(cfg) if hint else None
            opt = torch.optim.AdamW(p2.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas))
            # warm-up (not timed)
            composed_steps(module, cfg, batches[:1], 0)
            raw_steps(p2, t2, env, chans, cfg, batches[:1], 0, opt, hp)
            comp: list[dict[str, float]] = []
            raw: list[dict[str, float]] = []
            round_ratios = []
            for k in range(rounds):
                chunk = batches[1 + k * per_round : 1 + (k + 1) * per_round]
                off = 1 + k * per_round
                c = composed_steps(module, cfg, chunk, off)
                rr = raw_steps(p2, t2, env, chans, cfg, chunk, off, opt, hp)
                comp += c
                raw += rr
                tc = sum(x["tokens"] for x in c) / sum(x["s"] for x in c)
                tr = sum(x["tokens"] for x in rr) / sum(x["s"] for x in rr)
                round_ratios.append(tr / tc)
            tps_c = sum(x["tokens"] for x in comp) / sum(x["s"] for x in comp)
            tps_r = sum(x["tokens"] for x in raw) / sum(x["s"] for x in raw)
            results[tag] = {
                "composed_step_s_median": _med([x["s"] for x in comp]),
                "raw_step_s_median": _med([x["s"] for x in raw]),
                "composed_tokens_per_s": tps_c,
                "raw_tokens_per_s": tps_r,
                "tokens_per_step": _med([x["tokens"] for x in comp]),
                "batch": f"{cfg.rollout.prompts_per_step} prompts x G={cfg.rollout.num_generations}",
            }
            ratios[f"{tag}_overhead_vs_raw"] = _med(round_ratios) - 1.0
            if not hint:
                trl = trl_steps(path, env, cfg, batches[: 1 + rounds * per_round])
                if isinstance(trl, str):
                    results["trl"] = trl
                else:
                    trl = trl[1:]  # drop warm-up
                    tps_t = sum(x["tokens"] for x in trl) / sum(x["s"] for x in trl)
                    results["trl_grpo"] = {"step_s_median": _med([x["s"] for x in trl]), "tokens_per_s": tps_t}
                    ratios["grpo_speed_vs_trl"] = tps_c / tps_t
    return {
        "name": "training",
        "results": results,
        "ratios": ratios,
        "targets": {
            "grpo_overhead_vs_raw": "<= 0.05 (composed Lightning step vs raw PyTorch loop, same loss and tokens)",
            "grpo+hint_overhead_vs_raw": "<= 0.05",
            "grpo_speed_vs_trl": ">= 1.0 (tokens/s relative to TRL GRPOTrainer, same model and batch)",
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None, help="also write the result dict here")
    a = p.parse_args(argv)
    res = run(quick=a.quick)
    print(f"{'config':<12} {'impl':<10} {'step s (median)':>16} {'tokens/s':>10}")
    for tag in ("grpo", "grpo+hint"):
        r = res["results"].get(tag)
        if r:
            print(
                f"{tag:<12} {'composed':<10} {r['composed_step_s_median']:>16.3f} {r['composed_tokens_per_s']:>10.1f}"
            )
            print(f"{tag:<12} {'raw':<10} {r['raw_step_s_median']:>16.3f} {r['raw_tokens_per_s']:>10.1f}")
    t = res["results"].get("trl_grpo")
    if t:
        print(f"{'grpo':<12} {'trl':<10} {t['step_s_median']:>16.3f} {t['tokens_per_s']:>10.1f}")
    for k, v in res["ratios"].items():
        print(f"{k}: {v:+.3f}  (target {res['targets'].get(k, '')})")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
