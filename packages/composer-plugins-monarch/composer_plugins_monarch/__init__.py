"""composer-plugins-monarch: the ``monarch`` backend of composer-plugins.

:mod:`composer_plugins_monarch.backend` holds the Generator, Rewarder and Trainer actors and
``MonarchBackend``; :mod:`composer_plugins_monarch.plugin` registers the backend through this
distribution's ``composer_plugins`` entry point. Importing this package imports no upstream library.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
#: The upstream range this release was tested with.
UPSTREAM = "torchmonarch>=0.7,<0.8"

__all__ = ["UPSTREAM", "MonarchBackend", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "MonarchBackend":
        from composer_plugins_monarch.backend import MonarchBackend

        return MonarchBackend
    raise AttributeError(name)
