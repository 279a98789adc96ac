"""Registers the ``trl`` backend (entry point ``composer_plugins`` of composer-plugins-trl).

Lazy: the target is a ``"module:attr"`` string, so listing backends never imports TRL.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.api import hookimpl
from composer_plugins.backends.surface import KNOWN_BACKENDS


@hookimpl
def register_backends(register: Any) -> None:
    """Register ``trl``."""
    register(
        "trl",
        "composer_plugins_trl.backend:TRLBackend",
        "trl.GRPOTrainer subclass whose loss is the composed channels (TRL generation, rewards, advantages).",
        requires=["trl"],
        install=KNOWN_BACKENDS["trl"],
    )
