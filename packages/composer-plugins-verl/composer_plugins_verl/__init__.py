"""composer-plugins-verl: registers composer-plugins losses in VeRL's own registries.

VeRL imports this module through its ``verl.plugins`` entry point whenever ``verl`` is imported
(driver and Ray workers alike), which registers, idempotently:

- policy losses ``composer_<loss_type>`` (select with ``actor_rollout_ref.actor.policy_loss.loss_mode``),
- the advantage estimator ``composer_grpo`` (``algorithm.adv_estimator``).

No distillation loss is registered: VeRL's distillation-loss registry (``register_distillation_loss``)
hands a loss the teacher's log-prob of the sampled token (or top-k log-probs) for the student's own
prompt, while the hint channel needs the policy conditioned on prompt + hint with full logits; see
docs/backends.md. The ``verl`` backend warns about the channels it drops.

The adapter lives in :mod:`composer_plugins.backends.verl`.
"""

from __future__ import annotations

from composer_plugins.backends.verl import register_verl_components

__version__ = "0.1.0"
#: The upstream range this release was tested with.
UPSTREAM = "verl>=0.9.1,<0.10"

#: What was registered: {"policy_losses": [...], "adv_estimators": [...], "distillation_losses": [...]}.
REGISTERED = register_verl_components()

__all__ = ["REGISTERED", "UPSTREAM", "__version__", "register_verl_components"]
