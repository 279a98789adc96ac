"""composer-plugins-focal: an example third-party loss-channel plugin.

Registers ``focal_pg``: a token-level policy-gradient loss whose per-token weight
``(1 - p)^gamma`` focuses learning on tokens the policy still finds unlikely.
Install with ``pip install ./examples/composer-plugins-focal``; then
``composer-plugins list losses focal`` shows it.

The hook registers the channel by its import path (``module:Class``) with its description: the
registry imports ``composer_plugins_focal_loss`` (and torch) only when a run builds ``focal_pg``, so a
plugin never slows down commands that do not use it. Without ``description=`` the registry would import
the class to read its docstring, and every command would pay about 3 s for torch.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.api import hookimpl


@hookimpl
def register_loss_channels(register: Any) -> None:
    register(
        "focal_pg",
        "composer_plugins_focal_loss:FocalPolicyGradient",
        "Focal-weighted token policy gradient: -A · (1-p)^γ · log p over completion tokens.",
    )


__all__ = ["register_loss_channels"]
