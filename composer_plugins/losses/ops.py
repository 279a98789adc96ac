"""Tensor helpers the functional losses share: ``LossOutput``, masked mean, NaN-aware std, shape checks."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["LossOutput", "masked_mean", "nanstd", "selective_log_softmax"]


class LossOutput(NamedTuple):
    """A scalar loss and its metrics (detached 0-d tensors or floats)."""

    loss: Tensor
    metrics: dict[str, Tensor | float]


def _shape(x: Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def _require_same(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} shape {_shape(a)} must equal {name_b} shape {_shape(b)}")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over ``mask`` (0 where the mask is empty)."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1.0)


def nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (NaN when fewer than 2 values), as TRL's ``nanstd``."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    corr = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var * corr)
    if keepdim:
        return std
    return std.squeeze(dim) if dim is not None else std.reshape(())


def selective_log_softmax(logits: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)[..., ids]`` without materialising the full log-softmax.

    ``logits`` is ``(..., V)``, ``ids`` its leading shape; returns float32 log-probabilities (float64 stays
    float64).
    """
    if ids.shape != logits.shape[:-1]:
        raise ValueError(f"ids shape {_shape(ids)} must equal logits.shape[:-1] = {_shape(logits)[:-1]}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
