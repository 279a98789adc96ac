"""The gap predictor (composer_plugins.pipeline.gap): each configured teacher's gap to the student, before RL."""

from __future__ import annotations

import math

import pytest
import yaml

from composer_plugins.pipeline import gap


def test_gap_of_a_teacher_identical_to_the_student_is_zero_and_a_hint_gap_is_measured(tiny_yaml, tmp_path):
    from composer_plugins.core.io import atomic_write_jsonl
    from composer_plugins.envs.gsm8k import GSM8KEnv
    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.step.policy import resolve_policy

    train = yaml.safe_load(tiny_yaml)
    cfg, _ = loads_train_config(tiny_yaml, [f"output_dir={tmp_path / 'probe'}"])
    student = resolve_policy(cfg)  # the tiny SFT warm start (a model directory)
    tasks = tmp_path / "train.jsonl"
    atomic_write_jsonl(tasks, GSM8KEnv(difficulty="trivial").sample_tasks(4, "train", seed=5))
    same = {"kind": "causal_lm", "id": "same", "model_path": student, "topk": 8}
    params = {
        "train": train,
        "mlflow": {"enabled": False},
        "study": {
            "variants": {
                "rl_only": {"losses": {"hint_distill": {"weight": 0.0}}},
                "teacher_only": {
                    "losses": {
                        "grpo": {"weight": 0.0},
                        "hint_distill": {"weight": 0.0},
                        "teacher_distill": {"weight": 1.0, "teachers": [same]},
                    }
                },
                "hinted": {"losses": {"grpo": {"weight": 0.0}, "hint_distill": {"weight": 1.0}}},
            }
        },
    }
    res = gap.measure_gap(
        params, ["rl_only", "teacher_only", "hinted"], model=student, tasks_path=str(tasks), num_prompts=4
    )
    assert res["variants"]["rl_only"] == {}  # no teacher, nothing to measure
    t = res["variants"]["teacher_only"]["teacher:same"]
    # the student scoring its own samples: no margin, and it fixes none of its own greedy failures
    assert t["margin"] == pytest.approx(0.0, abs=1e-6) and t["coverage"] == 1.0
    assert t["fix_rate"] == 0.0 or math.isnan(t["fix_rate"])
    assert t["teacher_accuracy"] == pytest.approx(res["student_accuracy"])
    h = res["variants"]["hinted"]["hint"]  # the answer-revealing template: the hinted self-teacher differs
    assert math.isfinite(h["margin"]) and h["margin"] != 0.0 and 0.0 <= h["hinted_rows"] <= 1.0
    assert h["provider"] == {"name": "template", "reveal_answer": True}


def test_gap_correlation_by_hand():
    g = {
        "variants": {
            "a": {"hint": {"margin": -1.0}},
            "b": {"hint": {"margin": -0.5}},
            "c": {"teacher:t": {"margin": 0.0}, "hint": {"margin": -1.0}},
            "d": {},
        }
    }
    out = gap.gap_correlation(g, {"a": 0.01, "b": 0.02, "c": 0.02, "d": 0.5})
    assert [r[0] for r in out["rows"]] == ["a", "b", "c"] and out["rows"][2][1] == -0.5  # c: mean of its two
    assert out["pearson_r"] == pytest.approx(1.0)
