"""Every registered entry of every kind passes the conformance checks of ``composer_plugins.testing``.

The registry is built with entry-point discovery on (built-ins and the installed third-party
plugins, e.g. the example ``composer-plugins-focal``), whatever ``COMPOSER_PLUGINS_LOAD`` says for the
rest of the suite: discovery is the subject here. Entries that need something to build get it from
:data:`BUILD` or from a fixture that starts it on loopback (an OpenEnv server, the teachers' loopback
server, a tiny local chat model).
"""

from __future__ import annotations

import os

import pytest

from composer_plugins.core import plugins
from composer_plugins.diloco.common import DiLoCoConfig
from composer_plugins.testing import ConformanceError, check, check_loss, conformance_test


def _discovered_registry():
    old = os.environ.pop(plugins.LOAD_ENV, None)
    try:
        return plugins.build_registry(plugins.make_plugin_manager())
    finally:
        if old is not None:
            os.environ[plugins.LOAD_ENV] = old


REGISTRY = _discovered_registry()
CASES = [f"{e.kind}:{e.name}" for e in REGISTRY.entries()]

_CLOUD = DiLoCoConfig(
    transport="object_store",
    store="file:///tmp/cp-conformance",
    jobs={"image": "python:3.12", "namespace": "conformance", "secrets": []},
)

#: build kwargs of entries that need some (the rest build with their defaults)
BUILD = {
    "envs:gsm8k": {"difficulty": 0},
    "envs:feature_deletion": {"max_tasks": 2, "progress": False},
    "hints:chain": {"providers": ["template", "raw_error"]},
    "hints:llm_teacher": {"teacher": "oracle"},
    # VeRL's actor carries one policy loss: the default config's hint channel is refused there at build time
    # (docs/backends.md, 'Which channel runs where'), so its conformance build turns it off
    "backends:verl": {"overrides": ["losses.hint_distill.enabled=false"]},
    # cloud executors: built from an object-store config (no network: the namespace is given); their replicas
    # run against the loopback Hub in tests/diloco/test_diloco_hf_jobs.py; Modal has no stand-in to run them on
    "executors:hf_jobs": {"config": _CLOUD, "run": False},
    "executors:modal": {"config": _CLOUD, "run": False},
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Loopback servers and files the entries that talk to something need."""
    from composer_plugins.envs.openenv_env import create_openenv_app, serve
    from composer_plugins.testing.teacher_data import build_tiny_chat_model
    from composer_plugins.testing.teacher_loopback import LoopbackProcess

    model = tmp_path_factory.mktemp("tiny_chat") / "model"
    build_tiny_chat_model(model)
    from composer_plugins.testing.loopback_server import RolloutServerProcess

    with (
        serve(create_openenv_app("gsm8k", difficulty=0)) as env_srv,
        LoopbackProcess() as llm,
        RolloutServerProcess(model=str(model)) as scoring,
    ):
        yield {
            "envs:openenv": {"base_url": env_srv.url},
            "teachers:openai": {
                "model": "m",
                "base_url": llm.base_url,
                "api_key_env": None,
                "prompt_usd_per_token": 1e-7,
                "completion_usd_per_token": 2e-7,
                "failing": {"base_url": "http://127.0.0.1:9/v1", "timeout_s": 5},
            },
            "teachers:hf": {"model_path": str(model), "max_new_tokens": 8},
            # the rollout server serving the tiny model, sampled with that same model
            "rollout_generators:server": {"base_url": scoring.base_url, "model_path": str(model)},
            # scoring teachers: the tiny model itself, and the loopback server serving it (vLLM / SGLang shapes)
            "scorers:causal_lm": {"model_path": str(model), "topk": 3, "tokenizer": str(model)},
            "scorers:vllm": {"model": "m", "base_url": scoring.base_url, "topk": 3, "tokenizer": str(model)},
            "scorers:sglang": {"model": "m", "base_url": scoring.base_url, "topk": 3, "tokenizer": str(model)},
        }


def test_the_registry_has_every_kind():
    kinds = {c.split(":")[0] for c in CASES}
    assert {"losses", "envs", "hints", "teachers", "backends", "optimizers", "callbacks"} <= kinds
    assert "losses:focal_pg" in CASES  # the installed example third-party plugin is checked too


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_registered_entry_conforms(case, servers):
    kind, name = case.split(":", 1)
    check(kind, name, REGISTRY, **{**BUILD.get(case, {}), **servers.get(case, {})})


# -- the checks catch what they claim to catch -------------------------------------------------


class _Unmasked:
    """A loss channel that forgets the completion mask (padding leaks into the loss)."""

    __name__ = "unmasked_plugin"

    from composer_plugins import hookimpl

    @hookimpl
    def register_loss_channels(self, register):
        from composer_plugins.losses.base import LossChannel

        class Unmasked(LossChannel):
            requires = ("logprobs", "advantages")

            def forward(self, inputs):
                lp = inputs["logprobs"]
                return -(lp * inputs["advantages"].unsqueeze(-1)).mean(), {}

        register("unmasked", Unmasked)


def test_a_channel_that_ignores_the_mask_fails_with_the_reason():
    from composer_plugins.testing import plugin_registry

    reg, _ = plugin_registry(_Unmasked())
    with pytest.raises(ConformanceError, match=r"losses 'unmasked' .*padding changes the loss"):
        check_loss("unmasked", reg)


def test_conformance_test_makes_one_case_per_entry_of_a_plugin():
    t = conformance_test(_Unmasked())
    marks = [m for m in getattr(t, "pytestmark", []) if m.name == "parametrize"]
    assert marks and list(marks[0].args[1]) == ["losses:unmasked"]
    with pytest.raises(ConformanceError):
        t("losses:unmasked")


@pytest.mark.slow
def test_the_example_plugin_passes_the_suite_by_calling_it():
    """examples/composer-plugins-focal runs ``conformance_test(composer_plugins_focal)`` in its own tests."""
    import sys
    from pathlib import Path

    from composer_plugins import procs

    example = Path(__file__).resolve().parents[2] / "examples" / "composer-plugins-focal"
    assert "conformance_test(composer_plugins_focal)" in (example / "tests" / "test_focal.py").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSER_PLUGINS_", "PYTEST_"))}
    proc = procs.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=example,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "1 passed" in proc.stdout
