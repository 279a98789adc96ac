"""Registers the ``monarch`` backend (entry point ``composer_plugins`` of composer-plugins-monarch).

Lazy: the target is a ``"module:attr"`` string, so listing backends never imports Monarch.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.api import hookimpl
from composer_plugins.backends.surface import KNOWN_BACKENDS


@hookimpl
def register_backends(register: Any) -> None:
    """Register ``monarch``."""
    register(
        "monarch",
        "composer_plugins_monarch.backend:MonarchBackend",
        "Generator, Rewarder and Trainer actors on a Monarch process mesh; the trainer applies the composed loss.",
        requires=["monarch"],
        install=KNOWN_BACKENDS["monarch"],
    )
