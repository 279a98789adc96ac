"""composer-plugins-monarch: installs the tested torchmonarch range for the ``monarch`` backend.

The actors live in :mod:`composer_plugins.backends.monarch` and are registered by the built-in
backends plugin of composer-plugins; this package only pins the upstream.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
#: The upstream range this release was tested with.
UPSTREAM = "torchmonarch>=0.7,<0.8"

__all__ = ["UPSTREAM", "MonarchBackend", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "MonarchBackend":
        from composer_plugins.backends.monarch import MonarchBackend

        return MonarchBackend
    raise AttributeError(name)
