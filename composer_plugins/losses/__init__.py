"""Built-in losses of composer-plugins (registered by :mod:`composer_plugins.losses.plugin`).

:mod:`composer_plugins.losses.functional` is the functional API, one import for all of it;
:mod:`composer_plugins.losses.base` holds the :class:`LossChannel` contract and :class:`ChannelComposer`;
``policy``, ``distill``, ``teacher_distill`` and ``preference`` the built-in channels.

Importing this package does not import torch; import the submodules you need. It names the ``compute.kernels``
settings (:data:`KERNEL_SETTINGS`, owned by :mod:`composer_plugins.kernels`) for the config to check without torch.
"""

from composer_plugins.kernels import KERNEL_SETTINGS

__all__ = ["KERNEL_SETTINGS"]
