"""The small helpers several packages share instead of keeping copies: lazy exports, ``key=value`` options,
a built-in table's register hook and the located config's key walk."""

from __future__ import annotations

import sys
import types

import click
import pytest

from composer_plugins.core import lazy_exports
from composer_plugins.core.cli import key_values
from composer_plugins.core.config import Config
from composer_plugins.core.registry import builtin_hook


def test_lazy_exports_imports_on_first_use_keeps_the_value_and_refuses_unknown_names(monkeypatch):
    pkg = types.ModuleType("cp_lazy_pkg")
    sub = types.ModuleType("cp_lazy_pkg.sub")
    sub.thing = object()
    monkeypatch.setitem(sys.modules, "cp_lazy_pkg", pkg)
    monkeypatch.setitem(sys.modules, "cp_lazy_pkg.sub", sub)
    pkg.__getattr__ = lazy_exports("cp_lazy_pkg", {"sub": ("thing",)})
    assert pkg.thing is sub.thing and vars(pkg)["thing"] is sub.thing  # kept on the package
    with pytest.raises(AttributeError, match="'cp_lazy_pkg' has no attribute 'other'"):
        pkg.__getattr__("other")


def test_envs_and_teachers_export_lazily():
    import composer_plugins.envs as envs
    import composer_plugins.teachers as teachers
    from composer_plugins.envs.hints.contract import SiblingGroup
    from composer_plugins.teachers.runner import run_replay

    assert envs.SiblingGroup is SiblingGroup and teachers.run_replay is run_replay
    assert "GSM8KEnv" in envs.__all__ and "ReplayEngine" in teachers.__all__


def test_key_values_reads_yaml_values_and_names_the_option():
    assert key_values(("a=1", "b = x", "c=", "d=[1, 2]"), "--set") == {"a": 1, "b": "x", "c": "", "d": [1, 2]}
    with pytest.raises(click.BadParameter, match="'oops' must look like key=value") as e:
        key_values(("oops",), "--env-arg")
    assert e.value.param_hint == "--env-arg"


def test_builtin_hook_registers_each_row_lazily():
    calls = []
    hook = builtin_hook("pkg.mod", {"a": ("A", "first"), "b": ("B", "second", {"x": 1})})
    hook(lambda name, target, **kw: calls.append((name, target, kw)))
    assert calls[0] == ("a", "pkg.mod:A", {"description": "first"})
    assert calls[1] == ("b", "pkg.mod:B", {"description": "second", "x": 1})
    assert hasattr(hook, "composer_plugins_impl")  # a pluggy hook implementation


def test_config_names_the_closest_source_of_a_key():
    cfg = Config({}, source="c.yaml", lines={"a": 1, "a.b": 2})
    cfg.overrides = {"a": "a={}", "x": "x=1"}
    assert cfg.line_of("a.b.c") == 2 and cfg.line_of("x.y") is None
    assert cfg.override_of("x.y") == "x=1"  # set by an override only
    assert cfg.override_of("a.b.c") is None  # the file gives a.b more precisely than the override of a
    assert cfg.override_of("a") == "a={}"


def test_json_bytes_is_compact_utf8_and_the_json_fallback_writes_the_same_bytes(monkeypatch):
    import importlib.util

    import composer_plugins.teachers.base as base

    obj = {"a": [1, 2.5, None, True], "é": "ü\n", "n": {"x": ""}}
    fast = base.json_bytes(obj)
    assert base.json_loads(fast) == obj and base.json_loads(fast.decode()) == obj
    monkeypatch.setitem(sys.modules, "orjson", None)  # import orjson now fails: a copy of the module takes json
    spec = importlib.util.spec_from_file_location("cp_teachers_base_without_orjson", base.__file__)
    plain = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, plain)  # its dataclasses look their module up there
    spec.loader.exec_module(plain)
    assert plain.json_bytes(obj) == fast == '{"a":[1,2.5,null,true],"é":"ü\\n","n":{"x":""}}'.encode()
    assert plain.json_loads(fast) == obj and plain.json_bytes is not base.json_bytes


def test_replay_stats_count_adds_to_the_run_and_the_teacher():
    from composer_plugins.teachers.base import CallCounts
    from composer_plugins.teachers.engine import ReplayStats, TeacherStats
    from composer_plugins.teachers.scoring import ScorerStats

    stats = ReplayStats(by_teacher={"a": TeacherStats(), "b": TeacherStats()})
    stats.count("a", "calls")
    stats.count("a", "failures", 3)
    assert (stats.calls, stats.failures, stats.by_teacher["a"].failures, stats.by_teacher["b"].calls) == (1, 3, 3, 0)
    assert issubclass(ScorerStats, CallCounts) and issubclass(ReplayStats, TeacherStats)
    assert {"calls", "cache_hits", "failures", "spent_usd", "total_spent_usd"} <= set(stats.to_dict())
