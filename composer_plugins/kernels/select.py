"""Which LM-head kernels a step runs (``compute.kernels``) and with what chunk size, per device and memory.

``auto`` picks, for the device the step runs on and the tokens of one step, ``liger`` (``hint_distill``'s
``jsd`` only; every other LM-head path stays on these kernels), ``materialised`` (one chunk, when a step's
logits fit the memory budget) or ``chunked``; the rule and the reported pick (:meth:`KernelPick.params`):
docs/training.md (``compute.kernels``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from composer_plugins.core.errors import closest
from composer_plugins.kernels import KERNEL_SETTINGS
from composer_plugins.kernels.chunked import CHUNK_BYTES_PER_LOGIT, CHUNK_ELEMENTS, MEMORY_FRACTION, auto_chunk_size


def check_kernels(setting: str) -> None:
    """Refuse a ``compute.kernels`` value that is not one of :data:`KERNEL_SETTINGS`, suggesting the closest."""
    if setting not in KERNEL_SETTINGS:
        near = closest(str(setting), KERNEL_SETTINGS)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"unknown kernels {setting!r}; valid: {', '.join(KERNEL_SETTINGS)}.{hint}")


@dataclass(frozen=True)
class KernelPick:
    """What a step runs: ``kernels`` (materialised | chunked | liger), LM-head ``chunk_size`` rows, and why."""

    setting: str
    kernels: str
    chunk_size: int
    reason: str

    def params(self) -> dict[str, str]:
        """The pick as MLflow params."""
        return {
            "compute.kernels_pick": self.kernels,
            "compute.kernels_chunk_size": str(self.chunk_size),
            "compute.kernels_reason": self.reason,
        }


def pick_kernels(
    setting: str,
    *,
    vocab: int,
    tokens: int,
    device: Any = None,
    chunk_size: int | None = None,
    free_bytes: int | None = None,
    fraction: float = MEMORY_FRACTION,
    liger: bool = False,
) -> KernelPick:
    """The kernels for ``setting`` on ``device`` for steps of about ``tokens`` completion tokens.

    ``chunk_size`` (``compute.chunk_size``) overrides the chunk rows of ``chunked``/``liger``. The memory
    budget is ``fraction`` of the free memory on CUDA (``torch.cuda.mem_get_info``, or ``free_bytes``), on the
    CPU the logits of :data:`~composer_plugins.kernels.chunked.CHUNK_ELEMENTS` tokens x vocabulary. ``liger``:
    whether ``liger_kernel`` imports (``composer_plugins.losses.distill.liger_available``).
    """
    check_kernels(setting)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    cuda = dev.type == "cuda"
    if cuda and free_bytes is None:
        free_bytes = int(torch.cuda.mem_get_info(dev)[0])
    rows = int(chunk_size) if chunk_size is not None else auto_chunk_size(vocab, dev, free_bytes=free_bytes)
    tokens = max(int(tokens), 1)
    if setting == "liger" and not liger:
        raise ImportError("compute.kernels: liger needs Liger-Kernel: pip install 'composer-plugins[liger]'")
    if setting != "auto":
        return KernelPick(setting, setting, tokens if setting == "materialised" else rows, "asked for")
    if cuda and liger:
        return KernelPick(setting, "liger", rows, "cuda with liger_kernel installed")
    if chunk_size is not None:
        return KernelPick(setting, "chunked", rows, "compute.chunk_size given")
    budget = int(free_bytes * fraction) if free_bytes is not None else CHUNK_ELEMENTS * CHUNK_BYTES_PER_LOGIT
    need = tokens * int(vocab) * CHUNK_BYTES_PER_LOGIT
    where = f"{dev.type}: {need / 2**20:.0f} MiB of logits"
    if need <= budget:
        return KernelPick(setting, "materialised", tokens, f"{where} fit the {budget / 2**20:.0f} MiB budget")
    return KernelPick(setting, "chunked", rows, f"{where} exceed the {budget / 2**20:.0f} MiB budget")
