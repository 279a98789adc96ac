"""Built-in losses of composer-plugins (registered by :mod:`composer_plugins.losses.plugin`).

* :mod:`composer_plugins.losses.functional` — the functional API (advantages, policy losses,
  DPPO, distillation divergences, DPO/SimPO, TAID schedule, and the chunked hidden-state versions,
  re-exported from :mod:`composer_plugins.kernels`, which ``models`` uses too);
* :mod:`composer_plugins.losses.base` — the :class:`LossChannel` contract and :class:`ChannelComposer`;
* :mod:`composer_plugins.losses.policy`, :mod:`~composer_plugins.losses.distill`,
  :mod:`~composer_plugins.losses.preference` — the built-in channels.

Importing this package does not import torch; import the submodules you need.
"""
