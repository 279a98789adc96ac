"""Metrics of the training module: unbiased pass@k, torchmetrics accumulators, a step's reward statistics."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from composer_plugins.losses.functional import nanstd


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from ``n`` samples of which ``c`` are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


class PassAtK(Metric):
    """Mean unbiased pass@k over problems; ``update(correct)`` takes a ``(problems, n)`` bool tensor."""

    full_state_update = False

    def __init__(self, k: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.k = int(k)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, correct: Tensor) -> None:
        n = correct.shape[1]
        if n < self.k:
            raise ValueError(f"pass@{self.k} needs at least {self.k} samples per problem, got {n}")
        for row in correct:
            self.total += pass_at_k(n, int(row.sum().item()), self.k)
        self.count += correct.shape[0]

    def compute(self) -> Tensor:
        return (self.total / self.count.clamp(min=1)).float()


class Ratio(Metric):
    """``sum(numerator) / sum(denominator)`` over every update (``nan`` while the denominator is 0)."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("num", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("den", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, numerator: float | Tensor, denominator: float | Tensor) -> None:
        self.num += float(numerator)
        self.den += float(denominator)

    def compute(self) -> Tensor:
        return (self.num / self.den).float() if self.den > 0 else torch.tensor(float("nan"))


def scalar_metrics(metrics: Any, prefix: str = "") -> dict[str, float]:
    """The numeric scalars of ``metrics`` as floats (one-element tensors included, booleans not)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if hasattr(v, "numel") and v.numel() == 1:
            out[prefix + k] = float(v.detach().float().item())
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[prefix + k] = float(v)
    return out


def reward_stats(rewards: Tensor, group_size: int, success_threshold: float) -> dict[str, float]:
    """A step's ``reward`` (mean), ``accuracy`` (share at or above ``success_threshold``) and ``groups_with_signal``
    (groups whose rewards differ) over the scorable rows, and the ``unscorable`` share (NaN rewards: left out of
    these as out of the group advantages)."""
    scorable = ~torch.isnan(rewards)
    r = rewards[scorable]
    return {
        "reward": float(r.mean()) if r.numel() else math.nan,
        "accuracy": float((r >= success_threshold).float().mean()) if r.numel() else math.nan,
        "unscorable": float((~scorable).float().mean()),
        "groups_with_signal": float((nanstd(rewards.view(-1, group_size), dim=1) > 0).float().mean()),
    }
