"""composer-plugins-prime-rl: the ``prime_rl`` backend of composer-plugins.

Point PRIME-RL at the loss with::

    [trainer.loss]
    type = "custom"
    import_path = "composer_plugins_prime_rl.loss_fn"

(``composer_plugins.backends.prime_rl.loss_fn`` is the same function.) prime-rl itself is not
on PyPI; install it from source into the same environment.
"""

from __future__ import annotations

from composer_plugins.backends.prime_rl import LossInputs, LossOutputs, loss_fn

__version__ = "0.1.0"
#: The PRIME-RL source the loss interface was implemented from.
UPSTREAM = "prime-rl @ git+https://github.com/PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64"

__all__ = ["UPSTREAM", "LossInputs", "LossOutputs", "__version__", "loss_fn"]
