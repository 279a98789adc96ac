"""TRL's backend on CUDA: ``ComposerGRPOTrainer`` (the ``composer-plugins-trl`` distribution) trains a step with
every channel live (policy, hint_distill with the EMA teacher, replay_dpo), bf16, on the GPU.

The CPU side is ``tests/backends/test_backends_trl.py``: the project's composed ``ComposerGRPOTrainer.compute_loss``
against TRL's own ``GRPOTrainer._compute_loss`` called explicitly on the same batch (loss and gradient, six loss
types, a doubled loss detected), and training with every channel live.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

PROMPTS = [{"prompt": f"Q: {a}+{a}=? A:", "answer": str(2 * a)} for a in range(8)]
PAIRS = [{"prompt": f"Q: {a}+{a}=? A:", "chosen": f" {2 * a}", "rejected": f" {2 * a + 1}"} for a in range(6)]
CORPUS = [f"Q: {a}+{b}=? A: {a + b}" for a in range(25) for b in range(25)]


def length_reward(completions, **kwargs):
    return [float(len(c) % 4) / 3 for c in completions]


def answer_hint(feedback, prompt="", completion="", task=None):
    return f"The answer is {task['answer']}."


def test_trl_backend_step_with_every_channel_on_cuda(tmp_path):
    from composer_plugins_trl.backend import ComposerGRPOTrainer
    from datasets import Dataset
    from trl import GRPOConfig

    from composer_plugins.models.tiny import TinyModelConfig, build_tiny_model, load_policy

    cfg = TinyModelConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=128,
    )
    model, tok = load_policy(build_tiny_model(cfg, CORPUS, tmp_path / "tiny"))
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        use_cpu=False,
        bf16=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        learning_rate=1e-3,
        loss_type="dapo",
    )
    channels = [
        "policy",
        {"name": "hint_distill", "weight": 0.5, "teacher": "ema"},
        {"name": "replay_dpo", "weight": 0.2},
    ]
    tr = ComposerGRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_list(PROMPTS),
        processing_class=tok,
        channels=channels,
        hint_provider=answer_hint,
        pairs=PAIRS,
        pairs_per_step=2,
    )
    before = {k: v.detach().float().cpu().clone() for k, v in tr.model.state_dict().items()}
    tr.train()
    assert next(tr.model.parameters()).device.type == "cuda"
    logs = [r for r in tr.state.log_history if "loss" in r]
    assert len(logs) == 2
    for r in logs:
        assert r["composer/policy/skipped"] == 0.0
        assert r["composer/hint_distill/skipped"] == 0.0 and r["composer/hint/rows"] > 0
        assert r["composer/replay_dpo/skipped"] == 0.0 and r["composer/replay_dpo/pairs"] == 2.0
        assert torch.isfinite(torch.tensor(r["loss"]))
    changed = [k for k, v in tr.model.state_dict().items() if not torch.equal(v.detach().float().cpu(), before[k])]
    assert changed, "no weight moved"
