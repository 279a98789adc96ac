"""Default plugin: registers the built-in losses through the public ``register_loss_channels`` hook."""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl


@hookimpl
def register_loss_channels(register: Any) -> None:
    """Register the built-in losses."""
