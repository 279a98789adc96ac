"""Default plugin: registers the built-in envs through the public ``register_envs`` hook."""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl


@hookimpl
def register_envs(register: Any) -> None:
    """Register the built-in envs."""
