"""The ``teacher_distill`` channel in the Lightning module: scored by external teachers through the step record.

* a run composing grpo + hint_distill + replay_dpo + teacher_distill (the tiny base model as the
  teacher, a ``causal_lm`` scorer) trains with every channel live;
* a teacher whose tokenizer differs from the student's (cross-tokenizer alignment) is scored too;
* a teacher past ``deadline_s`` is skipped for the step (reported), and the step does not wait for it.
"""

from __future__ import annotations

import math
import time

import torch

from composer_plugins.losses.policy import PolicyLossChannel
from composer_plugins.losses.teacher_distill import TeacherDistillChannel
from composer_plugins.teachers.scoring import TeacherScorer
from composer_plugins.training.lightning.module import ComposerModule
from composer_plugins.training.runs.run import run_train
from composer_plugins.training.step.components import build_env
from composer_plugins.training.step.policy import base_policy_path, load_policy_for

FOUR = """
losses:
  grpo: {{weight: 1.0}}
  hint_distill: {{weight: 0.5}}
  replay_dpo: {{weight: 0.1}}
  teacher_distill:
    weight: 0.5
    weights: {{base: 1.0, other: 0.5}}
    teachers:
      - {{kind: causal_lm, id: base, model_path: {base}, topk: 8}}
      - {{kind: causal_lm, id: other, model_path: {other}, topk: 8}}
replay: {{pairs_path: {pairs}, pairs_per_step: 2}}
"""


def test_four_channels_compose_in_one_step(make_cfg, pairs_file, tmp_path):
    from composer_plugins.testing.teacher_data import build_tiny_chat_model

    cfg0, _ = make_cfg("")
    base = base_policy_path(cfg0, build_env(cfg0))  # the tiny model before its SFT warm start
    other = build_tiny_chat_model(tmp_path / "other", vocab_size=260, seed=3)  # another tokenizer
    cfg, src = make_cfg(FOUR.format(base=base, other=other, pairs=pairs_file))
    res = run_train(cfg, src)
    assert [r["step"] for r in res.history] == [1, 2]
    for row in res.history:
        for ch in ("grpo", "hint_distill", "replay_dpo", "teacher_distill"):
            assert row[f"train/{ch}/skipped"] == 0.0, (ch, row)
            assert math.isfinite(row[f"train/{ch}/loss"]), (ch, row)
        assert row["train/teacher_distill/loss"] > 0
        assert row["train/teacher_distill/teachers"] == 2.0
        assert row["train/teacher_distill/scored/base"] > 0.9  # same tokenizer: every token
        assert 0.0 < row["train/teacher_distill/scored/other"] < 1.0  # cross-tokenizer: the aligned blocks
        assert row["train/teacher/base/skipped"] == 0.0 and row["train/teacher/other/skipped"] == 0.0
    assert res.history[-1]["train/teacher/base/rows"] == 2 * 8  # two steps of 8 rows, each scored once


class _Late(TeacherScorer):
    kind = "late"

    def __init__(self, delay: float) -> None:
        super().__init__(id="late", topk=2)
        self.delay = delay

    def score(self, requests):
        time.sleep(self.delay)
        return [None for _ in requests]


def test_a_teacher_past_the_deadline_is_skipped_not_waited_for(make_cfg):
    cfg, src = make_cfg("")
    env = build_env(cfg)
    policy, tok = load_policy_for(cfg, env)
    channels = [
        PolicyLossChannel(loss_type="grpo", name="grpo"),
        TeacherDistillChannel(weight=0.5, teachers=[_Late(3.0)], deadline_s=0.2),
    ]
    mod = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, channels=channels, src=src)
    tasks = env.sample_tasks(2, "train", seed=1)
    t0 = time.monotonic()
    loss, stats = mod.compute_step(tasks, 3)
    took = time.monotonic() - t0
    mod.teardown("fit")
    assert torch.isfinite(loss)
    assert stats["teacher/late/skipped"] == 1.0
    assert stats["teacher_distill/skipped"] == 1.0 and stats["grpo/skipped"] == 0.0
    assert took < 2.9  # the step went on at the deadline
