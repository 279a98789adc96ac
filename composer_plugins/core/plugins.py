"""Plugin manager: default plugins, entry-point discovery, validation and the registry.

Nothing loads at import time: :func:`get_registry` and :func:`get_plugin_manager` load plugins once, on first
use. A plugin that fails to load is left out and named while the others load, and a name two plugins register
is unusable (:class:`PluginConflictError`); the rules and ``COMPOSER_PLUGINS_LOAD`` / ``COMPOSER_PLUGINS_STRICT``
are in docs/plugins.md ("Loading, filtering and failures").
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from composer_plugins.core import hookspecs
from composer_plugins.core.errors import DuplicatePluginError, PluginLoadError, closest
from composer_plugins.core.registry import KINDS, Registry
from composer_plugins.core.version import __version__, api_problem

#: ``register`` keywords that only the plugin manager sets (from the entry point), never the plugin.
PROVENANCE_KEYS = frozenset({"plugin", "distribution", "version"})

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
LOAD_ENV = "COMPOSER_PLUGINS_LOAD"
STRICT_ENV = "COMPOSER_PLUGINS_STRICT"

#: Built-in plugins, registered through the same hooks third parties implement: each top-level package's one
#: ``plugin.py`` (``training``'s is ``training/runs/plugin.py``), the only modules with ``@hookimpl`` functions.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "composer_plugins.catalog.plugin",
    "composer_plugins.losses.plugin",
    "composer_plugins.teachers.plugin",
    "composer_plugins.envs.plugin",
    "composer_plugins.backends.plugin",
    "composer_plugins.training.runs.plugin",
    "composer_plugins.pipeline.plugin",
    "composer_plugins.diloco.plugin",
)


class PluginLoadWarning(UserWarning):
    """A plugin was left out because it failed to load; the message names it."""


@dataclass
class PluginInfo:
    """What ``composer-plugins plugins`` reports for one plugin."""

    name: str
    distribution: str
    version: str
    hooks: list[str] = field(default_factory=list)
    default: bool = False
    error: str | None = None
    #: registrations of a loaded plugin that were refused (name clashes, provenance keywords)
    problems: list[str] = field(default_factory=list)
    #: ``{"<kind>/<name>": reason}``: registered components that fail their contract check
    contract_failures: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "distribution": self.distribution, "version": self.version}
        d["hooks"] = self.hooks
        if self.error:
            d["error"] = self.error
        if self.problems:
            d["problems"] = self.problems
        if not self.error:
            d["contract"] = "FAILED" if self.contract_failures else "ok"
        if self.contract_failures:
            d["contract_failures"] = self.contract_failures
        return d


class ComposerPluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers which distribution provided each plugin and which failed."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.provenance: dict[str, tuple[str, str]] = {}
        self.defaults: set[str] = set()
        self.failures: dict[str, PluginLoadError] = {}
        #: plugin -> refused registrations (the plugin itself loaded)
        self.problems: dict[str, list[str]] = {}
        self._reported: set[str] = set()

    # -- loading ------------------------------------------------------------------
    def load_defaults(self, modules: Iterable[str] = DEFAULT_PLUGINS) -> None:
        """Import and register the built-in plugin modules."""
        for modname in modules:
            mod = importlib.import_module(modname)
            if self.is_registered(mod):
                continue
            self.register(mod, name=modname)
            self.provenance[modname] = ("composer-plugins", __version__)
            self.defaults.add(modname)

    def load_entrypoints(self, group: str = ENTRY_POINT_GROUP, only: set[str] | None = None) -> None:
        """Import every entry point of ``group`` (restricted to ``only`` names when given).

        A failing plugin is recorded in :attr:`failures` and warned about; the rest still load.
        """
        seen: set[str] = set()
        for ep in md.entry_points(group=group):
            dist = ep.dist
            dname, dver = (dist.metadata["Name"], dist.version) if dist is not None else ("", "")
            if only is not None and ep.name not in only and dname not in only:
                continue
            seen.update({ep.name, dname})
            if self.get_plugin(ep.name) is not None or ep.name in self.failures:
                continue
            label = f"{ep.name} (from {dname} {dver})" if dname else ep.name
            self.provenance[ep.name] = (dname, dver)
            try:
                plugin = ep.load()
                self.register(plugin, name=ep.name)
            except Exception as e:
                self._fail(ep.name, PluginLoadError(label, f"{type(e).__name__}: {e}"), cause=e)
                continue
        if only:
            missing = sorted(only - seen)
            if missing:
                self._fail(
                    ",".join(missing),
                    PluginLoadError(
                        ", ".join(missing),
                        f"named in {LOAD_ENV} but no installed distribution provides an entry point "
                        f"in group {group!r} with that name",
                    ),
                )

    def validate(self) -> None:
        """Reject plugins that implement hooks with no spec (typos), then ``check_pending()``."""
        for hook_name in sorted(vars(self.hook)):
            caller = getattr(self.hook, hook_name)
            if not isinstance(caller, pluggy.HookCaller) or caller.has_spec():
                continue
            for impl in caller.get_hookimpls():
                if impl.opts.get("optionalhook"):
                    continue
                sugg = closest(hook_name, _spec_names())
                why = f"unknown hook {hook_name!r}" + (f"; did you mean {sugg[0]!r}?" if sugg else "")
                why += " Known hooks: " + ", ".join(_spec_names()) + "."
                self._fail(impl.plugin_name, PluginLoadError(self._label(impl.plugin_name), why))
                self.unregister(name=impl.plugin_name)
        self.check_pending()

    def _label(self, plugin_name: str) -> str:
        dist = self.provenance.get(plugin_name)
        return f"{plugin_name} (from {dist[0]} {dist[1]})" if dist and dist[0] else plugin_name

    def _fail(self, name: str, err: PluginLoadError, cause: BaseException | None = None) -> None:
        if _strict():
            raise err from cause  # the plugin's own traceback stays attached (the CLI prints both)
        self.failures[name] = err
        self._warn_once(str(err) + " The plugin was skipped; other plugins are unaffected.")

    def refuse(self, plugin_name: str, message: str) -> None:
        """Record and report (once) a registration of a loaded plugin that was refused."""
        if _strict():
            raise PluginLoadError(self._label(plugin_name), message)
        problems = self.problems.setdefault(plugin_name, [])
        if message not in problems:
            problems.append(message)
        self._warn_once(f"{self._label(plugin_name)}: {message}")

    def _warn_once(self, text: str) -> None:
        if text in self._reported:
            return
        self._reported.add(text)
        warnings.warn(text, PluginLoadWarning, stacklevel=4)

    # -- reporting ----------------------------------------------------------------
    def plugin_infos(self, include_defaults: bool = False) -> list[PluginInfo]:
        """Plugins, their distribution and the hooks each implements (failed ones included)."""
        hooks_by: dict[str, list[str]] = {}
        for hook_name in vars(self.hook):
            caller = getattr(self.hook, hook_name)
            if isinstance(caller, pluggy.HookCaller):
                for impl in caller.get_hookimpls():
                    hooks_by.setdefault(impl.plugin_name, []).append(hook_name)
        out = []
        for name, _plugin in self.list_name_plugin():
            if (name in self.defaults and not include_defaults) or name in self.failures:
                continue
            dname, dver = self.provenance.get(name, ("", ""))
            info = PluginInfo(name, dname, dver, sorted(hooks_by.get(name, [])), name in self.defaults)
            info.problems = list(self.problems.get(name, []))
            out.append(info)
        for name, err in self.failures.items():
            dname, dver = self.provenance.get(name, ("", ""))
            out.append(PluginInfo(name, dname, dver, [], error=str(err)))
        return sorted(out, key=lambda p: (not p.default, p.name))


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip() not in ("", "0")


def _spec_names() -> list[str]:
    return sorted(n for n in vars(hookspecs) if n.startswith("register_"))


def _load_filter() -> set[str] | None:
    raw = os.environ.get(LOAD_ENV)
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def make_plugin_manager(*, defaults: bool = True, entrypoints: bool = True) -> ComposerPluginManager:
    """A new, loaded and validated plugin manager (tests use ``entrypoints=False``)."""
    pm = ComposerPluginManager()
    if defaults:
        pm.load_defaults()
    if entrypoints:
        only = _load_filter()
        if only != set():
            pm.load_entrypoints(only=only)
    pm.validate()
    return pm


def build_registry(pm: pluggy.PluginManager) -> Registry:
    """Call every ``register_*`` hook of ``pm``, one plugin at a time, recording provenance.

    A hook that raises leaves its plugin out (reported with its distribution); a name registered
    twice becomes unusable and is reported against the plugin that registered it second; neither
    stops the other plugins or names.
    """
    registry = Registry()
    cpm = pm if isinstance(pm, ComposerPluginManager) else None
    provenance = getattr(pm, "provenance", {})
    failures = getattr(pm, "failures", {})
    for name, plugin in pm.list_name_plugin():  # the plugin API version a plugin declares it needs
        why = api_problem(getattr(plugin, "COMPOSER_PLUGINS_API", None))
        if why and name not in failures:
            dname, dver = provenance.get(name, ("", ""))
            err = PluginLoadError(f"{name} (from {dname} {dver})" if dname else name, why)
            if _strict():
                raise err
            failures[name] = err
            if cpm is not None:
                cpm._warn_once(str(err))
    for kind, hook_name in KINDS.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.plugin_name in failures:
                continue
            dname, dver = provenance.get(impl.plugin_name, ("", ""))
            register = _register_callback(registry, kind, impl.plugin_name, dname, dver, cpm)
            try:
                impl.function(register=register)
            except Exception as e:
                label = f"{impl.plugin_name} (from {dname} {dver})" if dname else impl.plugin_name
                err = PluginLoadError(label, f"{hook_name} raised {type(e).__name__}: {e}")
                if _strict():
                    raise err from e
                failures[impl.plugin_name] = err
                if cpm is not None:
                    cpm._warn_once(str(err))
                else:
                    warnings.warn(str(err), PluginLoadWarning, stacklevel=2)
    registry.broken = [str(e) for e in failures.values()]
    return registry


def _register_callback(
    registry: Registry, kind: str, plugin: str, dname: str, dver: str, pm: ComposerPluginManager | None
) -> Any:
    """The ``register`` a plugin's hook receives: provenance is bound here, from the entry point."""

    def refuse(message: str) -> None:
        if pm is not None:
            pm.refuse(plugin, message)
        else:
            raise PluginLoadError(plugin, message)

    def register(name: str, factory: Any, description: str | None = None, **kw: Any) -> None:
        spoofed = sorted(PROVENANCE_KEYS & set(kw))
        if spoofed:
            refuse(
                f"register({name!r}, ...) passed {', '.join(spoofed)}: provenance comes from the entry point "
                f"({dname or 'no distribution'} {dver}), not from register(); the {kind} {name!r} was not registered"
            )
            return
        try:
            registry.register(kind, name, factory, description, plugin=plugin, distribution=dname, version=dver, **kw)
        except DuplicatePluginError:
            me = f"{dname} {dver} (plugin {plugin!r})" if dname else f"plugin {plugin!r}"
            providers = registry.conflict(kind, name, me)
            others = "; ".join(p for p in providers if p != me)
            refuse(
                f"{kind} {name!r} is also registered by {others}; the name is unusable until one of them goes "
                "(other names are unaffected)"
            )

    return register


_lock = threading.RLock()
_pm: ComposerPluginManager | None = None
_registry: Registry | None = None


def get_plugin_manager() -> ComposerPluginManager:
    """The process-wide plugin manager, loaded on first call."""
    global _pm
    with _lock:
        if _pm is None:
            _pm = make_plugin_manager()
        return _pm


def get_registry() -> Registry:
    """The process-wide registry, built from :func:`get_plugin_manager` on first call."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = build_registry(get_plugin_manager())
        return _registry


def reset() -> None:
    """Forget the loaded plugins; the next accessor reloads them (for tests and notebooks)."""
    global _pm, _registry
    with _lock:
        _pm, _registry = None, None


def use_plugin_manager(pm: ComposerPluginManager) -> None:
    """Make ``pm`` the process-wide manager and rebuild the registry from it."""
    global _pm, _registry
    with _lock:
        _pm, _registry = pm, None
