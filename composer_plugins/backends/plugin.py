"""Default plugin: registers the built-in backends through the public ``register_backends`` hook."""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl


@hookimpl
def register_backends(register: Any) -> None:
    """Register the built-in backends."""
