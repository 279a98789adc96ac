"""Default plugin of ``catalog``: adds ``composer-plugins list`` and ``plugins`` (:mod:`.commands`)."""

from __future__ import annotations

from typing import Any

from composer_plugins.catalog.commands import list_cmd, plugins
from composer_plugins.core.hookspecs import hookimpl


@hookimpl
def register_commands(cli: Any) -> None:
    cli.add_command(list_cmd)
    cli.add_command(plugins)
