"""composer-plugins-verl: the ``verl`` backend of composer-plugins, and our losses in VeRL's registries.

VeRL imports :mod:`composer_plugins_verl.backend` through this distribution's ``verl.plugins`` entry
point whenever ``verl`` is imported (driver and Ray workers alike), which registers, idempotently:

- policy losses ``composer_<loss_type>`` (select with ``actor_rollout_ref.actor.policy_loss.loss_mode``),
- the advantage estimator ``composer_grpo`` (``algorithm.adv_estimator``).

No distillation loss is registered: VeRL's distillation-loss registry (``register_distillation_loss``)
hands a loss the teacher's log-prob of the sampled token (or top-k log-probs) for the student's own
prompt, while the hint channel needs the policy conditioned on prompt + hint with full logits; see
docs/backends.md. The ``verl`` backend refuses those channels when it is built
(``composer_plugins.backends.support``), never drops them.

:mod:`composer_plugins_verl.plugin` registers the ``verl`` backend through the composer-plugins
entry point. Importing this package itself imports no upstream library; the names below load on
first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
#: The upstream range this release was tested with.
UPSTREAM = "verl>=0.9.1,<0.10"

__all__ = ["REGISTERED", "UPSTREAM", "VeRLBackend", "__version__", "register_verl_components"]


def __getattr__(name: str) -> Any:
    """``REGISTERED`` ({"policy_losses": [...], "adv_estimators": [...], ...}), ``VeRLBackend``, ..."""
    if name in ("REGISTERED", "VeRLBackend", "register_verl_components"):
        from composer_plugins_verl import backend

        return getattr(backend, name)
    raise AttributeError(name)
