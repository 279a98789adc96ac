"""The composed RL step at a real vocabulary: grpo + hint_distill (EMA teacher, top-100) + replay.

On CUDA at the Qwen2.5-0.5B shape (random init, the real 151,936-token vocabulary), bf16 mixed precision; on
the CPU at ``bench_scale``'s CPU proxy (the same vocabulary, a 2-layer body), fp32. Generation, the env's
(random) reward, the hinted teacher forward through the EMA copy, the replay pairs, forward/backward with
gradient checkpointing on, the optimizer step and the EMA update, through the project's Lightning
``Trainer`` — what ``benchmarks/bench_scale.py`` measures, built with its own helpers.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from gpu_support import DEVICES, QWEN_VOCAB

pytestmark = pytest.mark.timeout(600)

SPECS = {
    "cuda": {"shape": "qwen2.5-0.5b", "prompts": 2, "generations": 4, "new_tokens": 32, "device": "cuda"},
    "cpu": {"shape": "cpu-proxy", "prompts": 2, "generations": 2, "new_tokens": 8, "device": "cpu"},
}
HINT = {"teacher": "ema", "topk": 100, "ema_rate": 0.5}


def _fingerprints(module: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """(sum, norm) of every parameter in float64: changes when any element does (no host copy of 0.5B weights)."""
    with torch.no_grad():
        return {n: (p.double().sum().item(), p.double().norm().item()) for n, p in module.named_parameters()}


@pytest.mark.parametrize("device", DEVICES)
def test_grpo_hint_ema_top100_replay_step_at_the_real_vocabulary(device, tmp_path, monkeypatch):
    from benchmarks.bench_scale import RandomRewardEnv, _config, _prepare
    from benchmarks.bench_training import _tasks, composed_steps
    from composer_plugins.models.tiny import MODEL_SHAPES
    from composer_plugins.training.lightning.module import ComposerModule
    from composer_plugins.training.step.components import build_env

    monkeypatch.setenv("COMPOSER_CACHE_DIR", str(tmp_path / "cache"))
    spec = SPECS[device]
    assert MODEL_SHAPES[spec["shape"]]["vocab_size"] == QWEN_VOCAB
    model, pairs, vocab = _prepare(tmp_path, spec["shape"])
    assert vocab == QWEN_VOCAB
    cfg = _config(str(tmp_path), spec, model, pairs, "grpo+hint+replay", HINT)
    cfg = dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, gradient_checkpointing="layer"))
    assert cfg.trainer.accelerator == ("gpu" if device == "cuda" else "cpu")
    torch.manual_seed(0)
    env = RandomRewardEnv(build_env(cfg), seed=0)
    module = ComposerModule(cfg, env=env)
    assert module.policy.is_gradient_checkpointing
    assert module.ema_teacher is not None
    assert module.policy.get_output_embeddings().weight.shape[0] == QWEN_VOCAB
    before = _fingerprints(module.policy)
    ema_before = _fingerprints(module.ema_teacher)
    # where the policy ran: Lightning's teardown moves the module back to the CPU once fit ends, so the parameters'
    # device afterwards says nothing
    ran_on: set[str] = set()
    hook = module.policy.register_forward_pre_hook(lambda m, args: ran_on.add(next(m.parameters()).device.type))

    timed = composed_steps(module, cfg, _tasks(env.base, cfg, 1), 0)
    hook.remove()

    stats = module.last_step_stats
    assert len(timed) == 1 and timed[0]["tokens"] > 0
    assert all(math.isfinite(float(v)) for v in stats.values() if isinstance(v, int | float)), stats
    hinted = {k: v for k, v in stats.items() if k.startswith("hint_distill/")}
    assert hinted and float(stats.get("hint_distill/empty", 0.0)) == 0.0, stats  # every row was hinted
    assert any(k.startswith("replay") for k in stats), stats
    assert ran_on == {device}, ran_on
    after = _fingerprints(module.policy)
    assert sum(after[n] != before[n] for n in before) > len(before) // 2, "the optimizer step moved few weights"
    ema_after = _fingerprints(module.ema_teacher)
    assert any(ema_after[n] != ema_before[n] for n in ema_before), "the EMA teacher never moved"
    if device == "cuda":
        assert torch.cuda.max_memory_allocated() > 0
    Path(tmp_path / "stats.txt").write_text(repr(stats))
