"""The sparse-reward study (issue 16): its generator levels and its pipeline directory (studies/sparse/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from composer_plugins.core.errors import ConfigError
from composer_plugins.envs.arith import generate_problems
from composer_plugins.envs.base import Feedback
from composer_plugins.envs.gsm8k import GSM8KEnv
from composer_plugins.envs.hints import HintRequest
from composer_plugins.pipeline import stages, study
from composer_plugins.training.config.train import train_config_from_dict
from composer_plugins.training.step.components import configured_hint_provider

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


STUDY = ROOT / "studies" / "sparse"


def _sparse_params() -> dict:
    import yaml

    return yaml.safe_load((STUDY / "params.yaml").read_text())


def _studies_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("studies_script", ROOT / "scripts" / "studies.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_study_files_are_derived_from_the_repository_pipeline() -> None:
    """studies/sparse/{dvc.yaml,params.yaml} are current (scripts/studies.py --check) and derived, not forked."""
    import yaml

    mod = _studies_script()
    assert mod.main(["--check"]) == 0, "run `python scripts/studies.py`"
    root_dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    study_dvc = yaml.safe_load((STUDY / "dvc.yaml").read_text())
    assert study_dvc.keys() == root_dvc.keys() and study_dvc["plots"] == root_dvc["plots"]
    for name, stage in root_dvc["stages"].items():
        mine = study_dvc["stages"][name]
        assert {k: v for k, v in mine.items() if k != "deps"} == {k: v for k, v in stage.items() if k != "deps"}
        # only the package's own paths move; every one of them still exists from the study directory
        rebased = [d.replace("../../composer_plugins", "composer_plugins") for d in mine.get("deps", [])]
        assert rebased == stage.get("deps", [])
        for d in mine.get("deps", []):
            if d.startswith("../../"):
                assert (STUDY / d).exists(), d
    merged = study.merge_params(
        yaml.safe_load((ROOT / "params.yaml").read_text()), yaml.safe_load((STUDY / "overrides.yaml").read_text())
    )
    assert _sparse_params() == merged
    # a stale file is reported, not silently accepted
    text = (STUDY / "params.yaml").read_text()
    try:
        (STUDY / "params.yaml").write_text(text.replace("difficulty: medium", "difficulty: trivial"))
        assert mod.main(["--check"]) == 1
    finally:
        (STUDY / "params.yaml").write_text(text)


def test_a_base_chain_that_loops_or_names_no_study_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/studies.py: ``_base`` stacks a study's overrides on another's; a loop or an unknown name is an error
    naming the file, the loop and the studies there are (not a RecursionError or a silent fork)."""
    mod = _studies_script()
    for name, body in {"a": "_base: b\nx: 1\n", "b": "_base: c\ny: 2\n", "c": "z: 3\n", "d": "_base: d\n"}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "overrides.yaml").write_text(body)
    monkeypatch.setattr(mod, "STUDIES", tmp_path)
    over, files = mod.study_overrides(tmp_path / "a")
    assert over == {"z": 3, "y": 2, "x": 1} and files == [f"studies/{n}/overrides.yaml" for n in "cba"]
    with pytest.raises(SystemExit, match=r"studies/d/overrides.yaml: _base 'd' makes a cycle \(d -> d\)"):
        mod.study_overrides(tmp_path / "d")
    (tmp_path / "c" / "overrides.yaml").write_text("_base: a\n")
    with pytest.raises(SystemExit, match=r"_base 'a' makes a cycle \(a -> b -> c -> a\)"):
        mod.study_overrides(tmp_path / "a")
    (tmp_path / "c" / "overrides.yaml").write_text("_base: nope\n")
    with pytest.raises(SystemExit, match=r"_base 'nope' is not a study under studies/ \(studies: a, b, c, d\)"):
        mod.study_overrides(tmp_path / "a")


def test_sparse_params_load_with_paired_variants_on_five_seeds() -> None:
    params = study.load_params(STUDY / "params.yaml")
    assert study.seeds(params) == [0, 1, 2, 3, 4]
    assert list(study.variants(params)) == ["rl_only", "hint_answer", "hint_feedback", "replay"]
    assert study.baseline(params) == "rl_only"
    assert params["train"]["env"]["difficulty"] == "medium"
    assert set(params["eval"]["envs"]) == {"gsm8k"} and params["eval"]["envs"]["gsm8k"]["num_problems"] == 400
    flags = {}
    for v in study.variants(params):
        cfg = stages.train_config(params, v, 2)
        assert cfg["seed"] == 2 and cfg["model"]["name_or_path"] == "models/sft/model"
        assert cfg["env"]["difficulty"] == "medium" and cfg["trainer"]["max_steps"] == 40
        flags[v] = stages.channels_label(stages.channel_flags(cfg))
    assert flags == {
        "rl_only": "grpo",
        "hint_answer": "grpo+hint_distill",
        "hint_feedback": "grpo+hint_distill",
        "replay": "grpo+replay",
    }
    # replay's chosen side: the oracle teacher's answer alone (k=1), see overrides.yaml
    assert [t["name"] for t in params["replay"]["teachers"]] == ["oracle"] and params["pairs"]["k"] == 1


def test_medium_level_is_one_checked_step_over_four_operations() -> None:
    """The study's level: one calculation, +, -, x or exact division, arithmetic right, answer = result."""
    probs = generate_problems(300, "medium", seed=0, split="train")
    ops = set()
    for p in probs:
        (calc,) = CALC.findall(p.solution)  # exactly one step
        expr, val = calc
        assert eval(expr, {"__builtins__": {}}) == pytest.approx(float(val)), p.solution
        assert float(val) == float(p.answer) == int(p.answer)  # exact division: an integer answer
        ops |= {op for op in "+-*/" if op in expr}
    assert ops == {"+", "-", "*", "/"}
    assert len({p.answer for p in probs}) > 50  # not a handful of answers a policy could guess


def test_baseline_must_name_a_variant() -> None:
    params = _sparse_params()
    params["study"]["baseline"] = "rl_onyl"
    with pytest.raises(ConfigError) as e:
        study.baseline(params)
    msg = str(e.value)
    assert "study.baseline" in msg and "rl_only" in msg


def test_feedback_variant_hints_without_revealing_the_answer() -> None:
    params = _sparse_params()
    answer = train_config_from_dict(stages.train_config(params, "hint_answer", 0))
    feedback = train_config_from_dict(stages.train_config(params, "hint_feedback", 0))
    fb = Feedback("wrong_answer", "The final answer 12 is wrong.", {"expected": "216", "got": "12"}, 0.0)
    assert configured_hint_provider(answer).hint(HintRequest(feedback=fb)) == "The answer is 216."
    h = configured_hint_provider(feedback).hint(HintRequest(feedback=fb))
    assert h == "The final answer 12 is wrong." and "216" not in h
