"""The training config: the dataclasses of every section, each validating itself (``train``: ``TrainConfig``;
``sections``), the parsed loss specs, the strategy names and the channel-input declarations (``inputs``).

Imports nothing else of ``training`` at module level; a section checks a name against the registry of the
sub-package that owns it, lazily (tests/core/test_architecture.py lists those imports).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """0.2.0's ``composer_plugins.training.config`` was the module now at ``.train``: its names still resolve here, with
    a deprecation warning naming the new path (until 0.3.0)."""
    import importlib

    from composer_plugins.training import moved_warning

    module = importlib.import_module(f"{__name__}.train")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    moved_warning(f"{__name__}.{name}", f"{__name__}.train.{name}")
    globals()[name] = value = getattr(module, name)  # `from pkg import name` looks a name up twice: warn once
    return value
