"""Exceptions raised by composer-plugins. Every message says what went wrong and how to fix it."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Sequence


class ComposerPluginsError(Exception):
    """Base class for every error this package raises on purpose."""


class PluginDeprecationWarning(DeprecationWarning):
    """A plugin uses a contract form served through an adapter until a later release (docs/plugins.md
    "Versions and deprecations"); shown once per place by default, unlike other ``DeprecationWarning``s."""


warnings.filterwarnings("default", category=PluginDeprecationWarning)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a long-running command, saying what was saved and how to continue; every command
    prints it and exits 130 (:func:`composer_plugins.core.cli.report_interrupt`)."""

    def __init__(self, saved: str, then: str) -> None:
        super().__init__(f"interrupted: {saved}; {then}")


def closest(name: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Return up to ``n`` candidates close to ``name`` (case-insensitive), best first."""
    lowered = {c.lower(): c for c in candidates}
    return [lowered[m] for m in difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=cutoff)]


def one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` of an exception on one line, cut to ``limit`` characters (for logs and wrapped errors)."""
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class UnknownPluginError(ComposerPluginsError, KeyError):
    """A component name that no loaded plugin registered."""

    def __init__(
        self,
        kind: str,
        name: str,
        available: Sequence[str],
        install_hint: str | None = None,
        broken: Sequence[str] = (),
    ) -> None:
        self.kind = kind
        self.name = name
        self.available = sorted(available)
        self.suggestions = closest(name, self.available)
        self.install_hint = install_hint
        lines = [f"Unknown {kind} {name!r}."]
        if install_hint:
            lines.append(f"It is provided by a separate package. HINT: install it with `{install_hint}`.")
        if self.suggestions:
            lines.append("Did you mean: " + ", ".join(repr(s) for s in self.suggestions) + "?")
        plural = kind if kind.endswith("s") else kind + "s"
        lines.append(f"Available {plural}: " + (", ".join(self.available) if self.available else "(none)") + ".")
        lines += [f"Note: {b}" for b in broken]
        super().__init__("\n".join(lines))

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class DuplicatePluginError(ComposerPluginsError, ValueError):
    """Two plugins registered the same name for the same kind."""

    def __init__(self, kind: str, name: str, existing: str, new: str) -> None:
        self.kind, self.name = kind, name
        super().__init__(
            f"{kind} {name!r} is already registered by {existing}; {new} tried to register it again. "
            f"HINT: rename one of them, or pass override=True to register() to replace it on purpose."
        )


class PluginConflictError(ComposerPluginsError, KeyError):
    """A name that two plugins registered: neither is used until one of them goes."""

    def __init__(self, kind: str, name: str, providers: Sequence[str]) -> None:
        self.kind, self.name, self.providers = kind, name, list(providers)
        super().__init__(
            f"{kind} {name!r} is registered by more than one plugin: {'; '.join(self.providers)}. Neither is used. "
            "HINT: uninstall one of the distributions, or load only one of them with "
            "COMPOSER_PLUGINS_LOAD=<entry point or distribution>[,...]."
        )

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class PluginLoadError(ComposerPluginsError, ImportError):
    """A plugin failed to import or to validate. The message names the plugin."""

    def __init__(self, plugin: str, reason: str) -> None:
        self.plugin = plugin
        self.reason = reason
        super().__init__(f"Error loading plugin {plugin!r}: {reason}")


class MissingDependencyError(ComposerPluginsError, ImportError):
    """A registered component needs an optional library that is not installed."""

    def __init__(self, kind: str, name: str, missing: Sequence[str], install: str) -> None:
        self.kind, self.name, self.missing, self.install = kind, name, list(missing), install
        super().__init__(
            f"{kind} {name!r} needs {', '.join(missing)}, which is not installed. HINT: install it with `{install}`."
        )


class ConfigError(ComposerPluginsError, ValueError):
    """A configuration value is wrong. Names the file, line and key, and the valid choices."""

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        file: str | None = None,
        line: int | None = None,
        valid: Sequence[str] | None = None,
        override: str | None = None,
    ) -> None:
        self.key, self.file, self.line, self.override = key, file, line, override
        self.problem = message  # the message without its location (to locate it again, further up)
        self.valid = sorted(set(valid)) if valid is not None else None  # each name once
        where = ""
        if override is not None:  # the value came from the command line, not from the file
            where = f"command-line override {override!r}: "
        elif file:
            where = f"{file}:{line}: " if line else f"{file}: "
        text = where + (f"{key}: " if key else "") + message
        if self.valid is not None and key is not None:
            leaf = key.rsplit(".", 1)[-1]
            sugg = closest(leaf, self.valid)
            if sugg:
                text += " Did you mean: " + ", ".join(repr(s) for s in sugg) + "?"
            text += " Valid keys: " + ", ".join(self.valid) + "."
        super().__init__(text)
