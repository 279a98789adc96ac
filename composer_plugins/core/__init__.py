"""The plugin kernel: hookspecs, plugin manager, registry, errors, config, the JSONL and env-step readers,
the CLI group and its error handler, and progress bars (child processes: :mod:`composer_plugins.procs`).

Imports only the stdlib, pluggy, yaml and click (``tests/core/test_architecture.py``; see docs/architecture.md).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, tuple[str, ...]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: a name listed under a submodule in ``exports`` is imported
    from it on first use (and kept), so importing the package itself stays cheap."""
    home = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
