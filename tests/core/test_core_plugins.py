"""Plugin discovery through real entry points, isolation of broken plugins, filtering, typo rejection."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from composer_plugins import __version__, hookimpl
from composer_plugins.core import plugins
from composer_plugins.core.errors import PluginLoadError, UnknownPluginError
from composer_plugins.core.plugins import PluginLoadWarning, build_registry, make_plugin_manager


def make_dist(root: Path, dist: str, version: str, eps: dict[str, str], modules: dict[str, str]) -> None:
    """Write an installed-looking distribution (dist-info with entry points) plus its modules under ``root``."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[composer_plugins]"] + [f"{k} = {v}" for k, v in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for mod, src in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(src))


GOOD = """
from composer_plugins import hookimpl

class Thing:
    '''A thing from the good plugin.'''
    def __init__(self, n=1):
        self.n = n

@hookimpl
def register_envs(register):
    register("good_env", Thing)
"""

BROKEN = """
raise RuntimeError("boom at import")
"""

TYPO = """
from composer_plugins import hookimpl

@hookimpl
def register_loss_channel(register):
    register("never", dict)
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Three real distributions on sys.path: good, broken at import, and one with a misspelled hook."""
    make_dist(tmp_path, "cp-good", "1.0", {"good": "cp_good_mod"}, {"cp_good_mod": GOOD})
    make_dist(tmp_path, "cp-broken", "0.3", {"broken": "cp_broken_mod"}, {"cp_broken_mod": BROKEN})
    make_dist(tmp_path, "cp-typo", "2.0", {"typo": "cp_typo_mod"}, {"cp_typo_mod": TYPO})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.LOAD_ENV, raising=False)
    monkeypatch.delenv(plugins.STRICT_ENV, raising=False)
    for m in ("cp_good_mod", "cp_broken_mod", "cp_typo_mod"):
        sys.modules.pop(m, None)
    return tmp_path


def test_discovers_the_installed_example_package_through_its_entry_point(monkeypatch):
    monkeypatch.setenv(plugins.LOAD_ENV, "focal")
    pm = make_plugin_manager()
    info = {i.name: i for i in pm.plugin_infos()}
    assert info["focal"].distribution == "composer-plugins-focal"
    assert info["focal"].hooks == ["register_loss_channels"]
    reg = build_registry(pm)
    entry = reg.get("losses", "focal_pg")
    assert entry.distribution == "composer-plugins-focal" and entry.plugin == "focal"
    channel = reg.build("losses", "focal_pg", weight=0.5, gamma=1.0)
    assert type(channel).__name__ == "FocalPolicyGradient" and channel.weight == 0.5 and channel.gamma == 1.0


def test_broken_plugin_is_named_and_does_not_take_others_down(site):
    with pytest.warns(PluginLoadWarning) as rec:
        pm = make_plugin_manager()
    messages = " ".join(str(w.message) for w in rec)
    assert "'broken (from cp-broken 0.3)'" in messages and "boom at import" in messages
    assert "broken" in pm.failures and isinstance(pm.failures["broken"], PluginLoadError)
    reg = build_registry(pm)
    assert reg.get("envs", "good_env").provider == "cp-good 1.0"
    with pytest.raises(UnknownPluginError) as ei:
        reg.get("envs", "bad_env")
    assert "boom at import" in str(ei.value)  # the failure is shown where the user looks
    infos = {i.name: i for i in pm.plugin_infos()}
    assert "boom at import" in infos["broken"].error


def test_misspelled_hook_is_rejected_by_name_with_a_suggestion(site):
    with pytest.warns(PluginLoadWarning) as rec:
        pm = make_plugin_manager()
    msg = str(pm.failures["typo"])
    assert "unknown hook 'register_loss_channel'" in msg and "did you mean 'register_loss_channels'" in msg
    assert "cp-typo 2.0" in msg
    assert pm.get_plugin("typo") is None  # rejected, not silently ignored
    assert any("register_loss_channel" in str(w.message) for w in rec)
    pm.check_pending()  # what is left validates
    assert "never" not in build_registry(pm).names("losses")


def test_strict_mode_turns_failures_into_errors(site, monkeypatch):
    monkeypatch.setenv(plugins.STRICT_ENV, "1")
    with pytest.raises(PluginLoadError, match="boom at import|unknown hook"):
        make_plugin_manager()


def test_load_env_restricts_which_plugins_load(site, monkeypatch):
    monkeypatch.setenv(plugins.LOAD_ENV, "good")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # broken/typo plugins are not even imported
        pm = make_plugin_manager()
    names = {n for n, _ in pm.list_name_plugin()}
    assert "good" in names and "broken" not in names and "focal" not in names
    assert not pm.failures
    # by distribution name too
    monkeypatch.setenv(plugins.LOAD_ENV, "cp-good")
    assert make_plugin_manager().get_plugin("good") is not None
    # empty: no third-party plugins, built-ins still load
    monkeypatch.setenv(plugins.LOAD_ENV, "")
    pm = make_plugin_manager()
    assert {n for n, _ in pm.list_name_plugin()} == set(plugins.DEFAULT_PLUGINS)


def test_load_env_naming_an_absent_plugin_says_so(site, monkeypatch):
    monkeypatch.setenv(plugins.LOAD_ENV, "good,nope_plugin")
    with pytest.warns(PluginLoadWarning, match="nope_plugin"):
        pm = make_plugin_manager()
    assert pm.get_plugin("good") is not None


def test_plugins_load_lazily_once(isolated_plugins, monkeypatch):
    calls = []
    real = plugins.make_plugin_manager
    monkeypatch.setattr(plugins, "make_plugin_manager", lambda **kw: calls.append(1) or real(entrypoints=False))
    assert plugins._pm is None
    r1 = plugins.get_registry()
    r2 = plugins.get_registry()
    assert r1 is r2 and len(calls) == 1


def test_importing_the_package_loads_no_plugins_and_no_torch():
    code = (
        "import sys, composer_plugins; from composer_plugins.core import plugins; "
        "print(json.dumps(['torch' in sys.modules, plugins._pm is None]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json;" + code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout) == [False, True]


# -- one test per hook: an in-process plugin on a fresh manager, unregistered after ----------------


class MaskedTokenPG:
    """Built lazily: a token-mean policy gradient over the completion mask (a real LossChannel)."""

    def __new__(cls, **kw):
        from composer_plugins.losses.base import LossChannel

        class _MaskedTokenPG(LossChannel):
            requires = ("logprobs", "advantages", "completion_mask")

            def forward(self, inputs):
                lp = inputs["logprobs"]
                m = inputs["completion_mask"].to(lp.dtype)
                loss = -(lp * inputs["advantages"].unsqueeze(-1) * m).sum() / m.sum()
                return loss, {"tokens": m.sum()}

        return _MaskedTokenPG(**kw)


def echo_teacher(**kw):
    """A teacher that answers with the last user message, priced per token (a real Teacher)."""
    from composer_plugins.teachers.base import Teacher, estimate_prompt_tokens

    class Echo(Teacher):
        kind = "echo"

        async def complete(self, messages, *, metadata=None):
            if not messages:
                from composer_plugins.teachers.base import TeacherCallError

                raise TeacherCallError("echo: nothing to echo", retryable=False)
            text = str(messages[-1].get("content", ""))[: self.max_tokens]
            p, c = estimate_prompt_tokens(messages), min(len(text.split()), self.max_tokens)
            return self.response(text, p, c)

    return Echo(model="echo", max_tokens=16, prompt_usd_per_token=1e-6, completion_usd_per_token=2e-6, **kw)


class InProcessBackend:
    """A backend that needs only the stdlib's json."""

    def __init__(self, config=None):
        self.config = config

    def train(self):
        return {"ok": True}


class InProcess:
    """A test plugin implementing every register hook, each with a component that works."""

    __name__ = "inprocess"

    @hookimpl
    def register_loss_channels(self, register):
        register("ip_loss", MaskedTokenPG, "In-process loss.")

    @hookimpl
    def register_teachers(self, register):
        register("ip_teacher", echo_teacher, "In-process echo teacher.")

    @hookimpl
    def register_envs(self, register):
        register("ip_env", "composer_plugins.envs.gsm8k:GSM8KEnv", "In-process env.", difficulty=0)

    @hookimpl
    def register_hint_providers(self, register):
        register("ip_hint", "composer_plugins.envs.hints:TemplateHintProvider", "In-process hint provider.")

    @hookimpl
    def register_backends(self, register):
        register("ip_backend", InProcessBackend, "In-process backend.", requires=["json"], install="pip install json")

    @hookimpl
    def register_commands(self, cli):
        import click

        @cli.command(name="ip-hello")
        def hello():
            """Say hello."""
            click.echo("hello from plugin")


@pytest.fixture
def with_inprocess(fresh_pm):
    fresh_pm.register(InProcess(), name="inprocess")
    try:
        yield fresh_pm
    finally:
        fresh_pm.unregister(name="inprocess")


def _check_register_hook(with_inprocess, kind, name):
    """What the hook registered is found with its provenance and keeps its kind's contract."""
    from composer_plugins.testing import check

    reg = build_registry(with_inprocess)
    e = reg.get(kind, name)
    assert e.plugin == "inprocess" and e.available and e.description.startswith("In-process")
    check(kind, name, reg)  # the conformance checks of composer_plugins.testing for that kind


def test_hook_register_loss_channels(with_inprocess):
    _check_register_hook(with_inprocess, "losses", "ip_loss")


def test_hook_register_teachers(with_inprocess):
    _check_register_hook(with_inprocess, "teachers", "ip_teacher")


def test_hook_register_envs(with_inprocess):
    _check_register_hook(with_inprocess, "envs", "ip_env")


def test_hook_register_hint_providers(with_inprocess):
    _check_register_hook(with_inprocess, "hints", "ip_hint")


def test_hook_register_backends(with_inprocess):
    _check_register_hook(with_inprocess, "backends", "ip_backend")


def test_hook_register_commands(with_inprocess):
    import click
    from click.testing import CliRunner

    group = click.Group()
    with_inprocess.hook.register_commands(cli=group)
    result = CliRunner().invoke(group, ["ip-hello"])
    assert result.exit_code == 0 and "hello from plugin" in result.output


def test_unregistered_plugin_leaves_nothing_behind(fresh_pm):
    fresh_pm.register(InProcess(), name="inprocess")
    fresh_pm.unregister(name="inprocess")
    assert "ip_loss" not in build_registry(fresh_pm).names("losses")


def test_register_hook_that_raises_is_isolated(fresh_pm):
    class Exploding:
        __name__ = "exploding"

        @hookimpl
        def register_envs(self, register):
            raise RuntimeError("kaput")

    fresh_pm.register(Exploding(), name="exploding")
    fresh_pm.register(InProcess(), name="inprocess")
    with pytest.warns(PluginLoadWarning, match="exploding.*kaput"):
        reg = build_registry(fresh_pm)
    assert "ip_env" in reg.names("envs")


def test_builtins_register_through_the_public_hooks(fresh_pm):
    infos = {i.name: i for i in fresh_pm.plugin_infos(include_defaults=True)}
    for mod in plugins.DEFAULT_PLUGINS:
        assert infos[mod].distribution == "composer-plugins" and infos[mod].default
    for e in build_registry(fresh_pm):
        assert e.plugin in plugins.DEFAULT_PLUGINS and e.distribution == "composer-plugins"


# -- robust loading: a bad third-party plugin costs only the names it touches -----------------------

CLASH = """
from composer_plugins import hookimpl

class Grpo2:
    '''A second grpo.'''

class Fine:
    '''A name nobody else has.'''

@hookimpl
def register_loss_channels(register):
    register("grpo", Grpo2)          # clashes with the built-in
    register("clash_fine", Fine)     # still registers
"""

SPOOF = """
from composer_plugins import hookimpl

class Thing:
    '''Claims to be someone else.'''

@hookimpl
def register_envs(register):
    register("spoofed_env", Thing, distribution="composer-plugins", version="9.9")
    register("honest_env", Thing)
"""

RAISES = """
from composer_plugins import hookimpl

@hookimpl
def register_teachers(register):
    raise RuntimeError("teacher hook kaput")
"""


@pytest.fixture
def bad_site(tmp_path, monkeypatch):
    """Real distributions on sys.path: one clashing with a built-in name, one spoofing provenance, one raising."""
    make_dist(tmp_path, "cp-clash", "1.5", {"clash": "cp_clash_mod"}, {"cp_clash_mod": CLASH})
    make_dist(tmp_path, "cp-spoof", "0.2", {"spoof": "cp_spoof_mod"}, {"cp_spoof_mod": SPOOF})
    make_dist(tmp_path, "cp-raises", "3.1", {"raises": "cp_raises_mod"}, {"cp_raises_mod": RAISES})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(plugins.LOAD_ENV, "clash,spoof,raises")
    monkeypatch.delenv(plugins.STRICT_ENV, raising=False)
    for m in ("cp_clash_mod", "cp_spoof_mod", "cp_raises_mod"):
        sys.modules.pop(m, None)
    return tmp_path


def test_a_name_clash_breaks_only_that_name_and_names_both_providers(bad_site):
    from composer_plugins.core.errors import PluginConflictError

    pm = make_plugin_manager()
    with pytest.warns(PluginLoadWarning) as rec:
        reg = build_registry(pm)
    clash_msgs = [str(w.message) for w in rec if "'grpo'" in str(w.message)]
    assert len(clash_msgs) == 1 and "clash (from cp-clash 1.5)" in clash_msgs[0]
    assert "composer-plugins" in clash_msgs[0]  # the built-in provider is named too
    with pytest.raises(PluginConflictError) as ei:
        reg.get("losses", "grpo")
    assert "cp-clash 1.5" in str(ei.value) and f"composer-plugins {__version__}" in str(ei.value)
    assert "COMPOSER_PLUGINS_LOAD" in str(ei.value)
    assert reg.get("losses", "clash_fine").provider == "cp-clash 1.5"  # the plugin's other names work
    assert reg.get("losses", "dapo").distribution == "composer-plugins"  # and so do the other built-ins
    info = {i.name: i for i in pm.plugin_infos()}
    assert any("'grpo'" in p for p in info["clash"].problems)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once: building again warns no more
        build_registry(pm)


def test_provenance_comes_from_the_entry_point_not_from_register(bad_site):
    pm = make_plugin_manager()
    with pytest.warns(PluginLoadWarning, match=r"spoof \(from cp-spoof 0.2\).*provenance comes from the entry point"):
        reg = build_registry(pm)
    assert "spoofed_env" not in reg.names("envs")
    assert reg.get("envs", "honest_env").provider == "cp-spoof 0.2"
    assert all(e.distribution == "composer-plugins" for e in reg if e.plugin in plugins.DEFAULT_PLUGINS)


def test_a_raising_hook_is_reported_with_its_distribution_in_the_cli(bad_site, isolated_plugins):
    from click.testing import CliRunner

    from composer_plugins.core.cli import load_commands

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r = CliRunner().invoke(load_commands(), ["plugins"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    data = {d["name"]: d for d in json.loads(r.output[r.output.index("[") :])}
    assert data["raises"]["distribution"] == "cp-raises" and data["raises"]["version"] == "3.1"
    assert "teacher hook kaput" in data["raises"]["error"] and "cp-raises 3.1" in data["raises"]["error"]
    assert any("'grpo'" in p for p in data["clash"]["problems"])
    assert len([w for w in rec if "teacher hook kaput" in str(w.message)]) == 1
    # commands that do not need the broken names still work
    r = CliRunner().invoke(load_commands(), ["list", "envs", "honest*", "--json"], catch_exceptions=False)
    assert r.exit_code == 0 and json.loads(r.output[r.output.index("[") :])[0]["name"] == "honest_env"
