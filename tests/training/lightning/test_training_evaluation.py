"""Held-out evaluation: ``eval.temperature: 0`` is greedy, checkpoints load strictly, result files are atomic."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from composer_plugins.core.errors import ComposerPluginsError, ConfigError
from composer_plugins.training.step.components import build_env
from composer_plugins.training.step.policy import load_policy_for


class TextHashEnv:
    """Wraps an env; the reward of a completion is a hash of its text (equal rewards: equal completions)."""

    def __init__(self, env):
        self.env = env

    def reward(self, prompts, completions, **task):
        return [int(hashlib.sha256(c.encode()).hexdigest()[:8], 16) / 2**32 for c in completions]


def test_eval_temperature_zero_samples_greedily(make_cfg):
    from composer_plugins.training.lightning.evaluation import Validator

    cfg, src = make_cfg("", "eval.temperature=0", "eval.num_samples=3", "eval.k=3", "rollout.temperature=1.0")
    env = build_env(cfg, src)
    policy, tok = load_policy_for(cfg, env)
    tasks = env.sample_tasks(6, split="test", seed=2)
    out = Validator(cfg, tok, TextHashEnv(env)).evaluate(policy, tasks, seed=7)
    # every sample is the greedy completion (a sampled one at the rollout's temperature would differ somewhere)
    greedy = out["rewards_greedy"].view(-1, 1).expand(-1, 3)
    assert torch.equal(out["rewards_samples"], greedy)
    # and a positive temperature does sample
    cfg, src = make_cfg("", "eval.temperature=1.0", "eval.num_samples=3", "eval.k=3")
    out = Validator(cfg, tok, TextHashEnv(env)).evaluate(policy, tasks, seed=7)
    assert not torch.equal(out["rewards_samples"], out["rewards_greedy"].view(-1, 1).expand(-1, 3))


def test_the_validator_is_given_what_it_reads_and_owns_what_it_accumulates(make_cfg):
    """No module: a config, a tokenizer, an env and a policy per call; its metrics and predictions are its own."""
    from composer_plugins.training.lightning.evaluation import Validator
    from composer_plugins.training.rollout.rewards import env_tasks
    from composer_plugins.training.step.metrics import pass_at_k

    cfg, src = make_cfg("", "eval.num_samples=2", "eval.k=2")
    env = build_env(cfg, src)
    policy, tok = load_policy_for(cfg, env)
    v = Validator(cfg, tok, env)
    assert {n for n, _ in v.named_children()} == {"accuracy", "reward", "pass_at_k", "hint_fix", "hint_coverage"}
    assert not list(v.parameters()) and not v.state_dict()  # holds no policy: nothing of it is checkpointed twice
    v.predictions = []
    logged: dict[str, list] = {}
    tasks = env_tasks(env, "test", 6, cfg.eval.seed)
    for i in range(2):
        v.validation_step(
            policy,
            {"index": i, "tasks": tasks[3 * i : 3 * i + 3]},
            lambda k, x, **kw: logged.setdefault(k, []).append(x),
        )
    assert set(logged) == {"val/accuracy", "val/mean_reward", "val/pass_at_2"}
    assert logged["val/accuracy"] == [v.accuracy, v.accuracy]  # the metric object: Lightning reduces it per epoch
    assert len(v.predictions) == 6
    acc = sum(p["correct"] for p in v.predictions) / 6
    assert float(v.accuracy.compute()) == pytest.approx(acc)
    want = sum(pass_at_k(2, p["samples_correct"], 2) for p in v.predictions) / 6
    assert float(v.pass_at_k.compute()) == pytest.approx(want)
    # the held-out curve's point: the greedy accuracy of the same tasks, sampling off
    assert v.greedy_accuracy(policy, tasks, seed=0) == pytest.approx(acc)
    with pytest.raises(ValueError, match="eval.hint_uplift needs hints.provider"):
        v.hint_uplift(policy, tasks, ["no"] * 6, torch.zeros(6), seed=0)


@pytest.mark.parametrize("value", ["-0.5", ".nan"])
def test_eval_temperature_is_validated(make_cfg, value):
    with pytest.raises(ConfigError, match=r"eval\.temperature: must be >= 0 \(0: greedy samples\)"):
        make_cfg("", f"eval.temperature={value}")


def _checkpoint(path, policy, drop: str = "") -> str:
    state = {f"policy.{k}": v for k, v in policy.state_dict().items() if not (drop and drop in k)}
    torch.save({"state_dict": state, "epoch": 0, "global_step": 1}, path)
    return str(path)


def test_run_eval_loads_checkpoints_strictly(make_cfg, tmp_path):
    from composer_plugins.training.lightning.checkpoints import CheckpointError
    from composer_plugins.training.runs.run import run_eval

    cfg, src = make_cfg("", "eval.num_problems=2", "eval.batch_size=2")
    policy, _ = load_policy_for(cfg)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    good = _checkpoint(tmp_path / "good.ckpt", policy)
    metrics = run_eval(cfg, src, checkpoint=good)
    assert set(metrics) == {"gsm8k/accuracy", "gsm8k/mean_reward", "gsm8k/pass_at_2"}
    # a checkpoint of another model (a layer fewer) fails, naming the file and the keys, instead of half-loading
    bad = _checkpoint(tmp_path / "other_model.ckpt", policy, drop="layers.1.")
    with pytest.raises(CheckpointError) as e:
        run_eval(cfg, src, checkpoint=bad)
    msg = str(e.value)
    assert "other_model.ckpt does not fit the configured model" in msg and "missing model.layers.1." in msg
    torch.save({"epoch": 0}, tmp_path / "bare.ckpt")
    with pytest.raises(CheckpointError, match="bare.ckpt: not a Lightning checkpoint"):
        run_eval(cfg, src, checkpoint=str(tmp_path / "bare.ckpt"))


def test_result_files_are_written_atomically(make_cfg, tmp_path, monkeypatch):
    """A write that fails before it is durable leaves the previous metrics file whole (and says why)."""
    from composer_plugins.training.runs.run import run_eval

    cfg, src = make_cfg("", "eval.num_problems=2", "eval.batch_size=2")
    out = tmp_path / "metrics.json"
    out.write_text(json.dumps({"previous": 1.0}))

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(ComposerPluginsError, match="cannot write .*metrics.json.*No space left on device"):
        run_eval(cfg, src, output=str(out))
    assert json.loads(out.read_text()) == {"previous": 1.0}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]  # no temporary file left behind
