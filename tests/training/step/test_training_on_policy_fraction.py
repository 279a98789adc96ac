"""``rollout.on_policy_fraction`` (TRL GKD's ``lmbda``): the share of steps whose completions the policy samples.

* at 0 every step reads each task's reference completion once (a group of one), tokenized as a sampled
  completion would be (followed by EOS), and scored by the env; no generation runs;
* at 0.5 the choice is the step seed's: the same seed always chooses the same way, and about half choose each;
* a whole run at 0 distils an external teacher on the dataset's completions (the off-policy form of GKD), and
  every step's tokens are the reference ones;
* a value outside [0, 1], or below 1 with multi-turn episodes, is refused at its key.
"""

from __future__ import annotations

import math

import pytest
import torch

from composer_plugins.core.errors import ConfigError
from composer_plugins.models.generation import tokenize_completions
from composer_plugins.training.rollout.rewards import env_tasks, reference_completion
from composer_plugins.training.runs.run import run_train
from composer_plugins.training.step.components import build_env
from composer_plugins.training.step.experience import Sampler
from composer_plugins.training.step.policy import base_policy_path, load_policy_for


class _NoGenerate:
    """A generator that must not be asked: an off-policy step samples nothing."""

    def generate(self, *a, **k):
        raise AssertionError("an off-policy step called the generator")


def _setup(make_cfg, *over):
    cfg, _ = make_cfg("", *over)
    env = build_env(cfg)
    policy, tok = load_policy_for(cfg, env)
    return cfg, env, policy, tok


def test_at_zero_every_step_reads_the_reference_completions_and_samples_nothing(make_cfg):
    cfg, env, policy, tok = _setup(make_cfg, "rollout.on_policy_fraction=0.0")
    sampler = Sampler.from_config(cfg, env=env)
    assert sampler.on_policy_fraction == 0.0
    sampler.generator = _NoGenerate()
    tasks = env_tasks(env, "train", 3, seed=5)
    ro, rewards, feedback = sampler.sample(policy, tok, env, tasks, seed=11)
    refs = [reference_completion(t) for t in tasks]
    assert all(r and r.startswith(" ") for r in refs)  # the worked solution after `Answer:`
    want_ids, want_mask = tokenize_completions(tok, refs, cfg.rollout.max_new_tokens)
    assert ro.num_generations == 1 and ro.completions == refs
    assert ro.group_index.tolist() == [0, 1, 2]
    assert torch.equal(ro.completion_ids, want_ids) and torch.equal(ro.completion_mask, want_mask)
    eos = tok.eos_token_id
    for row, m in zip(ro.completion_ids, ro.completion_mask, strict=True):
        n = int(m.sum())
        assert n <= cfg.rollout.max_new_tokens and (row[n - 1] == eos or n == cfg.rollout.max_new_tokens)
    assert rewards == [1.0, 1.0, 1.0] and feedback == [None] * 3  # the env scores the references: correct
    assert ro.extra["on_policy"] is False


def test_at_one_half_the_step_seed_chooses_and_about_half_sample(make_cfg):
    cfg, env, _, _ = _setup(make_cfg, "rollout.on_policy_fraction=0.5")
    sampler = Sampler.from_config(cfg, env=env)
    picks = [sampler.on_policy(s) for s in range(400)]
    assert picks == [sampler.on_policy(s) for s in range(400)]  # the seed's, so a resume re-chooses alike
    assert 0.4 < sum(picks) / 400 < 0.6
    sampler.on_policy_fraction = 1.0
    assert all(sampler.on_policy(s) for s in range(50))
    sampler.on_policy_fraction = 0.0
    assert not any(sampler.on_policy(s) for s in range(50))


def test_a_run_at_zero_distils_the_teacher_on_the_dataset_completions(make_cfg):
    cfg0, _ = make_cfg("")
    base = base_policy_path(cfg0, build_env(cfg0))
    teacher = f"""
    losses:
      grpo: {{weight: 0.0}}
      hint_distill: {{weight: 0.0}}
      teacher_distill:
        weight: 1.0
        teachers: [{{kind: causal_lm, id: base, model_path: {base}, topk: 8}}]
    """
    over = ("rollout.on_policy_fraction=0.0", "rollout.prompts_per_step=3", "rollout.max_new_tokens=40")
    cfg, src = make_cfg(teacher, *over)
    res = run_train(cfg, src)
    assert [r["step"] for r in res.history] == [1, 2]
    env = build_env(cfg)
    for row in res.history:
        assert row["train/reward"] == 1.0 and row["train/accuracy"] == 1.0  # the references, not samples
        assert row["train/teacher_distill/skipped"] == 0.0 and row["train/teacher_distill/loss"] > 0
        assert math.isfinite(row["train/teacher_distill/loss"])
        assert row["train/teacher_distill/tokens"] == row["train/completion_tokens"]  # every reference token
    # three reference completions a step, each scored once by the teacher (no G copies)
    assert res.history[-1]["train/teacher/base/rows"] == 2 * 3
    # the tokens trained on are the references' (solution + EOS) of the step's tasks
    lengths = [len(tok) for tok in _reference_lengths(cfg, env)]
    assert min(lengths) <= res.history[0]["train/completion_length"] <= max(lengths)


def _reference_lengths(cfg, env):
    _, tok = load_policy_for(cfg, env)
    tasks = env_tasks(env, "train", 50, seed=0)
    return [tok(reference_completion(t), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in tasks]


@pytest.mark.parametrize(
    "over,match",
    [
        (("rollout.on_policy_fraction=1.5",), "rollout.on_policy_fraction: must be in \\[0, 1\\]"),
        (("rollout.on_policy_fraction=-0.1",), "rollout.on_policy_fraction: must be in \\[0, 1\\]"),
        (("rollout.on_policy_fraction=0.5", "rollout.max_turns=2"), "1 with multi-turn episodes"),
    ],
)
def test_a_fraction_outside_the_unit_interval_or_with_episodes_is_refused_at_its_key(make_cfg, over, match):
    with pytest.raises(ConfigError, match=match):
        make_cfg("", *over)
