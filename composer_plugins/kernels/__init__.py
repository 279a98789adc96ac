"""The chunked LM-head kernels: log-probs and distillation divergences computed from hidden states.

Below ``models`` and ``losses``, which both use them; imports only ``core`` and torch. Modules:
``divergences`` (per-token divergences over a block of logits rows, closed-form gradients), ``chunked`` (the
autograd functions that walk the tokens chunk by chunk from hidden states, never building ``rows × tokens ×
vocab``, and the chunk-size rule), ``fused`` (log-probs whose gradients are formed in the forward pass for a
row-separable loss) and ``select`` (the ``compute.kernels`` setting's per-device pick). The documented
functional API re-exports the chunked functions from :mod:`composer_plugins.losses.functional`. Importing
this package does not import torch.
"""

from typing import Literal, get_args

#: The ``compute.kernels`` settings (the one list of them; :mod:`composer_plugins.kernels.select` picks among them).
KernelSetting = Literal["auto", "materialised", "chunked", "liger"]
KERNEL_SETTINGS: tuple[str, ...] = get_args(KernelSetting)
