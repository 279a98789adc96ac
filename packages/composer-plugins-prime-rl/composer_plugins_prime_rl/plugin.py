"""Registers the ``prime_rl`` backend (entry point ``composer_plugins`` of composer-plugins-prime-rl).

Lazy: the target is a ``"module:attr"`` string, so listing backends never imports PRIME-RL or torch.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.api import hookimpl

#: PRIME-RL is not on PyPI; it installs from its source tree with uv (Python 3.12), and this
#: distribution goes into that environment (run at the root of this repository's clone).
PRIME_RL_INSTALL = (
    "git clone https://github.com/PrimeIntellect-ai/prime-rl && cd prime-rl && uv sync --all-extras && "
    "source .venv/bin/activate && cd - && uv pip install ./packages/composer-plugins-prime-rl"
)


@hookimpl
def register_backends(register: Any) -> None:
    """Register ``prime_rl`` (aliases ``prime-rl``, ``primerl``)."""
    register(
        "prime_rl",
        "composer_plugins_prime_rl.backend:PrimeRLBackend",
        'PRIME-RL custom loss ([trainer.loss] type = "custom") composed from our channels, per-sample contract.',
        requires=["prime_rl"],
        install=PRIME_RL_INSTALL,
        aliases=("prime-rl", "primerl"),
    )
