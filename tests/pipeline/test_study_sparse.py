"""The sparse-reward study (issue 16): its generator level and its params file (params.sparse.yaml)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from composer_plugins.envs.arith import generate_problems
from composer_plugins.envs.base import Feedback
from composer_plugins.envs.gsm8k import GSM8KEnv
from composer_plugins.pipeline import stages, study
from composer_plugins.training.train import build_hint_provider, train_config_from_dict

ROOT = Path(__file__).resolve().parents[2]
CALC = re.compile(r"<<([^=<>]+)=([-0-9.]+)>>")


def test_two_step_level_is_multi_step_with_checked_arithmetic() -> None:
    probs = generate_problems(200, "two_step", seed=3, split="train")
    assert len({p.question for p in probs}) == 200
    for p in probs:
        calcs = CALC.findall(p.solution)
        assert len(calcs) >= 2, p.solution  # at least two chained steps
        for expr, val in calcs:
            assert eval(expr, {"__builtins__": {}}) == pytest.approx(float(val)), p.solution
        assert float(calcs[-1][1]) == pytest.approx(float(p.answer))
        assert p.solution.rstrip().endswith(f"#### {p.answer}")
    # harder than the trivial level: more digits and more steps on average
    trivial = generate_problems(200, "trivial", seed=3, split="train")
    assert sum(len(str(p.answer)) for p in probs) > sum(len(str(p.answer)) for p in trivial)
    # same seed -> same problems (the paired design's task order depends on the seed only)
    assert [p.question for p in generate_problems(20, 3, seed=3)] == [p.question for p in probs[:20]]


def test_two_step_reward_is_exact_match_on_the_final_number() -> None:
    env = GSM8KEnv(difficulty="two_step")
    (t,) = env.sample_tasks(1, "test", seed=0)
    assert env.score(" " + t["solution"], t).reward == 1.0
    first_step_only = t["solution"].splitlines()[0]
    fb = env.score(" " + first_step_only, t)
    assert fb.reward == 0.0 and fb.kind == "wrong_answer"


def _sparse_params() -> dict:
    import yaml

    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    over = yaml.safe_load((ROOT / "params.sparse.yaml").read_text())
    return study.merge_params(base, over)


def test_sparse_params_load_with_paired_variants_on_five_seeds(tmp_path: Path) -> None:
    merged = tmp_path / "params.yaml"
    study.write_merged_params(ROOT / "params.yaml", ROOT / "params.sparse.yaml", merged)
    params = study.load_params(merged)
    assert study.seeds(params) == [0, 1, 2, 3, 4]
    assert list(study.variants(params)) == ["rl_only", "hint_answer", "hint_feedback", "replay", "replay_oracle"]
    assert params["train"]["env"]["difficulty"] == "two_step"
    assert set(params["eval"]["envs"]) == {"gsm8k"}  # the SWE evals sit at the floor: dropped here
    flags = {}
    for v in study.variants(params):
        cfg = stages.train_config(params, v, 2)
        assert cfg["seed"] == 2 and cfg["model"]["name_or_path"] == "models/sft/model"
        flags[v] = stages.channels_label(stages.channel_flags(cfg))
    assert flags == {
        "rl_only": "grpo",
        "hint_answer": "grpo+hint_distill",
        "hint_feedback": "grpo+hint_distill",
        "replay": "grpo+replay",
        "replay_oracle": "grpo+replay",
    }
    assert stages.train_config(params, "replay", 0)["replay"]["pairs_path"] == "data/pairs.jsonl"
    assert stages.train_config(params, "replay_oracle", 0)["replay"]["pairs_path"] == "data/pairs_oracle.jsonl"


def test_feedback_variant_hints_without_revealing_the_answer() -> None:
    params = _sparse_params()
    answer = train_config_from_dict(stages.train_config(params, "hint_answer", 0))
    feedback = train_config_from_dict(stages.train_config(params, "hint_feedback", 0))
    fb = Feedback("wrong_answer", "The final answer 12 is wrong.", {"expected": "216", "got": "12"}, 0.0)
    assert build_hint_provider(answer).hint(fb) == "The answer is 216."
    h = build_hint_provider(feedback).hint(fb)
    assert h == "The final answer 12 is wrong." and "216" not in h
