"""Demonstrations in training: rollout groups reach the provider, SFT demonstration contexts, the hint-uplift eval."""

from __future__ import annotations

import json
import math

import pytest

from composer_plugins.envs.hints import HintProvider


class HintEverything(HintProvider):
    """Hints every row, failed or not (a constructed case: coverage must be 1.0)."""

    def hint(self, feedback, *, prompt=None, completion=None, task=None):
        return f"The answer is {task['answer']}."


class HintNothing(HintProvider):
    def hint(self, request):
        return None


def test_make_rollout_batch_gives_the_provider_each_rows_group(make_cfg):
    from composer_plugins.training.lightning.module import ComposerModule
    from composer_plugins.training.step.components import build_env

    cfg, src = make_cfg("", "rollout.prompts_per_step=4", "hints.provider=demonstration")
    m = ComposerModule(cfg, env=build_env(cfg, src), src=src)
    tasks = build_env(cfg, src).sample_tasks(4, split="train", seed=3)
    G = cfg.rollout.num_generations
    seen = []
    inner = m.hint_provider.hint

    def spy(request):
        seen.append((request.completion, request.task, request.group))
        assert request.reward == request.group.reward  # the row's reward travels with its request
        return inner(request)

    m.hint_provider.hint = spy
    rb = m.make_rollout_batch(tasks, seed=5)
    rewards = rb.rewards.tolist()
    failed = [i for i, r in enumerate(rewards) if r < cfg.rollout.success_threshold]
    assert len(seen) == len(failed)
    for i, (completion, task, group) in zip(failed, seen, strict=True):
        g0 = i - i % G
        assert task is tasks[i // G] and group.index == i % G and group.completion == completion
        assert list(group.completions) == list(rb.completions[g0 : g0 + G])
        assert list(group.rewards) == pytest.approx(rewards[g0 : g0 + G])
    for row, ctx in zip(rb.hint_rows, rb.hinted_contexts, strict=True):
        g0 = row - row % G
        ok = [j for j in range(g0, g0 + G) if j != row and rewards[j] >= 0.5]
        if ok:  # a demonstration from a successful sibling, never the row's own attempt
            assert "Correct solution:\n" + rb.completions[ok[0]].strip() in ctx
        else:  # the fallback: the feedback alone
            assert "Correct solution" not in ctx


def test_sft_demonstration_contexts(make_cfg):
    from composer_plugins.training.runs.sft import sft_hint_kinds, sft_pairs
    from composer_plugins.training.step.components import build_env
    from composer_plugins.training.step.policy import sft_cache_key

    cfg, src = make_cfg("", "sft.num_examples=40", "hints.provider=demonstration")
    env = build_env(cfg, src)
    assert sft_hint_kinds(cfg) == {"demonstration": 1.0}
    pairs = sft_pairs(env, cfg)
    hinted = [(p, t) for p, t in pairs if "Hint:" in p]
    assert 0 < len(hinted) < len(pairs)
    for prompt, target in hinted:  # the context shows the problem's own worked solution; the target is it
        assert f"Hint: Correct solution:\n{target.strip()}\n\nCorrectly solve the original question.\nAnswer:" in prompt
    # today's behaviour for other providers, and an explicit {feedback: 1} is the same examples
    base, _ = make_cfg("", "sft.num_examples=40")
    explicit, _ = make_cfg("", "sft.num_examples=40", "sft.hint_kinds={feedback: 1}")
    assert sft_hint_kinds(base) == {"feedback": 1.0}
    plain = sft_pairs(env, base)
    assert plain == sft_pairs(env, explicit)
    assert all("Correct solution" not in p for p, _ in plain) and any("Hint:" in p for p, _ in plain)
    assert "hint_kinds" not in sft_cache_key(base, "b")["sft"]  # the default keeps old warm starts cached
    # a split: both kinds, the demonstration through the default provider when hints.provider reads no groups
    mixed, _ = make_cfg("", "sft.num_examples=80", "sft.hint_kinds={feedback: 1, demonstration: 1}")
    mp = sft_pairs(env, mixed)
    assert any("Correct solution" in p for p, _ in mp) and any("Hint: Your final answer" in p for p, _ in mp)


def test_sft_hint_kinds_errors_are_located(make_cfg):
    from composer_plugins.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"sft\.hint_kinds\.demo: unknown hint kind.*demonstration, feedback"):
        make_cfg("", "sft.hint_kinds={demo: 1}")
    with pytest.raises(ConfigError, match=r"sft\.hint_kinds\.feedback: a share must be a number >= 0"):
        make_cfg("", "sft.hint_kinds={feedback: -1}")
    with pytest.raises(ConfigError, match=r"sft\.hint_kinds: the shares sum to 0"):
        make_cfg("", "sft.hint_kinds={feedback: 0}")


def _uplift(make_cfg, tmp_path, *overrides):
    from composer_plugins.training.runs.run import run_eval

    cfg, src = make_cfg("", "eval.hint_uplift=true", "eval.predictions=true", "eval.num_problems=16", *overrides)
    out = tmp_path / "eval.json"
    metrics = run_eval(cfg, src, output=str(out))
    preds = [json.loads(x) for x in out.with_suffix(".predictions.jsonl").read_text().splitlines()]
    assert json.loads(out.read_text()).keys() == metrics.keys()
    return metrics, preds


def test_hint_uplift_counts_on_constructed_providers(make_cfg, tmp_path):
    m, preds = _uplift(make_cfg, tmp_path, f"hints.provider={{class_path: {__name__}.HintEverything}}")
    failures = sum(1 for p in preds if not p["correct"])
    assert failures > 0, "the tiny policy must fail some problems for this case"
    assert m["gsm8k/hint_failures"] == failures and m["gsm8k/hint_hinted"] == failures
    assert m["gsm8k/hint_coverage"] == 1.0  # every failure got a hint (passing problems are not counted)
    fixed = sum(1 for p in preds if p.get("hint_fixed"))
    assert m["gsm8k/hint_fixed"] == fixed and m["gsm8k/hint_fix_rate"] == pytest.approx(fixed / failures)
    assert 0.0 <= m["gsm8k/hint_fix_rate"] <= 1.0
    assert m["gsm8k/accuracy"] == pytest.approx(1 - failures / 16)
    for p in preds:
        assert ("hint_context" in p) == (not p["correct"])
        if not p["correct"]:
            assert f"Hint: The answer is {p['answer']}." in p["hint_context"]
    m, _ = _uplift(make_cfg, tmp_path, f"hints.provider={{class_path: {__name__}.HintNothing}}")
    assert m["gsm8k/hint_coverage"] == 0.0 and m["gsm8k/hint_hinted"] == 0 and math.isnan(m["gsm8k/hint_fix_rate"])


def test_hint_uplift_with_demonstrations_from_k_samples(make_cfg, tmp_path):
    m, preds = _uplift(
        make_cfg, tmp_path, "hints.provider={name: demonstration, fallback: none}", "eval.hint_uplift_samples=4"
    )
    failed = [p for p in preds if not p["correct"]]
    hinted = [p for p in failed if "hint_context" in p]
    assert m["gsm8k/hint_coverage"] == pytest.approx(len(hinted) / len(failed))
    for p in hinted:  # the demonstration is a sample that solved it, never the failed greedy attempt
        demo = p["hint_context"].split("Correct solution:\n", 1)[1].split("\n\nCorrectly solve")[0]
        assert f"#### {p['answer']}" in demo.replace(".0", "") or p["answer"] in demo
        assert demo != p["completion"].strip()


def test_cli_eval_hint_uplift(tiny_yaml, tmp_path):
    from click.testing import CliRunner

    from composer_plugins.core.cli import load_commands

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(tiny_yaml)
    r = CliRunner().invoke(
        load_commands(),
        [
            "eval",
            "-c",
            str(cfg),
            "-o",
            f"{tmp_path}/eval.json",
            "-S",
            "eval.hint_uplift=true",
            "-S",
            "eval.num_problems=8",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "eval.json").read_text())
    assert {"gsm8k/hint_fix_rate", "gsm8k/hint_coverage", "gsm8k/hint_failures", "gsm8k/hint_fixed"} <= set(m)
    assert m["gsm8k/hint_coverage"] == 1.0 or m["gsm8k/hint_failures"] == 0  # the answer template hints every failure


def test_study_eval_stage_forwards_hint_uplift(make_cfg, tiny_yaml, tmp_path):
    import yaml

    from composer_plugins.envs.gsm8k import GSM8KEnv
    from composer_plugins.pipeline import stages
    from composer_plugins.training.step.policy import resolve_policy

    cfg, _ = make_cfg()
    model = resolve_policy(cfg)  # the tiny SFT warm start (session cache)
    data = tmp_path / "tasks"
    (data / "gsm8k").mkdir(parents=True)
    tasks = GSM8KEnv(difficulty="trivial").sample_tasks(6, "test", seed=4)
    (data / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    params = {
        "train": yaml.safe_load(tiny_yaml),
        "eval": {
            "max_new_tokens": 12,
            "hint_uplift": True,
            "hint_uplift_samples": 2,
            "envs": {"gsm8k": {"num_problems": 6, "k": 1, "num_samples": 1}},
        },
        "mlflow": {"enabled": False},
    }
    res = stages.evaluate(params, None, 0, model, tmp_path / "sft.json", data_dir=str(data))
    m = json.loads((tmp_path / "sft.json").read_text())["metrics"]
    assert m == res["metrics"]
    assert {"gsm8k/hint_fix_rate", "gsm8k/hint_coverage", "gsm8k/hint_failures", "gsm8k/hint_fixed"} <= set(m)
    assert m["gsm8k/hint_failures"] == round(6 * (1 - m["gsm8k/accuracy"]))
    del params["eval"]["hint_uplift"]
    res = stages.evaluate(params, None, 0, model, tmp_path / "off.json", data_dir=str(data))
    assert not any("hint" in k for k in res["metrics"])


def test_multi_turn_episodes_give_demonstrations_from_their_group(make_cfg):
    import torch

    from composer_plugins.training.lightning.module import ComposerModule
    from composer_plugins.training.step.components import build_env

    demo = "hints.provider={name: demonstration, fallback: none}"
    cfg, src = make_cfg(
        "", "env.max_turns=2", "rollout.max_turns=2", "rollout.num_generations=4", "rollout.prompts_per_step=2", demo
    )
    env = build_env(cfg, src)
    m = ComposerModule(cfg, env=env, src=src)
    rb = m.make_rollout_batch(env.sample_tasks(2, "train", seed=4), seed=9)
    comps, rewards = rb.completions, rb.rewards.tolist()
    for row, ctx in zip(rb.hint_rows, rb.hinted_contexts, strict=True):
        g0 = row - row % 4
        first = next(j for j in range(g0, g0 + 4) if j != row and rewards[j] >= 0.5)
        assert "Correct solution:\n" + comps[first].strip() in ctx  # the episode's actions, from its own group
    loss, _ = m.loss_on(rb, seed=9)
    assert torch.isfinite(loss)
