"""Default plugin: registers the built-in teachers through the public ``register_teachers`` hook."""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl


@hookimpl
def register_teachers(register: Any) -> None:
    """Register the built-in teachers."""
