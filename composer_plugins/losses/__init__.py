"""Built-in losses of composer-plugins (registered by :mod:`composer_plugins.losses.plugin`).

* :mod:`composer_plugins.losses.functional` — the functional API, one import for all of it: the losses
  themselves (policy losses, DPPO, distillation divergences, DPO/SimPO), re-exporting the rest: the TAID
  schedule, the chunked hidden-state versions (from :mod:`composer_plugins.kernels`, which ``models`` uses too)
  and the three modules below;
* :mod:`composer_plugins.losses.advantages` — group-relative (GRPO) and leave-one-out (RLOO) advantages;
* :mod:`composer_plugins.losses.correction` — importance-sampling weights for a lagging inference engine;
* :mod:`composer_plugins.losses.ops` — the tensor helpers they share (``LossOutput``, masked mean, ``nanstd``);
* :mod:`composer_plugins.losses.base` — the :class:`LossChannel` contract and :class:`ChannelComposer`;
* :mod:`composer_plugins.losses.policy`, :mod:`~composer_plugins.losses.distill`,
  :mod:`~composer_plugins.losses.preference` — the built-in channels.

Importing this package does not import torch; import the submodules you need. It names the ``compute.kernels``
settings (:data:`KERNEL_SETTINGS`, owned by :mod:`composer_plugins.kernels`) for the config to check without torch.
"""

from composer_plugins.kernels import KERNEL_SETTINGS

__all__ = ["KERNEL_SETTINGS"]
