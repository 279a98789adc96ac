"""Rollout generators: the hook, the in-process ``hf`` generator and the ``server`` generator.

The server tests run against ``composer_plugins.testing.loopback_server`` (a real HTTP server in
its own process: ``/v1/completions`` with token ids and log-probs over HF ``generate`` on the tiny
policy, SGLang's ``/update_weights_from_disk``, the teachers' loopback fault injection).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from composer_plugins.core.cli import load_commands
from composer_plugins.core.hookspecs import hookimpl


class _CountingGenerator:
    """An in-process generator that delegates to HF generate and counts its calls."""

    calls = 0

    def __init__(self, **kw: Any) -> None:
        self.kw = kw

    def generate(self, policy: Any, tokenizer: Any, prompts: Any, num_generations: int, **kw: Any) -> Any:
        from composer_plugins.training.rollout.rollouts import HFGenerator

        type(self).calls += 1
        return HFGenerator().generate(policy, tokenizer, prompts, num_generations, **kw)


def test_hook_register_rollout_generators(fresh_pm, make_cfg):
    from composer_plugins.core import plugins
    from composer_plugins.training.lightning.module import ComposerModule
    from composer_plugins.training.rollout.multiturn import build_generator
    from composer_plugins.training.step.components import build_env
    from composer_plugins.training.step.policy import load_policy_for

    class P:
        __name__ = "ip_rollouts"

        @hookimpl
        def register_rollout_generators(self, register):
            register("counting", _CountingGenerator, description="Counts its calls.")

    fresh_pm.register(P(), name="ip_rollouts")
    plugins.use_plugin_manager(fresh_pm)
    try:
        reg = plugins.get_registry()
        assert reg.get("rollout_generators", "counting").plugin == "ip_rollouts"
        assert {"hf", "server", "counting"} <= set(reg.names("rollout_generators"))
        # listed with provenance beside the built-ins, which register through the same hook
        listed = json.loads(CliRunner().invoke(load_commands(), ["list", "generators", "--json"]).output)
        by = {d["name"]: d for d in listed}
        assert set(by) == {"counting", "hf", "multi_turn", "server"} and by["counting"]["plugin"] == "ip_rollouts"
        assert by["hf"]["distribution"] == "composer-plugins" and by["counting"]["description"] == "Counts its calls."
        hooks = json.loads(
            CliRunner().invoke(load_commands(), ["plugins", "--all", "--hook", "register_rollout_generators"]).output
        )
        assert {"composer_plugins.training.runs.plugin", "ip_rollouts"} <= {d["name"] for d in hooks}
        cfg, src = make_cfg("", "sft.enabled=false", "rollout.generator.name=counting", "rollout.generator.tag=x")
        gen = build_generator(cfg, src)
        assert isinstance(gen, _CountingGenerator) and gen.kw == {"tag": "x"}
        env = build_env(cfg, src)
        policy, tok = load_policy_for(cfg, env)
        module = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src)
        before = _CountingGenerator.calls
        ro, rewards, _ = module.rollout(env.sample_tasks(2, "train", seed=0), seed=1)
        assert _CountingGenerator.calls == before + 1
        assert ro.completion_ids.shape[0] == 2 * cfg.rollout.num_generations == len(rewards)
    finally:
        fresh_pm.unregister(name="ip_rollouts")
        plugins.reset()


def test_unknown_generator_is_located(make_cfg, tmp_path):
    from composer_plugins.core.errors import ComposerPluginsError, ConfigError
    from composer_plugins.training.config.train import load_train_config
    from composer_plugins.training.rollout.multiturn import build_generator

    # refused when the config is read (before any model), with the names there are and the closest one
    with pytest.raises(ConfigError) as e:
        make_cfg("", "rollout.generator=sever")
    msg = str(e.value)
    assert msg.startswith("command-line override 'rollout.generator=sever': rollout.generator: Unknown"), msg
    assert "Did you mean: 'server'?" in msg and "Available rollout_generators: hf, multi_turn, server." in msg
    p = tmp_path / "c.yaml"
    p.write_text("seed: 0\nrollout:\n  generator: {name: hff}\n")
    with pytest.raises(ConfigError, match=rf"{p}:3: rollout\.generator\.name: Unknown rollout_generator 'hff'"):
        load_train_config(p)
    # a spec changed after loading is refused, located, when it is built
    cfg, src = make_cfg("")
    cfg.rollout.generator = "sever"
    with pytest.raises(ComposerPluginsError, match="Did you mean: 'server'"):
        build_generator(cfg, src)
    with pytest.raises(ComposerPluginsError, match="rollout.generator: multi-turn"):
        make_cfg("", "rollout.generator=server", "rollout.max_turns=2")


def test_a_registered_object_without_generate_is_refused_at_rollout_generator(fresh_pm, make_cfg):
    from composer_plugins.core import plugins
    from composer_plugins.core.errors import ConfigError
    from composer_plugins.training.rollout.multiturn import build_generator

    class NoGenerate:
        """Registered as a generator, but has nothing to sample with."""

    class P:
        __name__ = "broken_generators"

        @hookimpl
        def register_rollout_generators(self, register):
            register("no_generate", NoGenerate, description="No generate method.")

    fresh_pm.register(P(), name="broken_generators")
    plugins.use_plugin_manager(fresh_pm)
    try:
        cfg, src = make_cfg("", "rollout.generator=no_generate")
        with pytest.raises(
            ConfigError,
            match=r"override 'rollout.generator=no_generate': rollout.generator: .*NoGenerate is not a rollout",
        ):
            build_generator(cfg, src)
    finally:
        fresh_pm.unregister(name="broken_generators")
        plugins.reset()


# -- the server generator against the loopback server ------------------------------------------


@pytest.fixture
def tiny_policy(make_cfg):
    """``(path, policy, tokenizer, prompts)``: the tiny SFT-started policy and a few train prompts."""
    from composer_plugins.models.tiny import load_policy
    from composer_plugins.training.rollout.rewards import task_prompt
    from composer_plugins.training.step.components import build_env
    from composer_plugins.training.step.policy import resolve_policy

    cfg, src = make_cfg("")
    env = build_env(cfg, src)
    path = resolve_policy(cfg, env)
    policy, tok = load_policy(path)
    prompts = [task_prompt(t) for t in env.sample_tasks(3, "train", seed=11)]
    return path, policy.eval(), tok, prompts


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 10, "max_prompt_length": 192}


def _in_process(policy, tok, prompts, G, seed):
    """Per prompt: HF generate with the seed the server generator sends for it, as token-id lists."""
    from composer_plugins.models.generation import generate_completions, tokenize_prompts
    from composer_plugins.training.rollout.rollouts import prompt_seed

    ids, mask = tokenize_prompts(tok, prompts, SAMPLING["max_prompt_length"])
    out = []
    for i in range(len(prompts)):
        ro = generate_completions(
            policy,
            tok,
            None,
            G,
            seed=prompt_seed(seed, i),
            prompt_token_ids=[ids[i][mask[i].bool()].tolist()],
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=SAMPLING["max_new_tokens"],
        )
        out += [ro.completion_ids[j][ro.completion_mask[j].bool()].tolist() for j in range(G)]
    return out


def _rows(ro):
    return [ro.completion_ids[j][ro.completion_mask[j].bool()].tolist() for j in range(ro.completion_ids.shape[0])]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_same_seed_same_tokens_and_weight_reload_changes_samples(tiny_policy, tmp_path):
    import torch

    from composer_plugins.models.logprobs import completion_logprobs_no_grad
    from composer_plugins.testing.loopback_server import RolloutServerProcess
    from composer_plugins.training.rollout.rollouts import ServerGenerator

    path, policy, tok, prompts = tiny_policy
    G = 4
    with RolloutServerProcess(model=path) as srv:
        gen = ServerGenerator(srv.base_url, max_concurrency=3, weights_dir=str(tmp_path / "w"))
        ro = gen.generate(policy, tok, prompts, G, seed=5, **SAMPLING)
        assert ro.completion_ids.shape[0] == len(prompts) * G
        assert _rows(ro) == _in_process(policy, tok, prompts, G, 5)
        assert ro.completions == tok.batch_decode(ro.completion_ids, skip_special_tokens=True)
        # the server's log-probs are the policy's at the sampling temperature
        mine = completion_logprobs_no_grad(
            policy, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, temperature=1.0
        )
        m = ro.completion_mask.bool()
        torch.testing.assert_close(ro.extra["sampling_logprobs"][m], mine[m], atol=1e-5, rtol=0)

        # weight sync: another policy saved and loaded by the server changes what it samples
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        assert gen.wants_sync(0)
        gen.sync(policy, tok, step=3)
        assert gen.last_synced == 3 and not gen.wants_sync(3) and gen.wants_sync(4)
        stats = srv.stats()
        assert stats["reloads"] == 1 and stats["model_path"].endswith("step-3")
        after = gen.generate(policy, tok, prompts, G, seed=5, **SAMPLING)
        assert _rows(after) != _rows(ro)
        assert _rows(after) == _in_process(policy, tok, prompts, G, 5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_faults_lose_no_request(tiny_policy):
    from composer_plugins.testing.loopback_server import RolloutServerProcess
    from composer_plugins.training.rollout.rollouts import RolloutServerError, ServerGenerator

    path, policy, tok, prompts = tiny_policy
    plan = ["429", "500", "timeout", "503", "malformed", "drop"]
    with RolloutServerProcess(model=path) as srv:
        clean = ServerGenerator(srv.base_url).generate(policy, tok, prompts, 4, seed=9, **SAMPLING)
        srv.configure(fault_rate=1.0, plan=plan, hang_s=2.0, retry_after="0")
        srv.reset()
        gen = ServerGenerator(srv.base_url, timeout_s=0.75, backoff_base_s=0.01, backoff_max_s=0.05)
        faulty = gen.generate(policy, tok, prompts, 4, seed=9, **SAMPLING)
        assert _rows(faulty) == _rows(clean)
        torch_equal = (faulty.extra["sampling_logprobs"] == clean.extra["sampling_logprobs"]).all()
        assert bool(torch_equal)
        by = srv.stats()["by_status"]
        for kind in plan:
            assert by.get(kind, 0) == len(prompts), (kind, by)
        assert by["200"] == len(prompts) and gen.retries == len(plan) * len(prompts)
        # a server that keeps failing is an error naming it, not a silently shorter batch
        srv.configure(plan=["500"] * 10)
        srv.reset()
        with pytest.raises(RolloutServerError, match="HTTP 500"):
            ServerGenerator(srv.base_url, max_retries=2, backoff_base_s=0.01).generate(
                policy, tok, prompts, 4, seed=9, **SAMPLING
            )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_training_from_the_server_syncs_weights_and_corrects_the_lag(make_cfg, tiny_policy, tmp_path):
    from composer_plugins.testing.loopback_server import RolloutServerProcess
    from composer_plugins.training.runs.run import run_train

    path = tiny_policy[0]
    with RolloutServerProcess(model=path) as srv:
        cfg, src = make_cfg(
            "",
            "rollout.generator.name=server",
            f"rollout.generator.base_url={srv.base_url}",
            "rollout.generator.sync_every=1",
            "trainer.max_steps=3",
            "losses.hint_distill.enabled=false",
        )
        res = run_train(cfg, src)
        stats = srv.stats()
    assert stats["reloads"] == 3  # before step 0 (sync_at_start) and after each of the two later steps
    assert stats["model_path"].endswith("step-2")
    assert len(res.history) == 3
    for row in res.history:
        ratio = next(v for k, v in row.items() if k.endswith("is_ratio"))
        # the server serves the weights of the policy at rollout time: the ratio is ~1 (not clipped away)
        assert ratio == pytest.approx(1.0, abs=1e-3)


def test_importance_sampling_correction_modes():
    import torch

    from composer_plugins.losses.functional import importance_sampling_correction

    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    sp = torch.tensor([[-2.5, -2.0, float("nan")], [-0.5, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    tok = importance_sampling_correction(lp, sp, mask, "token_truncate", clip_max=3.0)
    assert torch.allclose(tok, torch.tensor([[3.0, 1.0, 1.0], [1.0, float(torch.exp(torch.tensor(-1.5))), 1.0]]))
    masked = importance_sampling_correction(lp, sp, mask, "token_mask", clip_max=3.0, clip_min=0.5)
    assert masked[0, 0] == 0 and masked[1, 1] == 0 and masked[0, 1] == 1
    seq = importance_sampling_correction(lp, sp, mask, "sequence_truncate", clip_max=3.0)
    assert seq.shape == (2, 1) and float(seq[0, 0]) == 3.0
    with pytest.raises(ValueError, match="token_truncate"):
        importance_sampling_correction(lp, sp, mask, "tokens")
