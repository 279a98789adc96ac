"""composer-plugins-trl: the ``trl`` backend of composer-plugins.

:mod:`composer_plugins_trl.backend` holds ``ComposerGRPOTrainer`` (a ``trl.GRPOTrainer`` whose loss is
the composed channels) and ``TRLBackend``; :mod:`composer_plugins_trl.plugin` registers the backend
through this distribution's ``composer_plugins`` entry point. Importing this package imports no
upstream library (``composer-plugins list backends`` stays cheap); the names below load on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
#: The upstream range this release was tested with.
UPSTREAM = "trl>=1.16,<1.17"

__all__ = ["UPSTREAM", "ComposerGRPOTrainer", "TRLBackend", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("ComposerGRPOTrainer", "TRLBackend"):
        from composer_plugins_trl import backend

        return getattr(backend, name)
    raise AttributeError(name)
