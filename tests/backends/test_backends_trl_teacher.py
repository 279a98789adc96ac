"""TRL backend: the ``teacher_distill`` channel's inputs come from the step assembler inside the project's
``ComposerGRPOTrainer.compute_loss`` (the public ``Trainer`` hook it overrides; TRL's ``_compute_loss`` is not used)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from composer_plugins_trl.backend import ComposerGRPOTrainer
from datasets import Dataset
from trl import GRPOConfig

from composer_plugins.models.tiny import load_policy

PROMPTS = [{"prompt": f"Q: {a}+{a}=? A:", "answer": str(2 * a)} for a in range(8)]


def length_reward(completions, **kwargs):
    return [float(len(c) % 4) / 3 for c in completions]


def test_teacher_distill_trains_inside_trl(tiny_model_dir, tmp_path):
    from composer_plugins.testing.teacher_data import build_tiny_chat_model

    teacher = build_tiny_chat_model(tmp_path / "teacher", vocab_size=260, seed=5)  # its own tokenizer
    model, tok = load_policy(tiny_model_dir)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        learning_rate=1e-3,
        loss_type="dapo",
    )
    channels = [
        "policy",
        {
            "name": "teacher_distill",
            "weight": 0.5,
            "teachers": [{"kind": "causal_lm", "id": "t", "model_path": str(teacher), "topk": 4}],
        },
    ]
    tr = ComposerGRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_list(PROMPTS),
        processing_class=tok,
        channels=channels,
    )
    before = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    tr.train()
    logs = [r for r in tr.state.log_history if "loss" in r]
    assert len(logs) == 2
    for r in logs:
        assert r["composer/teacher_distill/skipped"] == 0.0
        assert r["composer/teacher_distill/loss"] > 0 and r["composer/teacher/t/skipped"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in tr.model.state_dict().items())
