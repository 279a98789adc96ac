"""A scorer that returns fewer rows than it was asked for (issue 51): that teacher is absent for the batch's rows
(``teacher_distill/absent/<name>``, one warning naming it and the counts), the other teacher is distilled and the
step goes on (it crashed with a tensor-size mismatch naming no teacher)."""

from __future__ import annotations

import logging

import torch

from composer_plugins.losses.policy import PolicyLossChannel
from composer_plugins.losses.teacher_distill import TeacherDistillChannel
from composer_plugins.teachers.scoring import TeacherScorer, TeacherScores
from composer_plugins.training.lightning.module import ComposerModule
from composer_plugins.training.step.components import build_env
from composer_plugins.training.step.policy import load_policy_for


class _Rows(TeacherScorer):
    """Scores each token with its own id at log-prob 0 (``good``), or returns ``[]`` (``short``)."""

    kind = "rows"

    def __init__(self, id: str, short: bool) -> None:
        super().__init__(id=id, topk=1)
        self.short = short

    def score(self, requests):
        if self.short:
            return []
        return [
            TeacherScores.from_lists(
                [[t] for t in r.completion_ids], [[0.0]] * len(r.completion_ids), [True] * len(r.completion_ids), 1
            )
            for r in requests
        ]


def test_a_scorer_returning_fewer_rows_is_absent_for_them_and_the_step_goes_on(make_cfg, caplog):
    cfg, src = make_cfg("")
    env = build_env(cfg)
    policy, tok = load_policy_for(cfg, env)
    teacher = TeacherDistillChannel(weight=0.5, teachers=[_Rows("good", False), _Rows("short", True)])
    channels = [PolicyLossChannel(loss_type="grpo", name="grpo"), teacher]
    mod = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, channels=channels, src=src)
    tasks = env.sample_tasks(2, "train", seed=1)
    with caplog.at_level(logging.WARNING):
        for step in (3, 4):
            loss, stats = mod.compute_step(tasks, step)
            assert torch.isfinite(loss)
            assert stats["teacher_distill/skipped"] == 0.0 and stats["teacher_distill/tokens"] > 0
            assert stats["teacher_distill/absent/short"] == 1.0 and "teacher_distill/absent/good" not in stats
    mod.teardown("fit")
    warned = [r.getMessage() for r in caplog.records if "'short' returned 0 score rows" in r.getMessage()]
    assert len(warned) == 1, warned  # once, with the counts
    assert "for the 8 asked" in warned[0] and "absent/short" in warned[0]
