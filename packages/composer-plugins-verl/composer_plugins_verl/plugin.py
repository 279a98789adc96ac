"""Registers the ``verl`` backend (entry point ``composer_plugins`` of composer-plugins-verl).

Lazy: the target is a ``"module:attr"`` string, so listing backends never imports VeRL.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.api import hookimpl
from composer_plugins.backends.surface import KNOWN_BACKENDS


@hookimpl
def register_backends(register: Any) -> None:
    """Register ``verl``."""
    register(
        "verl",
        "composer_plugins_verl.backend:VeRLBackend",
        "Our policy losses and advantage estimators in VeRL's own registries (loss_mode=composer_*).",
        requires=["verl"],
        install=KNOWN_BACKENDS["verl"],
    )
