"""What every conformance check shares: :class:`ConformanceError` and finding and naming the entry checked.

The per-kind checks (:mod:`composer_plugins.testing.conformance`, :mod:`composer_plugins.testing.generators`)
import these from here, so a kind's check can live in a module of its own without an import circle.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.core.errors import ComposerPluginsError

__all__ = ["ConformanceError"]


class ConformanceError(ComposerPluginsError, AssertionError):
    """A registered component does not keep its kind's contract."""


def _entry(kind: str, name: str, registry: Any = None) -> Any:
    from composer_plugins.core.plugins import get_registry

    return (registry or get_registry()).get(kind, name)


def _fail(entry: Any, what: str) -> ConformanceError:
    who = f"{entry.kind} {entry.name!r} ({entry.provider or 'plugin ' + repr(entry.plugin)})"
    return ConformanceError(f"{who}: {what}")


def _build(entry: Any, **build_kwargs: Any) -> Any:
    """``entry`` built with ``build_kwargs``; a failure is a :class:`ConformanceError` naming them."""
    try:
        return entry.build(**build_kwargs)
    except Exception as e:
        raise _fail(entry, f"does not build with {build_kwargs}: {type(e).__name__}: {e}") from e
