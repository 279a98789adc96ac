"""composer-plugins: compose RL, hint self-distillation and multi-teacher replay losses.

Public plugin API: :data:`hookimpl` (decorate your ``register_*`` hook functions) and
the registry accessors below. Nothing here imports torch or loads plugins at import time.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl
from composer_plugins.core.version import PLUGIN_API_VERSION, __version__

__all__ = ["PLUGIN_API_VERSION", "__version__", "build", "get_plugin_manager", "get_registry", "hookimpl", "list_names"]


def get_registry() -> Any:
    """The process-wide :class:`~composer_plugins.core.registry.Registry` (plugins load on first call)."""
    from composer_plugins.core.plugins import get_registry as _get

    return _get()


def get_plugin_manager() -> Any:
    """The process-wide plugin manager (plugins load on first call)."""
    from composer_plugins.core.plugins import get_plugin_manager as _get

    return _get()


def build(kind: str, spec: Any, **kwargs: Any) -> Any:
    """Build a component of ``kind`` by name (or return ``spec`` if it is already an object)."""
    return get_registry().build(kind, spec, **kwargs)


def list_names(kind: str) -> list[str]:
    """Registered names of ``kind`` (``losses``, ``teachers``, ``envs``, ``hints``, ``backends``)."""
    return get_registry().names(kind)
