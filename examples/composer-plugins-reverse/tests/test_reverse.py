"""The example env's own tests: the project's conformance checks, the env contract, discovery through the
registry, and one training run.

Run them with ``cd examples/composer-plugins-reverse && python -m pytest`` (the package need not be
installed: the tests register the module on a fresh plugin manager, as docs/plugins.md shows).
"""

from __future__ import annotations

import math

import composer_plugins_reverse as rev
import pytest

from composer_plugins.core.errors import UnknownPluginError
from composer_plugins.core.plugins import build_registry, make_plugin_manager, reset, use_plugin_manager
from composer_plugins.testing import conformance_test

#: The checks every registered env passes (tasks with a prompt, deterministic seeds, finite rewards
#: for odd completions, episodes that end): one generated test per entry this plugin registers.
test_conformance = conformance_test(rev)


@pytest.fixture
def registry():
    """The built-in plugins plus this one, as the process-wide registry (restored afterwards)."""
    pm = make_plugin_manager(entrypoints=False)
    if pm.get_plugin("reverse") is None:
        pm.register(rev, name="reverse")
    use_plugin_manager(pm)
    yield build_registry(pm)
    reset()


def test_tasks_are_deterministic_and_the_splits_disjoint():
    env = rev.ReverseWordEnv()
    a, b = env.sample_tasks(20, "train", seed=3), env.sample_tasks(20, "train", seed=3)
    assert a == b and all({"prompt", "answer", "target", "task_id"} <= set(t) for t in a)
    test = env.sample_tasks(50, "test", seed=0)
    assert not {t["task_id"] for t in env.sample_tasks(200, "train", seed=1)} & {t["task_id"] for t in test}


def test_reward_in_trls_shape_and_structured_feedback():
    env = rev.ReverseWordEnv()
    tasks = env.sample_tasks(4, seed=0)
    prompts = [t["prompt"] for t in tasks]
    perfect = [t["target"] for t in tasks]
    assert env.reward(prompts, perfect, answer=[t["answer"] for t in tasks], trainer_state=None) == [1.0] * 4
    wrong = env.feedback(prompts[0], " zzz", **tasks[0])
    assert wrong.kind == "wrong_answer" and wrong.reward == 0.0 and wrong.details["expected"] == tasks[0]["answer"]
    assert env.feedback(prompts[0], "   ", **tasks[0]).kind == "no_answer"
    obs = env.reset(task=tasks[0])
    _, reward, done, info = env.step(tasks[0]["target"])
    assert obs.text == tasks[0]["prompt"] and reward == 1.0 and done and info["feedback"].ok


def test_discovered_by_name_and_typos_answered(registry):
    entry = registry.get("envs", "reverse_word")
    assert entry.plugin == "reverse" and "Reverse a word" in entry.description
    env = registry.build("envs", "reverse_word", max_len=4)
    assert isinstance(env, rev.ReverseWordEnv) and env.max_len == 4
    with pytest.raises(UnknownPluginError, match="reverse_word"):
        registry.get("envs", "reverse_wrod")


def test_trains_with_grpo_and_hint_distillation(registry, tmp_path):
    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.runs.run import run_train

    cfg, src = loads_train_config(
        f"""
        output_dir: {tmp_path / "run"}
        cache_dir: {tmp_path / "cache"}
        env: {{name: reverse_word, max_len: 4}}
        model:
          tiny: {{hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 1,
                  vocab_size: 300, tokenizer_corpus_size: 200}}
        sft: {{steps: 8, batch_size: 8, num_examples: 64, progress: false}}
        losses: {{grpo: {{weight: 1.0}}, hint_distill: {{weight: 0.5}}}}
        hints: {{provider: {{name: template, reveal_answer: true}}}}
        rollout: {{prompts_per_step: 2, num_generations: 4, max_new_tokens: 6, temperature: 1.0}}
        trainer: {{max_steps: 2, checkpoint_every_n_steps: 0, enable_progress_bar: false, num_threads: 1}}
        eval: {{num_problems: 4, batch_size: 4, k: 1, num_samples: 1, at_start: false, at_end: true}}
        """
    )
    res = run_train(cfg, src)
    assert [r["step"] for r in res.history] == [1, 2]
    for row in res.history:
        assert row["train/grpo/skipped"] == 0.0 and math.isfinite(row["train/loss"])
        assert 0.0 <= row["train/reward"] <= 1.0
    assert 0.0 <= res.metrics["val/accuracy"] <= 1.0
