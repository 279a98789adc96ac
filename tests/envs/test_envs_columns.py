"""The column levels (a procedure held out by number), their overlap report and ``step_check``'s column hints."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from composer_plugins.envs.arith import column_numbers, generate_problems, split_of
from composer_plugins.envs.base import Feedback
from composer_plugins.envs.gsm8k import GSM8KEnv
from composer_plugins.envs.hints import HintRequest, build_hint_provider
from composer_plugins.envs.step_check import false_step_attempt, locate_mistake
from composer_plugins.envs.steps import parse_columns, parse_steps

TASK = {"solution": "8+5+0=13\n7+6+1=14\n4+3+1=8\n#### 843", "answer": "843"}


@pytest.mark.parametrize(("level", "number"), [("columns", 7), ("long_columns", 8)])
def test_columns_level_writes_each_column_with_its_carry(level, number):
    probs = generate_problems(300, level, seed=0)
    assert probs == generate_problems(300, number, seed=0)
    for p in probs:
        a, b = (int(n) for n in p.question.removeprefix("Add ").rstrip(".").split(" and "))
        cols = parse_columns(p.solution)
        assert [(c.a, c.b) for c in cols] == [(int(x), int(y)) for x, y in zip(str(a)[::-1], str(b)[::-1], strict=True)]
        carries = [0] + [(c.a + c.b + c.carry) // 10 for c in cols[:-1]]
        assert [c.carry for c in cols] == carries and all(c.stated == c.a + c.b + c.carry for c in cols)
        assert p.answer == a + b and p.solution.endswith(f"\n#### {a + b}")
        assert parse_steps(p.solution) == []  # a column line is not read as a two-operand step (``5+0=13``)


@pytest.mark.parametrize(("level", "lengths"), [("columns", {3}), ("long_columns", {3, 4, 5})])
def test_columns_split_holds_out_every_number_of_a_test_problem(level, lengths):
    train = generate_problems(30000, level, seed=0)
    test = generate_problems(400, level, seed=0, split="test")
    assert len({p.question for p in test}) == 400
    # the held-out rule must not skew the test lengths: each length is drawn before the numbers, as in train
    for probs in (train, test):
        share = Counter(len(p.question.split()[1]) for p in probs)
        assert set(share) == lengths and min(share.values()) > 0.8 * len(probs) / len(lengths)

    def numbers(p):
        cols = parse_columns(p.solution)
        a, b = (int("".join(str(getattr(c, k)) for c in reversed(cols))) for k in ("a", "b"))
        return {n for ns in column_numbers(a, b).values() for n in ns}

    assert all(split_of(f"n{n}", 0.2) == "test" for p in test for n in numbers(p))
    assert not {n for p in train for n in numbers(p)} & {n for p in test for n in numbers(p)}
    facts = {c.fact for p in train for c in parse_columns(p.solution)}
    assert len(facts) == 200  # every digit + digit + carry (0/1) fact, so every test fact is in train


def test_the_intermediate_results_are_the_sums_of_the_last_columns():
    assert column_numbers(384, 497) == {"operands": (384, 497), "intermediate": (181,), "answer": (881,)}
    assert column_numbers(12345, 67890)["intermediate"] == (45 + 90, 345 + 890, 2345 + 7890)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["columns", "long_columns"])
def test_prepare_reports_the_overlap_at_each_level_of_the_procedure(tmp_path, level):
    """What docs/envs.md and studies/procedural/README.md claim of the split: every test row's facts (and so its
    lines) occur in train; no test operand, intermediate result or answer is any number of a train problem."""
    from composer_plugins.pipeline.stages import prepare

    params = {
        "data": {"seed": 0, "gsm8k": {"train": 30000, "test": 400}},
        "train": {"env": {"name": "gsm8k", "difficulty": level}},
    }
    entry = prepare(params, tmp_path)["envs"]["gsm8k"]
    got = {k: entry[k] for k in ("fact_overlap", "fact_rows", "first_line_overlap", "answer_overlap", "overlap")}
    assert got == {"fact_overlap": 400, "fact_rows": 400, "first_line_overlap": 400, "answer_overlap": 0, "overlap": 0}
    assert entry["operand_overlap"] == entry["intermediate_overlap"] == entry["answer_number_overlap"] == 0
    written = json.loads((tmp_path / "manifest.json").read_text())["envs"]["gsm8k"]
    assert written["operand_overlap"] == 0 and written["fact_overlap"] == 400
    # at chain the report has no procedure levels (its lines are not columns)
    params["train"]["env"]["difficulty"] = "chain"
    params["data"]["gsm8k"] = {"train": 300, "test": 40}
    assert "fact_overlap" not in prepare(params, tmp_path / "chain")["envs"]["gsm8k"]


def test_step_check_names_the_first_wrong_column_and_what_it_is_computed_from():
    cases = {
        "8+5+0=13\n7+6+1=14\n4+3+1=8\n#### 843": None,
        "8+5+0=13\n7+5+1=13\n4+3+1=8\n#### 833": "Column 2 (tens) adds the tens digits 7 and 6, not 7 and 5.",
        "8+5+0=13\n7+6+0=13\n4+3+1=8\n#### 833": (
            "Column 2 (tens): its carry in is the tens digit of column 1's sum, not 0."
        ),
        "8+5+1=14\n7+6+1=14\n4+3+1=8\n#### 844": "Column 1 (ones) has no carry in: 0, not 1.",
        "8+5+0=13\n7+6+1=14\n4+3+1=9\n#### 943": "Column 3 (hundreds): 4+3+1 is not 9.",
        "8+5+0=13\n7+6+1=14\n#### 43": "Column 3 (hundreds) is missing: add the hundreds digits and the carry in.",
        "8+5+0=13\n7+6+1=14\n4+3+1=8\n#### 834": (
            "The answer is the last column's sum followed by the last digit of each column before it, last to first."
        ),
        "The sum is 843.\n#### 842": None,  # no column stated: the fallback provider's turn
    }
    for completion, want in cases.items():
        got = locate_mistake(" " + completion, TASK)
        assert got == want, completion
        assert got is None or ("843" not in got and "=" not in got)  # never a result, never the answer
    sc = build_hint_provider({"name": "step_check", "fallback": "none"})
    fb = Feedback("wrong_answer", "The final answer 833 is wrong.", {"expected": "843", "got": "833"}, 0.0)
    assert sc.hints([HintRequest("p", " 8+5+0=13\n7+5+1=13\n4+3+1=8\n#### 833", fb, TASK)]) == [
        cases["8+5+0=13\n7+5+1=13\n4+3+1=8\n#### 833"]
    ]


def test_false_column_attempts_teach_the_hint_sft_shows():
    rng = random.Random(0)
    for p in generate_problems(50, "columns", seed=1):
        task = {"solution": p.solution, "answer": str(p.answer)}
        wrong = false_step_attempt(p.solution, rng)
        cols, gold = parse_columns(wrong), parse_columns(p.solution)
        k = next(i for i, (c, g) in enumerate(zip(cols, gold, strict=True)) if c.stated != g.stated)
        assert cols[k].stated != cols[k].a + cols[k].b + cols[k].carry  # one false sum, the rest carried on from it
        assert all(c.stated == c.a + c.b + c.carry for c in cols[k + 1 :])
        assert locate_mistake(wrong, task).startswith(f"Column {k + 1} (")


def test_a_sibling_demonstration_first_then_the_column_check():
    from composer_plugins.training.step.experience import hint_fields
    from composer_plugins.training.step.record import StepRecord

    env = GSM8KEnv(difficulty="columns")
    task = env.sample_tasks(1, "train", seed=0)[0]
    cols = parse_columns(task["solution"])
    bad = [f"{c.a}+{c.b}+{c.carry}={c.stated + (i == 1)}" for i, c in enumerate(cols)]
    wrong_col = " " + "\n".join(bad) + "\n#### 1"
    spec = {
        "name": "chain",
        "providers": [
            {"name": "demonstration", "rows": "failed", "fallback": "none"},
            {"name": "step_check", "fallback": "none"},
        ],
    }
    rec = StepRecord(
        tasks=[task, task],
        prompts=[task["prompt"]] * 4,
        completions=[wrong_col, " " + task["solution"], wrong_col, wrong_col],
        prompt_ids=torch.zeros(4, 1, dtype=torch.long),
        prompt_mask=torch.ones(4, 1, dtype=torch.long),
        completion_ids=torch.zeros(4, 1, dtype=torch.long),
        completion_mask=torch.ones(4, 1, dtype=torch.long),
        rewards=torch.tensor([0.0, 1.0, 0.0, 0.0]),
        advantages=torch.zeros(4),
        num_generations=2,
    )
    hinted = rec.replace(**hint_fields(rec, env, build_hint_provider(spec), success_threshold=1.0))
    assert list(hinted.hint_kinds) == ["demonstration", None, "step_check", "step_check"]
    assert task["solution"].splitlines()[0] in hinted.hint_contexts[0]  # the sibling's worked columns
    c = cols[1]
    assert f"Column 2 (tens): {c.a}+{c.b}+{c.carry} is not {c.stated + 1}." in hinted.hint_contexts[2]
