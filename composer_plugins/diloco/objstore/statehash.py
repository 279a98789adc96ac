"""A global state's hash (recorded in ``state/<r>`` with replay points, ``diloco.exact_every``): a SHA-256 of its
vectors, the tensors of one or more dimensions (the weights, the outer momentum) in walk order; scalars (an
optimizer's step) are not in it."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def map_leaves(fn: Any, x: Any) -> Any:
    """``x`` with each leaf (what is not a list, tuple or dict) replaced by ``fn(leaf)``, in walk order."""
    if isinstance(x, list):
        return [map_leaves(fn, v) for v in x]
    if isinstance(x, tuple):
        return tuple(map_leaves(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: map_leaves(fn, v) for k, v in x.items()}
    return fn(x)


def flatten(state: Any) -> torch.Tensor:
    """The flat fp32 vector of a state: the values of its fp32 tensors of one or more dimensions, in walk order."""
    parts: list[torch.Tensor] = []

    def take(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.dtype == torch.float32:
            parts.append(x.detach().reshape(-1))
        return x

    map_leaves(take, state)
    return torch.cat(parts) if parts else torch.zeros(0)


def state_hash(flat: torch.Tensor) -> str:
    """SHA-256 (hex) of a state's flat vector: equal exactly when the vectors are bitwise equal."""
    t = flat.detach().to("cpu", torch.float32).contiguous()  # a state on the GPU is hashed from its host copy
    return hashlib.sha256(
        t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    ).hexdigest()  # device-ok: t is on the CPU
