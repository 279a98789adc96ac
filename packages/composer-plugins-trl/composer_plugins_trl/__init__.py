"""composer-plugins-trl: installs the tested TRL range for the ``trl`` backend of composer-plugins.

The adapter itself lives in :mod:`composer_plugins.backends.trl` and is registered by the
built-in backends plugin of composer-plugins; this package only pins the upstream and
re-exports the public names for convenience.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
#: The upstream range this release was tested with.
UPSTREAM = "trl>=1.16,<1.17"

__all__ = ["UPSTREAM", "ComposerGRPOTrainer", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "ComposerGRPOTrainer":
        from composer_plugins.backends.trl import ComposerGRPOTrainer

        return ComposerGRPOTrainer
    raise AttributeError(name)
