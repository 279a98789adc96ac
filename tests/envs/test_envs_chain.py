"""The ``chain`` generator level (worked steps, split by computation), the equation parser and ``step_check``."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from composer_plugins import build
from composer_plugins.envs.arith import generate_problems, split_of
from composer_plugins.envs.base import Feedback
from composer_plugins.envs.gsm8k import GSM8KEnv
from composer_plugins.envs.hints import HintRequest, build_hint_provider
from composer_plugins.envs.step_check import StepCheckHintProvider, locate_mistake
from composer_plugins.envs.steps import computation_key, first_false_step, parse_steps

TASK = {
    "prompt": "Question: Tom has 7 apples. Then he doubles them. He buys 5 more. How many apples does Tom have now?\n"
    "Answer:",
    "answer": "19",
    "solution": "7 * 2 = 14\n14 + 5 = 19\n#### 19",
}


def wrong(got: str) -> Feedback:
    return Feedback("wrong_answer", f"The final answer {got} is wrong.", {"expected": "19", "got": got}, 0.0)


def test_chain_level_is_two_worked_steps_on_one_digit_operands():
    probs = generate_problems(300, "chain", seed=0)
    assert probs == generate_problems(300, 6, seed=0)
    for p in probs:
        steps = parse_steps(p.solution)
        assert len(steps) == 2 and all(s.holds for s in steps)
        assert steps[1].a == steps[0].stated  # chained: the second step works on the first's result
        assert all(1 <= s.b <= 9 for s in steps) and 1 <= steps[0].a <= 9
        assert p.solution.rstrip().endswith(f"#### {p.answer}") and "<<" not in p.solution
        assert p.solution.count("\n") == 2  # one equation per line, then "#### n"
    assert {s.op for p in probs for s in parse_steps(p.solution)} == {"+", "-", "*"}


def test_chain_split_is_by_computation_with_distinct_test_problems():
    train = generate_problems(3000, "chain", seed=0)
    test = generate_problems(400, "chain", seed=0, split="test")
    train_keys = {computation_key(p.solution) for p in train}
    test_keys = [computation_key(p.solution) for p in test]
    assert len(set(test_keys)) == 400  # every test row computes something different
    assert not train_keys & set(test_keys)  # and nothing a train row computes
    assert all(split_of(k, 0.2) == "test" for k in test_keys)
    assert not {p.question for p in train} & {p.question for p in test}


def test_prepare_reports_zero_computation_overlap_at_the_chain_level(tmp_path):
    from composer_plugins.pipeline.stages import prepare

    params = {
        "data": {"seed": 0, "gsm8k": {"train": 1500, "test": 400}},
        "train": {"env": {"name": "gsm8k", "difficulty": "chain"}},
    }
    entry = prepare(params, tmp_path)["envs"]["gsm8k"]
    assert entry["overlap"] == 0 and entry["computation_overlap"] == 0
    assert entry["test_distinct"] == 400 and entry["test_distinct_computations"] == 400
    assert json.loads((tmp_path / "manifest.json").read_text())["envs"]["gsm8k"]["computation_overlap"] == 0
    # the question-text split of `trivial` shares every sum with train: the report says so
    params["train"]["env"]["difficulty"] = "trivial"
    params["data"]["gsm8k"] = {"train": 1500, "test": 200}
    entry = prepare(params, tmp_path / "trivial")["envs"]["gsm8k"]
    assert entry["overlap"] == 0 and entry["computation_overlap"] == 200
    assert entry["test_distinct_computations"] <= 81


def test_parse_steps_reads_plain_and_annotated_equations():
    text = "Ann has 3 * 4 = <<3*4=12>>12 pens. Then 12 + 5 = 17.\n<<17-2=15>>\n#### 15"
    steps = parse_steps(text)
    assert [(s.key, s.stated, s.holds) for s in steps] == [("3*4", 12, True), ("12+5", 17, True), ("17-2", 15, True)]
    assert computation_key(text) == "3*4;12+5;17-2"
    assert parse_steps("7 × 2 = 15 and 1,200 / 4 = 300 and 9 x 3 = 27")[0].shown() == "7 × 2 = 14"
    assert [s.holds for s in parse_steps("1,200 / 4 = 300, 9 x 3 = 27, 2.5 * 2 = 5")] == [True, True, True]
    i, step = first_false_step("2 + 2 = 4\n4 * 3 = 13")
    assert (i, step.text, step.value, step.start) == (2, "4 * 3 = 13", 12, 10)
    assert first_false_step("2 + 2 = 4") is None
    assert parse_steps("5 / 0 = 1")[0].value is None and not parse_steps("5 / 0 = 1")[0].holds
    assert parse_steps("Question: 3 apples, then 4 more.\n#### 7") == []
    assert parse_steps("8 / 3 = 2.5")[0].value == Fraction(8, 3)


def test_step_check_names_the_first_false_step_with_its_true_value():
    sc = build("hints", "step_check")
    assert isinstance(sc, StepCheckHintProvider)
    assert (
        sc.hint(HintRequest(feedback=wrong("20"), completion=" 7 * 2 = 15\n15 + 5 = 20\n#### 20", task=TASK))
        == "Step 1: 7 × 2 = 14, not 15."
    )
    annotated = " 7 * 2 = <<7*2=14>>14\n14 + 5 = <<14+5=18>>18\n#### 18"
    # the true value of step 2 is the final answer: the hint says the step is wrong, never the value
    assert sc.hint(HintRequest(feedback=wrong("18"), completion=annotated, task=TASK)) == "Step 2: 14 + 5 is not 18."
    assert "19" not in sc.hint(HintRequest(feedback=wrong("18"), completion=annotated, task=TASK))
    assert (
        sc.hint(
            HintRequest(
                feedback=Feedback("correct", "ok", {}, 1.0), completion=" 7 * 2 = 14\n14 + 5 = 19\n#### 19", task=TASK
            )
        )
        is None
    )


def test_step_check_names_the_quantity_used_wrongly_when_every_step_holds():
    assert locate_mistake(" 7 * 3 = 21\n21 + 5 = 26\n#### 26", TASK) == "Step 1 uses 3 where it needs 2."
    assert locate_mistake(" 2 * 7 = 14\n14 + 4 = 18\n#### 18", TASK) == "Step 2 uses 4 where it needs 5."
    assert locate_mistake(" 7 * 2 = 14\n14 - 5 = 9\n#### 9", TASK) == "Step 2 should add, not subtract."
    assert locate_mistake(" 7 * 2 = 14\n#### 14", TASK) == "Step 2 is missing: the question needs 2 steps."
    assert (
        locate_mistake(" 7 * 2 = 14\n14 + 5 = 19\n#### 91", TASK)
        == "The final answer is not the result of the last step."
    )


def test_step_check_falls_back_to_the_configured_provider():
    no_steps = " Tom has 20 apples.\n#### 20"
    assert (
        build("hints", "step_check").hint(HintRequest(feedback=wrong("20"), completion=no_steps, task=TASK))
        == "The final answer 20 is wrong."
    )
    templ = build_hint_provider({"name": "step_check", "fallback": {"name": "template", "reveal_answer": False}})
    assert templ.hint(HintRequest(feedback=wrong("20"), completion=no_steps, task=TASK)).startswith(
        "Your final answer 20 is not correct."
    )
    none = build_hint_provider({"name": "step_check", "fallback": "none"})
    assert none.hint(HintRequest(feedback=wrong("20"), completion=no_steps, task=TASK)) is None
    # a task without a worked solution: a wrong step is still named, a right one falls back
    bare = {"prompt": TASK["prompt"], "answer": "19"}
    assert locate_mistake(" 7 * 2 = 14\n14 + 4 = 17\n#### 17", bare) == "Step 2: 14 + 4 = 18, not 17."
    assert locate_mistake(" 7 * 2 = 14\n14 + 4 = 18\n#### 18", bare) is None
    with pytest.raises(ValueError, match="unknown field"):
        StepCheckHintProvider(template="Step {step}: {equation}")


def test_step_check_on_generated_tasks_through_the_env_and_the_batch_contract():
    env = GSM8KEnv(difficulty="chain")
    tasks = env.sample_tasks(4, "test", seed=3)
    comps = []
    for t in tasks:
        first = parse_steps(t["solution"])[0]
        comps.append(f" {t['solution'].splitlines()[0].rsplit('=', 1)[0]}= {int(first.stated) + 1}\n#### 0")
    fbs = [env.feedback(t["prompt"], c, **t) for c, t in zip(comps, tasks, strict=True)]
    assert all(fb.kind == "wrong_answer" for fb in fbs)
    requests = [HintRequest(t["prompt"], c, fb, t) for t, c, fb in zip(tasks, comps, fbs, strict=True)]
    hints = build_hint_provider("step_check").hints(requests)
    for h, t in zip(hints, tasks, strict=True):
        first = parse_steps(t["solution"])[0]
        assert h == f"Step 1: {first.shown()}, not {int(first.stated) + 1}."


def test_full_demonstration_first_then_step_check_uses_both_and_names_each_kind():
    """The chain is tried in order: a demonstration where a sibling succeeded, step_check where none did
    (step_check first would hint every failure and never let a demonstration through)."""
    import torch
    import yaml

    from composer_plugins.training.step.experience import hint_fields
    from composer_plugins.training.step.record import StepRecord

    env = GSM8KEnv(difficulty="chain")
    task = env.sample_tasks(1, "train", seed=0)[0]
    first = parse_steps(task["solution"])[0]
    wrong_step = f" {task['solution'].splitlines()[0].rsplit('=', 1)[0]}= {int(first.stated) + 1}\n#### 0"
    good = " " + task["solution"]
    spec = {
        "name": "chain",
        "providers": [
            {"name": "demonstration", "rows": "failed", "fallback": "none"},
            {"name": "step_check", "fallback": "none"},
        ],
    }
    chain = build_hint_provider(spec)
    # group 0: one sibling succeeded -> its failed row gets a demonstration; group 1: none did -> step_check
    comps, rewards = [wrong_step, good, wrong_step, wrong_step], [0.0, 1.0, 0.0, 0.0]
    rec = StepRecord(
        tasks=[task, task],
        prompts=[task["prompt"]] * 4,
        completions=comps,
        prompt_ids=torch.zeros(4, 1, dtype=torch.long),
        prompt_mask=torch.ones(4, 1, dtype=torch.long),
        completion_ids=torch.zeros(4, 1, dtype=torch.long),
        completion_mask=torch.ones(4, 1, dtype=torch.long),
        rewards=torch.tensor(rewards),
        advantages=torch.zeros(4),
        num_generations=2,
    )
    hinted = rec.replace(**hint_fields(rec, env, chain, success_threshold=1.0))  # a new record: rec is read-only
    assert hinted.hint_rows == [0, 2, 3]
    assert list(hinted.hint_kinds) == ["demonstration", None, "step_check", "step_check"]
    assert "Correct solution:" in hinted.hint_contexts[0] and "Step 1:" in hinted.hint_contexts[2]
    # the other order: step_check answers every failure, the demonstration is never used
    rev = build_hint_provider({"name": "chain", "providers": spec["providers"][::-1]})
    hinted = rec.replace(**hint_fields(rec, env, rev, success_threshold=1.0))
    assert list(hinted.hint_kinds) == ["step_check", None, "step_check", "step_check"]
    # the calibrated study's `full` names its channels in the order that uses both
    root = Path(__file__).resolve().parents[2]
    variants = yaml.safe_load((root / "studies/calibrated/params.yaml").read_text())["study"]["variants"]
    for name in ("full", "full_teacher"):
        chain_of = [p["name"] for p in variants[name]["hints"]["provider"]["providers"]]
        assert chain_of == ["demonstration", "step_check"], name


def test_prepare_reports_line_level_overlap_beside_the_tuple_level_one(tmp_path):
    """What docs/results.md says of the chain study's split: no test tuple is in train, yet every test first line,
    367 of 400 second lines and 397 of 400 answers occur verbatim in train."""
    from composer_plugins.pipeline.stages import prepare

    params = {
        "data": {"seed": 0, "gsm8k": {"train": 3000, "test": 400}},
        "train": {"env": {"name": "gsm8k", "difficulty": "chain"}},
    }
    entry = prepare(params, tmp_path)["envs"]["gsm8k"]
    assert entry["computation_overlap"] == 0
    got = {k: entry[k] for k in ("first_line_overlap", "second_line_overlap", "second_line_rows", "answer_overlap")}
    want = {"first_line_overlap": 400, "second_line_overlap": 367, "second_line_rows": 400, "answer_overlap": 397}
    assert got == want
    assert json.loads((tmp_path / "manifest.json").read_text())["envs"]["gsm8k"]["second_line_overlap"] == 367


def test_accuracy_split_by_line_novelty_by_hand():
    from composer_plugins.pipeline.stages import line_novelty, novelty_accuracy

    train = [{"solution": "7 * 2 = 14\n14 + 8 = 22\n#### 22"}, {"solution": "3 + 4 = 7\n7 - 2 = 5\n#### 5"}]
    test = [
        {"solution": "7 * 3 = 21\n21 + 1 = 22\n#### 22", "correct": True},  # second line new
        {"solution": "2 + 5 = 7\n7 - 2 = 5\n#### 5", "correct": True},  # second line seen
        {"solution": "6 * 2 = 12\n12 + 8 = 20\n#### 20", "correct": False},  # new
        {"solution": "9 - 1 = 8\n#### 8", "correct": True},  # no second line: in neither split
    ]
    assert line_novelty(train, test) == [True, False, True, None]
    got = novelty_accuracy(train, test, "gsm8k")
    assert got == {
        "gsm8k/n_unseen_line": 2.0,
        "gsm8k/accuracy_unseen_line": 0.5,
        "gsm8k/n_seen_line": 1.0,
        "gsm8k/accuracy_seen_line": 1.0,
    }
