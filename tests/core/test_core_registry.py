"""Registry behaviour: provenance, duplicates, unknown names, lazy factories, optional deps."""

from __future__ import annotations

import pytest

from composer_plugins.core.errors import DuplicatePluginError, MissingDependencyError, UnknownPluginError
from composer_plugins.core.registry import KINDS, Registry, normalize_kind


class Widget:
    """A widget for tests."""

    def __init__(self, size: int = 1, color: str = "red") -> None:
        self.size, self.color = size, color


def test_entry_holds_name_kind_factory_description_and_provenance():
    reg = Registry()
    e = reg.register("losses", "Widget", Widget, plugin="p", distribution="dist-x", version="1.2")
    assert (e.name, e.kind, e.description, e.provider) == ("widget", "losses", "A widget for tests.", "dist-x 1.2")
    assert e.factory is Widget
    assert reg.get("losses", "WIDGET") is e


def test_preset_init_params_are_overridable():
    reg = Registry()
    reg.register("losses", "big_widget", Widget, size=10)
    w = reg.build("losses", "big_widget", color="blue")
    assert (w.size, w.color) == (10, "blue")
    obj = Widget()
    assert reg.build("losses", obj) is obj  # an object passes through unchanged


def test_duplicate_name_raises_with_hint_and_override_replaces():
    reg = Registry()
    reg.register("envs", "w", Widget, plugin="first", distribution="a", version="1")
    with pytest.raises(DuplicatePluginError) as ei:
        reg.register("envs", "w", Widget, plugin="second")
    msg = str(ei.value)
    assert "'first'" in msg and "'second'" in msg and "override=True" in msg
    reg.register("envs", "w", dict, plugin="second", override=True)
    assert reg.get("envs", "w").plugin == "second"


def test_alias_clash_and_lookup():
    reg = Registry()
    reg.register("losses", "grpo_like", Widget, aliases=["gl"])
    assert reg.get("losses", "GL").name == "grpo_like"
    with pytest.raises(DuplicatePluginError):
        reg.register("losses", "gl", Widget)


def test_unknown_name_echoes_lists_and_suggests():
    reg = Registry()
    for n in ("grpo", "dapo", "dr_grpo", "gspo"):
        reg.register("losses", n, Widget)
    with pytest.raises(UnknownPluginError) as ei:
        reg.get("losses", "grpoo")
    msg = str(ei.value)
    assert "'grpoo'" in msg
    assert "Available loss channels: dapo, dr_grpo, grpo, gspo." in msg
    assert "Did you mean: 'grpo'" in msg
    assert ei.value.suggestions[0] == "grpo"


def test_unknown_known_backend_gives_pip_command():
    reg = Registry()
    reg.register("backends", "lightning", Widget)
    with pytest.raises(UnknownPluginError) as ei:
        reg.get("backends", "verl")
    assert "pip install ./packages/composer-plugins-verl" in str(ei.value)
    assert "lightning" in str(ei.value)


def test_known_backends_not_registered_are_listed_with_their_pip_command():
    from composer_plugins.core.errors import MissingDependencyError
    from composer_plugins.core.registry import KNOWN_BACKENDS

    reg = Registry()
    reg.register("backends", "lightning", Widget)
    reg.register("backends", "trl", Widget, requires=["json"])  # as if composer-plugins-trl were loaded
    missing = {e.name: e for e in reg.not_installed("backends")}
    assert set(missing) == set(KNOWN_BACKENDS) - {"trl"}
    v = missing["verl"]
    assert not v.available and v.install == KNOWN_BACKENDS["verl"] and v.distribution == "composer-plugins-verl"
    with pytest.raises(MissingDependencyError, match="pip install ./packages/composer-plugins-verl"):
        v.build()
    assert [e.name for e in reg.not_installed("backends", "ver")] == ["verl"]
    assert reg.not_installed("losses") == [] and "verl" not in reg.names("backends")


def test_lazy_factory_string_is_imported_on_build_only():
    reg = Registry()
    e = reg.register("teachers", "od", "collections:OrderedDict", "An ordered dict.")
    assert e.description == "An ordered dict."
    assert reg.build("teachers", "od", a=1) == {"a": 1}
    bad = reg.register("teachers", "bad", "no_such_module_xyz:Thing", "Broken target.")
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        bad.build()


def test_missing_optional_dependency_gives_install_command():
    reg = Registry()
    e = reg.register(
        "backends",
        "fancy",
        Widget,
        requires=["definitely_not_installed_pkg"],
        install="pip install composer-plugins-fancy",
    )
    assert not e.available and e.missing == ["definitely_not_installed_pkg"]
    with pytest.raises(MissingDependencyError, match="pip install composer-plugins-fancy"):
        e.build()


def test_kind_names_normalise_and_unknown_kind_lists_kinds():
    assert normalize_kind("Loss") == "losses" and normalize_kind("env") == "envs"
    with pytest.raises(UnknownPluginError, match="Available kinds: " + ", ".join(sorted(KINDS)) + r"\."):
        normalize_kind("widgets")


def test_entries_filter_by_pattern_natural_sort_and_exclude():
    reg = Registry()
    for n in ("m10", "m2", "m1", "other"):
        reg.register("envs", n, Widget)
    assert [e.name for e in reg.entries("envs", "m*")] == ["m1", "m2", "m10"]
    assert [e.name for e in reg.entries("envs", "!m*")] == ["other"]
    assert [e.name for e in reg.entries("envs", "th")] == ["other"]


def test_the_kinds_are_read_from_the_hookspecs():
    """Every ``register_*(register)`` hookspec fills one kind, in the hookspecs' order; ``KINDS`` repeats nothing."""
    import inspect

    from composer_plugins.core import hookspecs
    from composer_plugins.core.registry import KINDS

    specs = [
        n
        for n, f in vars(hookspecs).items()
        if n.startswith("register_") and "register" in inspect.signature(f).parameters
    ]
    assert list(KINDS.values()) == specs
    assert all(getattr(hookspecs, h).registry_kind == k for k, h in KINDS.items())
