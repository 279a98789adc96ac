"""The chunked LM-head kernels: log-probs and distillation divergences computed from hidden states.

Below ``models`` and ``losses``, which both use them; imports only ``core`` and torch. Modules, each saying
what it owns: ``divergences``, ``chunked``, ``fused`` and ``select``. The documented functional API re-exports
the chunked functions from :mod:`composer_plugins.losses.functional`. Importing this package does not import
torch.
"""

from typing import Literal, get_args

#: The ``compute.kernels`` settings (the one list of them; :mod:`composer_plugins.kernels.select` picks among them).
KernelSetting = Literal["auto", "materialised", "chunked", "liger"]
KERNEL_SETTINGS: tuple[str, ...] = get_args(KernelSetting)
