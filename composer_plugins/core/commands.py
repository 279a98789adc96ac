"""Default plugin that adds the built-in subcommands (``train``, ``replay``, ``eval`` ...).

Each subcommand lives next to the feature it drives and is attached here through the
public ``register_commands(cli)`` hook, the same way a third-party plugin adds one.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl


@hookimpl
def register_commands(cli: Any) -> None:
    """Attach the built-in subcommands."""
