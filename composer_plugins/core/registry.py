"""The component registry: one table of named factories per kind, with provenance.

Entries are added only through the ``register`` callbacks handed to plugin hooks
(:mod:`composer_plugins.core.hookspecs`); built-ins go through the same path.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from composer_plugins.core import hookspecs
from composer_plugins.core.errors import (
    DuplicatePluginError,
    MissingDependencyError,
    PluginConflictError,
    UnknownPluginError,
)

#: Kind name -> hook that fills it, read from the hookspecs' :func:`~composer_plugins.core.hookspecs.fills`
#: marks. The order is the order ``composer-plugins list`` prints.
KINDS: dict[str, str] = {
    spec.registry_kind: name for name, spec in vars(hookspecs).items() if hasattr(spec, "registry_kind")
}

#: Other names of the kinds, in the singular (each is accepted in the plural too, as is a kind's own singular).
_KIND_ALIASES = {
    "loss": "losses",
    "loss_channel": "losses",
    "channel": "losses",
    "advantage": "advantage_estimators",
    "teacher_scorer": "scorers",
    "environment": "envs",
    "hint_provider": "hints",
    "optim": "optimizers",
    "generator": "rollout_generators",
    "input": "input_builders",
}

#: Backends shipped as separate distributions (in this repository's ``packages/``): name -> distribution.
BACKEND_DISTRIBUTIONS: dict[str, str] = {
    "trl": "composer-plugins-trl",
    "verl": "composer-plugins-verl",
    "prime_rl": "composer-plugins-prime-rl",
    "monarch": "composer-plugins-monarch",
}

#: name -> the command that installs the backend's distribution, run at the root of a clone (README.md says
#: the same; ``tests/core/test_core_cli_frictions.py`` keeps the two in step).
KNOWN_BACKENDS: dict[str, str] = {n: f"pip install ./packages/{d}" for n, d in BACKEND_DISTRIBUTIONS.items()}


def normalize_kind(kind: str) -> str:
    """Map ``'loss'``, ``'Losses'``, ``'env'`` ... to the canonical kind name, or raise."""
    k = kind.strip().lower().replace("-", "_")
    k = _KIND_ALIASES.get(k, k)
    if k not in KINDS:  # a plural alias, or a kind's singular
        k = _KIND_ALIASES.get(k.removesuffix("s"), k.removesuffix("s") + "s")
    if k not in KINDS:
        raise UnknownPluginError("kind", kind, list(KINDS))
    return k


def _first_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


@dataclass(frozen=True)
class RegistryEntry:
    """One registered component: what builds it, what it is, and who provided it."""

    name: str
    kind: str
    target: Callable[..., Any] | str
    description: str
    plugin: str
    distribution: str
    version: str
    init_params: dict[str, Any] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    install: str | None = None

    @property
    def factory(self) -> Callable[..., Any]:
        """The callable that builds the component; a ``"module:attr"`` target is imported now."""
        if callable(self.target):
            return self.target
        return _resolve(self.target, f"{self.kind} {self.name!r} (plugin {self.plugin!r})")

    @property
    def provider(self) -> str:
        """``distribution version`` of the package that registered this entry."""
        return f"{self.distribution} {self.version}".strip()

    @property
    def missing(self) -> list[str]:
        """Import names in ``requires`` that cannot be found (checked without importing them)."""
        return [m for m in self.requires if importlib.util.find_spec(m.split(".")[0]) is None]

    @property
    def available(self) -> bool:
        """True when every optional requirement is importable."""
        return not self.missing

    def contract_problem(self, load: bool = True) -> str | None:
        """Why this entry does not keep its kind's contract, or ``None``: its factory resolves, and a factory
        that declares ``contract_problem()`` (a loss channel's class) finds nothing wrong with itself. An entry
        whose optional requirements are missing is not imported (``missing`` says so); with ``load=False``
        neither is one registered by an import path whose module is not imported yet (``list`` stays cheap)."""
        if self.missing:
            return None
        if not load and isinstance(self.target, str) and self.target.partition(":")[0] not in sys.modules:
            return None
        try:
            factory = self.factory
        except ImportError as e:
            return str(e)
        check = getattr(factory, "contract_problem", None)
        return check() if callable(check) else None

    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Call the factory with the preset ``init_params`` updated by ``kwargs``."""
        missing = self.missing
        if missing:
            raise MissingDependencyError(
                self.kind, self.name, missing, self.install or f"pip install {' '.join(missing)}"
            )
        params = {**self.init_params, **kwargs}
        return self.factory(*args, **params)


@dataclass(frozen=True)
class NotInstalledEntry(RegistryEntry):
    """A known backend whose distribution is not installed (or not loaded): listed, never built.

    :meth:`Registry.not_installed` makes these from :data:`KNOWN_BACKENDS`; ``distribution`` is the
    distribution that brings the backend and ``install`` the command that installs it.
    """

    @property
    def missing(self) -> list[str]:
        return [self.distribution]

    @property
    def factory(self) -> Callable[..., Any]:
        raise MissingDependencyError(self.kind, self.name, self.missing, self.install or "")


def import_object(path: str) -> Any:
    """The object named ``module:attr.sub`` or ``module.attr``; ``ImportError``/``AttributeError``/``ValueError``."""
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve(target: str, what: str) -> Callable[..., Any]:
    try:
        return import_object(target)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"{what}: cannot import factory {target!r}: {type(e).__name__}: {e}") from e


def _natural_key(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s.lower())]


class Registry:
    """Named factories, per kind. Filled by :func:`composer_plugins.core.plugins.build_registry`."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, RegistryEntry]] = {k: {} for k in KINDS}
        self._aliases: dict[str, dict[str, str]] = {k: {} for k in KINDS}
        #: Messages about plugins that failed to load, shown with unknown-name errors.
        self.broken: list[str] = []
        #: kind -> name -> the providers that all registered it (the name is unusable until one goes).
        self.conflicts: dict[str, dict[str, list[str]]] = {k: {} for k in KINDS}

    # -- filling -----------------------------------------------------------------
    def register(
        self,
        kind: str,
        name: str,
        factory: Callable[..., Any] | str,
        description: str | None = None,
        *,
        plugin: str = "<direct>",
        distribution: str = "",
        version: str = "",
        aliases: Iterable[str] = (),
        override: bool = False,
        requires: Iterable[str] = (),
        install: str | None = None,
        **init_params: Any,
    ) -> RegistryEntry:
        """Add ``name`` to ``kind``. A duplicate raises unless ``override=True``."""
        kind = normalize_kind(kind)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{plugin}: a {kind} name must be a non-empty string, got {name!r}")
        if not callable(factory) and not (isinstance(factory, str) and ":" in factory):
            raise TypeError(
                f"{plugin}: factory for {kind} {name!r} must be a callable or a 'module:attr' string, got {factory!r}"
            )
        if description is None and isinstance(factory, str):
            description = _first_line(_resolve(factory, f"{kind} {name!r} (plugin {plugin!r})"))
        key = name.lower()
        table = self._entries[kind]
        if key in self.conflicts[kind] and not override:
            raise DuplicatePluginError(kind, name, "; ".join(self.conflicts[kind][key]), f"plugin {plugin!r}")
        clash = table.get(key) or table.get(self._aliases[kind].get(key, ""))
        if clash is not None and not override:
            raise DuplicatePluginError(kind, name, f"plugin {clash.plugin!r} ({clash.provider})", f"plugin {plugin!r}")
        entry = RegistryEntry(
            name=key,
            kind=kind,
            target=factory,
            description=(description or _first_line(factory)).strip(),
            plugin=plugin,
            distribution=distribution,
            version=version,
            init_params=dict(init_params),
            aliases=tuple(a.lower() for a in aliases),
            requires=tuple(requires),
            install=install,
        )
        table[key] = entry
        for a in entry.aliases:
            if a in table and not override:
                raise DuplicatePluginError(kind, a, f"plugin {table[a].plugin!r}", f"plugin {plugin!r} (as an alias)")
            self._aliases[kind][a] = key
        return entry

    def conflict(self, kind: str, name: str, provider: str) -> list[str]:
        """Mark ``name`` of ``kind`` as registered by several plugins; ``provider`` is the latest one.

        The entry registered first is removed, so :meth:`get` raises :class:`PluginConflictError`
        for that name only; every other name stays usable. Returns all providers so far.
        """
        kind = normalize_kind(kind)
        key = name.lower()
        key = self._aliases[kind].get(key, key)
        providers = self.conflicts[kind].setdefault(key, [])
        if key in self._entries[kind]:
            first = self._entries[kind][key]
            providers.append(_provider_label(first))
            self.unregister(kind, key)
        providers.append(provider)
        return providers

    def unregister(self, kind: str, name: str) -> None:
        """Remove ``name`` (and its aliases) from ``kind``."""
        kind = normalize_kind(kind)
        entry = self._entries[kind].pop(name.lower())
        for a in entry.aliases:
            self._aliases[kind].pop(a, None)

    # -- reading -----------------------------------------------------------------
    def get(self, kind: str, name: str) -> RegistryEntry:
        """The entry for ``name`` of ``kind``; unknown names raise :class:`UnknownPluginError`."""
        kind = normalize_kind(kind)
        key = name.strip().lower()
        key = self._aliases[kind].get(key, key)
        if key in self.conflicts[kind]:
            raise PluginConflictError(kind, key, self.conflicts[kind][key])
        try:
            return self._entries[kind][key]
        except KeyError:
            hint = KNOWN_BACKENDS.get(key.replace("-", "_")) if kind == "backends" else None
            raise UnknownPluginError(
                kind.rstrip("s") if kind != "losses" else "loss channel",
                name,
                self.names(kind),
                install_hint=hint,
                broken=self.broken,
            ) from None

    def build(self, kind: str, spec: Any, **kwargs: Any) -> Any:
        """Build a component from a name, or return ``spec`` unchanged if it is already an object."""
        if isinstance(spec, str):
            return self.get(kind, spec).build(**kwargs)
        if kwargs:
            raise TypeError(f"keyword arguments given for an already-built {kind} object {spec!r}")
        return spec

    def names(self, kind: str) -> list[str]:
        """Registered names of ``kind``, naturally sorted."""
        return sorted(self._entries[normalize_kind(kind)], key=_natural_key)

    def entries(self, kind: str | None = None, pattern: str | None = None) -> list[RegistryEntry]:
        """Entries of ``kind`` (all kinds if None) whose name matches the fnmatch ``pattern``.

        A pattern without wildcards matches as a substring; a leading ``!`` excludes.
        """
        kinds = [normalize_kind(kind)] if kind else list(KINDS)
        return [
            self._entries[k][n]
            for k in kinds
            for n in sorted(self._entries[k], key=_natural_key)
            if not pattern or _match(n, pattern)
        ]

    def not_installed(self, kind: str | None = None, pattern: str | None = None) -> list[NotInstalledEntry]:
        """Known backends (:data:`KNOWN_BACKENDS`) that no loaded plugin registered, with their install command.

        ``composer-plugins list backends`` shows them as ``[not installed: <command>]``; they are not
        :meth:`entries` (nothing can build them).
        """
        if kind is not None and normalize_kind(kind) != "backends":
            return []
        out = []
        for name, install in sorted(KNOWN_BACKENDS.items()):
            if ("backends", name) in self or (pattern and not _match(name, pattern)):
                continue
            dist = BACKEND_DISTRIBUTIONS[name]
            desc = f"The {name} backend, in the separate distribution {dist}."
            out.append(NotInstalledEntry(name, "backends", f"{dist}:?", desc, "", dist, "", install=install))
        return out

    def __iter__(self) -> Iterator[RegistryEntry]:
        return iter(self.entries())

    def __contains__(self, item: tuple[str, str]) -> bool:
        kind, name = item
        kind = normalize_kind(kind)
        key = name.lower()
        return key in self._entries[kind] or key in self._aliases[kind]


def _provider_label(entry: RegistryEntry) -> str:
    """``dist version (plugin 'p')``, or ``plugin 'p'`` for an entry registered without a distribution."""
    return f"{entry.provider} (plugin {entry.plugin!r})" if entry.provider else f"plugin {entry.plugin!r}"


def _match(name: str, pattern: str) -> bool:
    negate = pattern.startswith("!")
    pat = pattern[1:] if negate else pattern
    if not any(c in pat for c in "*?["):
        pat = f"*{pat}*"
    hit = fnmatch.fnmatch(name, pat.lower())
    return not hit if negate else hit


def builtin_hook(module: str, table: Mapping[str, tuple[Any, ...]]) -> Callable[[Any], None]:
    """A ``register_<kind>(register)`` hook implementation registering each ``name: (attr, description[,
    params])`` of a built-in table with the lazy factory ``"module:attr"`` (so listing never imports
    ``module``). Assign it to the hook's name in a plugin module."""

    @hookspecs.hookimpl
    def hook(register: Any) -> None:
        for name, (attr, description, *params) in table.items():
            register(name, f"{module}:{attr}", description=description, **(params[0] if params else {}))

    return hook
