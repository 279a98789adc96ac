"""composer-plugins-prime-rl: the ``prime_rl`` backend of composer-plugins.

Point PRIME-RL at the loss with::

    [trainer.loss]
    type = "custom"
    import_path = "composer_plugins_prime_rl.loss_fn"

The loss and ``PrimeRLBackend`` live in :mod:`composer_plugins_prime_rl.backend` (loaded on first use
of the names below, so listing backends imports nothing heavy); :mod:`composer_plugins_prime_rl.plugin`
registers the backend through this distribution's ``composer_plugins`` entry point. prime-rl itself is
not on PyPI; install it from source into the same environment.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
#: The PRIME-RL source the loss interface was implemented from.
UPSTREAM = "prime-rl @ git+https://github.com/PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64"

__all__ = ["UPSTREAM", "LossInputs", "LossOutputs", "PrimeRLBackend", "__version__", "loss_fn"]


def __getattr__(name: str) -> Any:
    if name in ("LossInputs", "LossOutputs", "PrimeRLBackend", "loss_fn"):
        from composer_plugins_prime_rl import backend

        return getattr(backend, name)
    raise AttributeError(name)
