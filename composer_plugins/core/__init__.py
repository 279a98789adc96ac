"""The plugin kernel: hookspecs, plugin manager, registry, errors, config, the JSONL reader and atomic writers,
the CLI group and its error handler, and the progress switch (child processes: :mod:`composer_plugins.procs`;
prompts and env-step results: :mod:`composer_plugins.chat`).

Imports only the stdlib, pluggy, yaml and click (``tests/core/test_architecture.py``; see docs/architecture.md).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: a name listed under a module in ``exports`` (a submodule's
    name, or a dotted path) is imported from it on first use (and kept; a name may be a submodule of that
    module), so importing ``package`` stays cheap."""
    home = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = home[name] if "." in home[name] or home[name] == "composer_plugins" else f"{package}.{home[name]}"
        mod = importlib.import_module(module)
        value = getattr(mod, name) if hasattr(mod, name) else importlib.import_module(f"{module}.{name}")
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def moved_module(old: str, new: str, removed_in: str = "0.3.0") -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old``, whose names moved to ``new``: each is read from there, with a
    ``PluginDeprecationWarning`` naming the new path (the old one is served until ``removed_in``)."""

    def __getattr__(name: str) -> Any:
        import warnings

        from composer_plugins.core.errors import PluginDeprecationWarning

        value = getattr(importlib.import_module(new), name)
        msg = f"{old}.{name} moved to {new}.{name}: import it from there ({old} is removed in {removed_in})"
        warnings.warn(msg, PluginDeprecationWarning, stacklevel=2)
        return value

    return __getattr__
