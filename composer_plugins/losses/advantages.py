"""Group-relative advantages from per-completion rewards (TRL ``GRPOTrainer`` / ``RLOOTrainer`` semantics), and the
built-in advantage estimators (registry kind ``advantage_estimators``): ``est(rewards, group_size) -> (N,)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from composer_plugins.losses.ops import _shape, nanstd

__all__ = [
    "AdvantageEstimator",
    "ComposedAdvantage",
    "GroupAdvantage",
    "RLOOAdvantage",
    "group_advantages",
    "rloo_advantages",
]


def _rewards_tensor(
    rewards: Tensor | Sequence[float | None] | Sequence[Sequence[float | None]],
    reward_weights: Sequence[float] | Tensor | None,
) -> Tensor:
    """Sum per-function rewards (``nansum``) with weights; rows where every function is ``None``/NaN become NaN."""
    if isinstance(rewards, Tensor):
        r = rewards.detach().float()
    else:
        rows = list(rewards)
        if rows and isinstance(rows[0], Sequence) and not isinstance(rows[0], str):
            r = torch.tensor([[float("nan") if v is None else float(v) for v in row] for row in rows])  # type: ignore[union-attr]
        else:
            r = torch.tensor([float("nan") if v is None else float(v) for v in rows], dtype=torch.float32)  # type: ignore[arg-type]
    if r.dim() == 1:
        if reward_weights is not None:
            raise ValueError("reward_weights needs rewards of shape (N, num_reward_funcs)")
        return r
    if r.dim() != 2:
        raise ValueError(f"rewards must be (N,) or (N, num_reward_funcs), got shape {_shape(r)}")
    w = torch.ones(r.shape[1]) if reward_weights is None else torch.as_tensor(reward_weights, dtype=torch.float32)
    if w.shape != (r.shape[1],):
        raise ValueError(f"reward_weights has {w.numel()} entries but rewards has {r.shape[1]} columns")
    unscorable = torch.isnan(r).all(dim=1)
    total = (r * w.to(r.device).unsqueeze(0)).nansum(dim=1)
    total[unscorable] = float("nan")
    return total


def group_advantages(
    rewards: Tensor | Sequence[float | None] | Sequence[Sequence[float | None]],
    group_size: int,
    scale: Literal["group", "batch", "none"] | None = None,
    *,
    estimator: Literal["grpo", "rloo"] = "grpo",
    reward_weights: Sequence[float] | Tensor | None = None,
    eps: float = 1e-4,
) -> Tensor:
    """Group-relative advantages with TRL semantics.

    ``rewards`` holds ``N = num_prompts × group_size`` completions, grouped contiguously (the
    ``group_size`` completions of prompt 0 first); a ``None``/NaN reward is unscorable (advantage 0). A 2-D
    ``(N, K)`` input holds one column per reward function, summed with ``reward_weights`` (a row is
    unscorable when every function returned ``None``). ``estimator="grpo"``: ``A = r - mean_group(r)``,
    divided by the group's (``scale="group"``, default) or batch's (``"batch"``) ``std + eps``, or not at all
    (``"none"``, Dr. GRPO); ``"rloo"``: leave-one-out baseline (``scale`` default ``"none"``). The rules:
    docs/losses.md ("Advantages"). Returns ``(N,)`` float32 advantages.
    """
    r = _rewards_tensor(rewards, reward_weights)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if r.numel() % group_size != 0:
        raise ValueError(f"{r.numel()} rewards are not a whole number of groups of group_size={group_size}")
    if estimator == "rloo":
        return rloo_advantages(r, group_size, normalize=(scale or "none") == "batch", eps=eps, _check_scale=scale)
    if estimator != "grpo":
        raise ValueError(f"unknown estimator {estimator!r}; valid: 'grpo', 'rloo'")
    scale = scale or "group"
    grouped = r.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    if scale in ("group", "none"):
        std = nanstd(grouped, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(r)
    elif scale == "batch":
        std = nanstd(r).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
    else:
        raise ValueError(f"unknown scale {scale!r}; valid: 'group', 'batch', 'none'")
    adv = r - mean
    if scale != "none":
        adv = adv / (std + eps)
    return torch.nan_to_num(adv, nan=0.0)


def rloo_advantages(
    rewards: Tensor | Sequence[float | None],
    group_size: int,
    normalize: bool = False,
    *,
    eps: float = 1e-4,
    _check_scale: str | None = None,
) -> Tensor:
    """REINFORCE leave-one-out advantages, TRL ``RLOOTrainer`` semantics (see :func:`group_advantages`)."""
    if _check_scale not in (None, "none", "batch"):
        raise ValueError(f"scale {_check_scale!r} is not defined for RLOO; use 'none' or 'batch'")
    r = _rewards_tensor(rewards, None)
    if r.numel() % group_size != 0:
        raise ValueError(f"{r.numel()} rewards are not a whole number of groups of group_size={group_size}")
    grouped = r.view(-1, group_size)
    if group_size > 1:
        counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
        total = torch.nansum(grouped, dim=1, keepdim=True)
        baselines = ((total - grouped) / (counts - 1)).view(-1)
        adv = r - baselines
    else:
        adv = torch.zeros_like(r)
    if normalize:
        adv = (adv - torch.nanmean(adv)) / (nanstd(adv) + eps)
    return torch.nan_to_num(adv, nan=0.0)


@runtime_checkable
class AdvantageEstimator(Protocol):
    """The contract of ``register_advantage_estimators``: ``est(rewards, group_size)`` -> one finite float per row
    (``rewards``: the step's float tensor, NaN for an unscorable row, rows grouped ``group_size`` at a time)."""

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor: ...


class GroupAdvantage:
    """GRPO's estimator (``group``): :func:`group_advantages` with ``scale`` (``group``|``batch``|``none``) and
    ``eps``; with the defaults it is what a channel without ``advantage:`` reads."""

    scales: tuple[str, ...] = ("group", "batch", "none")
    estimator = "grpo"

    def __init__(self, scale: str | None = None, eps: float = 1e-4) -> None:
        if scale is not None and scale not in self.scales:
            raise ValueError(f"scale {scale!r} is not one of {list(self.scales)}")
        self.scale, self.eps = scale, float(eps)

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        return group_advantages(rewards, group_size, self.scale, estimator=self.estimator, eps=self.eps)  # type: ignore[arg-type]


class RLOOAdvantage(GroupAdvantage):
    """RLOO's estimator (``rloo``): leave-one-out baselines, ``scale: batch`` normalising over the batch."""

    scales = ("none", "batch")
    estimator = "rloo"


class ComposedAdvantage:
    """``Σ weight_i · est_i(rewards, group_size)`` (``advantage: {compose: [{name: ..., weight: ...}, ...]}``)."""

    def __init__(self, parts: Sequence[tuple[float, Callable[[Tensor, int], Tensor]]]) -> None:
        self.parts = list(parts)

    def __call__(self, rewards: Tensor, group_size: int) -> Tensor:
        return sum((w * est(rewards, group_size).float() for w, est in self.parts), torch.zeros_like(rewards))
