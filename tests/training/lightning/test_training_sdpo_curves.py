"""SDPO as published (demonstrations on every row with a successful sibling, no policy-gradient channel) and
the held-out learning curve (``eval.every_n_steps``) on the tiny policy."""

from __future__ import annotations

import csv
import math

import pytest

from composer_plugins.envs.base import Feedback
from composer_plugins.envs.hints import DemonstrationHintProvider, HintRequest, SiblingGroup
from composer_plugins.training.lightning.curves import CURVE_FILE, HeldoutCurve, heldout_curve
from composer_plugins.training.lightning.module import ComposerModule
from composer_plugins.training.runs.run import run_train
from composer_plugins.training.step.policy import load_policy_for
from composer_plugins.training.step.record import hint_candidates

SDPO = (
    "losses.grpo.weight=0",
    "losses.hint_distill.weight=1",
    "hints.provider={name: demonstration, rows: all, fallback: none}",
    "eval.every_n_steps=2",
    "eval.curve_problems=6",
    "trainer.max_steps=3",
    "trainer.checkpoint_every_n_steps=0",
)

OK = Feedback("correct", "Correct: 10.", {"expected": "10", "got": "10"}, 1.0)
WRONG = Feedback("wrong_answer", "The final answer 3 is wrong.", {"expected": "10", "got": "3"}, 0.0)


def test_rows_all_hints_successful_rows_from_another_success_only():
    comps = (" #### 3", " 3 + 7 = 10\n#### 10", " 3 + 7 = 10.\n#### 10", " #### 4")
    group = lambda i: SiblingGroup(comps, (0.0, 1.0, 1.0, 0.0), i, 1.0)  # noqa: E731
    sdpo = DemonstrationHintProvider(rows="all", fallback="none")
    failed = DemonstrationHintProvider(fallback="none")
    assert hint_candidates(sdpo, [1.0, 0.0], 0.5) == [0, 1] and hint_candidates(failed, [1.0, 0.0], 0.5) == [1]
    assert "3 + 7 = 10.\n#### 10" in sdpo.hint(
        HintRequest(feedback=OK, group=group(1))
    )  # a success, taught by the other success
    assert "3 + 7 = 10\n#### 10" in sdpo.hint(HintRequest(feedback=OK, group=group(2)))
    assert failed.hint(HintRequest(feedback=OK, group=group(1))) is None  # rows: failed leaves successes to GRPO
    assert sdpo.hint(HintRequest(feedback=WRONG, group=group(0))) == failed.hint(
        HintRequest(feedback=WRONG, group=group(0))
    )
    lone = SiblingGroup((" #### 10", " #### 3"), (1.0, 0.0), 0, 1.0)
    assert sdpo.hint(HintRequest(feedback=OK, group=lone)) is None  # no successful sibling other than itself
    try:
        DemonstrationHintProvider(rows="some")
    except ValueError as e:
        assert "rows 'some' is not one of failed, all" in str(e)
    else:
        raise AssertionError("rows: some was accepted")


def test_sdpo_without_grpo_trains_on_every_row_with_a_sibling_and_draws_the_heldout_curve(make_cfg):
    cfg, src = make_cfg("", *SDPO)
    policy, tok = load_policy_for(cfg)
    module = ComposerModule(cfg, policy=policy, tokenizer=tok, src=src)
    tasks = module.env.sample_tasks(2, "train", seed=0)
    rb = module.make_rollout_batch(tasks, seed=0)
    G = cfg.rollout.num_generations
    ok = [float(r) >= 1.0 for r in rb.rewards]
    want = [i for i in range(len(ok)) if any(ok[j] for j in range(i - i % G, i - i % G + G) if j != i)]
    assert rb.hint_rows == want  # successful rows with another success included, lone successes not

    res = run_train(cfg, src)
    assert [r["step"] for r in res.history] == [1, 2, 3]
    assert all(row.get("train/grpo/loss", 0.0) == 0.0 for row in res.history)  # no policy-gradient channel
    assert all(math.isfinite(row["train/loss"]) for row in res.history)
    with open(f"{res.output_dir}/history.csv") as f:
        rows = list(csv.DictReader(f))
    curve = {int(r["step"]): r["train/heldout/accuracy"] for r in rows}
    assert curve[1] == "" and curve[2] != "" and curve[3] != ""  # every 2 steps, and at the last one
    assert all(0.0 <= float(curve[s]) <= 1.0 for s in (2, 3))
    with open(f"{res.output_dir}/{CURVE_FILE}") as f:  # every point, the starting policy's at step 0 included
        points = {int(r["step"]): float(r["value"]) for r in csv.DictReader(f)}
    assert sorted(points) == [0, 2, 3] and all(points[s] == float(curve[s]) for s in (2, 3))


def test_the_curve_is_dense_early_then_every_n_steps():
    c = HeldoutCurve(6, 400, early_every=3, early_until=18)
    assert [s for s in range(61) if c.due(s, last=s == 60)] == [0, 3, 6, 9, 12, 15, 18, 24, 30, 36, 42, 48, 54, 60]
    assert [s for s in range(14) if HeldoutCurve(6, 10).due(s, last=s == 13)] == [0, 6, 12, 13]
    with pytest.raises(ValueError, match="curve_early_until"):
        HeldoutCurve(6, 10, early_every=3)
    cb = heldout_curve({"every_n_steps": 6, "curve_early_every": 3, "curve_early_until": 18})
    assert (cb.early_every, cb.early_until) == (3, 18)


def test_sft_step_check_examples_show_a_false_step_named_by_step_check(make_cfg):
    from composer_plugins.envs.steps import parse_steps
    from composer_plugins.training.runs.sft import sft_pairs

    cfg, _ = make_cfg(
        "", "env.difficulty=chain", "sft.hint_fraction=1.0", "sft.hint_kinds={step_check: 1}", "sft.num_examples=20"
    )
    from composer_plugins.training.step.components import build_env

    pairs = sft_pairs(build_env(cfg), cfg)
    assert len(pairs) == 20
    for prompt, target in pairs:
        hint = prompt.split("Hint: ", 1)[1]
        assert hint.startswith("Step ") and (", not " in hint or " is not " in hint), prompt
        assert all(s.holds for s in parse_steps(target))  # the target stays the worked solution
