"""Rollout generators: the hook, the in-process ``hf`` generator and the ``server`` generator.

The server tests run against ``composer_plugins.training.loopback_server`` (a real HTTP server in
its own process: ``/v1/completions`` with token ids and log-probs over HF ``generate`` on the tiny
policy, SGLang's ``/update_weights_from_disk``, the teachers' loopback fault injection).
"""

from __future__ import annotations

from typing import Any

import pytest

from composer_plugins.core.hookspecs import hookimpl


class _CountingGenerator:
    """An in-process generator that delegates to HF generate and counts its calls."""

    calls = 0

    def __init__(self, **kw: Any) -> None:
        self.kw = kw

    def generate(self, policy: Any, tokenizer: Any, prompts: Any, num_generations: int, **kw: Any) -> Any:
        from composer_plugins.training.rollouts import HFGenerator

        type(self).calls += 1
        return HFGenerator().generate(policy, tokenizer, prompts, num_generations, **kw)


def test_hook_register_rollout_generators(fresh_pm, make_cfg):
    from composer_plugins.core import plugins
    from composer_plugins.training.module import ComposerModule
    from composer_plugins.training.train import build_env, build_generator, load_policy_for

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


def test_unknown_generator_is_located(make_cfg):
    from composer_plugins.core.errors import ComposerPluginsError
    from composer_plugins.training.train import build_generator

    cfg, src = make_cfg("", "rollout.generator=sever")
    with pytest.raises(ComposerPluginsError, match="server"):
        build_generator(cfg, src)
