"""Importance-sampling correction for rollouts sampled by a lagging inference engine (TRL's vLLM IS)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["IS_MODES", "ISMode", "importance_sampling_correction"]


#: Modes of :func:`importance_sampling_correction` (TRL's ``vllm_importance_sampling_mode``): the one place
#: they are written (``rollout.importance_sampling`` accepts these and ``off``). Importing them imports no torch.
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
IS_MODES: tuple[str, ...] = get_args(ISMode)


def importance_sampling_correction(
    logprobs: Tensor,
    sampling_logprobs: Tensor,
    mask: Tensor,
    mode: str = "token_truncate",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> Tensor:
    """Weights that correct for sampling from an engine whose weights lag the trained policy (TRL's vLLM IS).

    ``r = exp(logprobs - sampling_logprobs)`` per token (``token_*``) or per sequence (``sequence_*``,
    the masked sum of the differences; shape ``(B, 1)``); ``*_truncate`` clamps ``r`` to
    ``[clip_min, clip_max]``, ``*_mask`` sets ratios outside it to 0. Tokens off ``mask`` and tokens
    whose sampling log-prob is unknown (NaN) get ratio 1. No gradient flows through the result.

    ``logprobs`` (the policy's at rollout time), ``sampling_logprobs`` (the engine's) and ``mask`` are
    ``(B, T)``; ``clip_max``/``clip_min`` are TRL's ``vllm_importance_sampling_clip_max``/``_min`` (cap 3.0).
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; valid: {', '.join(IS_MODES)}")
    import torch

    from composer_plugins.losses.ops import _require_same

    _require_same("logprobs", logprobs, "sampling_logprobs", sampling_logprobs)
    diff = torch.nan_to_num((logprobs.detach().float() - sampling_logprobs.float()) * mask.float(), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -float("inf") if clip_min is None else clip_min
    hi = float("inf") if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
