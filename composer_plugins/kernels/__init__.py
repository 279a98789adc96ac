"""The chunked LM-head kernels: log-probs and distillation divergences computed from hidden states.

Below ``models`` and ``losses``, which both use them; imports only ``core`` and torch.

* :mod:`composer_plugins.kernels.divergences` — per-token divergences over a block of logits rows
  (JSD, TAID, entropy-aware OPD, the top-k + tail wrapper) with closed-form, in-place gradients;
* :mod:`composer_plugins.kernels.chunked` — the autograd functions that walk the tokens chunk by
  chunk from hidden states and the LM-head weight (:func:`~composer_plugins.kernels.chunked.chunked_logprobs`,
  :func:`~composer_plugins.kernels.chunked.chunked_distill` and the per-criterion helpers), so no
  ``rows × tokens × vocab`` tensor is ever built, and the chunk-size rule (``auto_chunk_size``: from the
  device's free memory); every matmul runs in the autocast dtype, the weight gradient adds into an fp32 buffer;
* :mod:`composer_plugins.kernels.fused` — :func:`~composer_plugins.kernels.fused.fused_logprobs`, log-probs whose
  gradients are formed in the forward pass for a row-separable loss (three matmuls a chunk instead of four);
* :mod:`composer_plugins.kernels.select` — the ``compute.kernels`` setting and its per-device pick.

The documented functional API re-exports the chunked functions from
:mod:`composer_plugins.losses.functional`. Importing this package does not import torch.
"""

from typing import Literal, get_args

#: The ``compute.kernels`` settings (the one list of them; :mod:`composer_plugins.kernels.select` picks among them).
KernelSetting = Literal["auto", "materialised", "chunked", "liger"]
KERNEL_SETTINGS: tuple[str, ...] = get_args(KernelSetting)
