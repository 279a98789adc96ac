"""Per-token log-probabilities of completions under a causal LM (utilities, not losses).

Only the logits of the completion positions are materialised (``logits_to_keep``), and
position ids are derived from the attention mask exactly as HF ``generate`` does for
left-padded prompts, so training-time log-probs match sampling-time ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counting only attended tokens (left padding gets position 0), as ``generate`` uses."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 0)


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / T)[labels]`` without materialising the full log-softmax tensor.

    Args:
        logits: ``(..., V)``.
        labels: ``(...)`` token ids.
        temperature: sampling temperature the logits are scaled by.
    """
    if temperature != 1.0:
        logits = logits / temperature
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@dataclass
class CompletionForward:
    """Result of :func:`completion_forward`: ``logps`` ``(N, C)`` and, if asked, ``logits`` ``(N, C, V)``."""

    logps: Tensor
    logits: Tensor | None = None


def completion_forward(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    return_logits: bool = False,
    completion_attention_mask: Tensor | None = None,
) -> CompletionForward:
    """Run ``model`` on ``prompt + completion`` and score the completion tokens.

    Returns log-probs of each completion token (at ``temperature``) and optionally the
    ``(N, C, V)`` logits at those positions (temperature-scaled), e.g. for distillation losses.
    ``completion_attention_mask`` (default: ``completion_mask``) is what the model attends to
    in the completion part; multi-turn trajectories attend to observation tokens that the loss
    mask excludes.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    c_att = completion_mask if completion_attention_mask is None else completion_attention_mask
    attention_mask = torch.cat([prompt_mask, c_att], dim=1)
    c = completion_ids.shape[1]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=c + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1, :]
    if temperature != 1.0:
        logits = logits / temperature
    logps = token_logprobs(logits, completion_ids)
    return CompletionForward(logps=logps, logits=logits if return_logits else None)


@torch.no_grad()
def completion_logprobs_no_grad(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 64,
    completion_attention_mask: Tensor | None = None,
) -> Tensor:
    """Detached per-token log-probs (old / reference policy), computed ``chunk_size`` rows at a time."""
    was_training = model.training
    model.eval()
    try:
        parts = []
        for s in range(0, prompt_ids.shape[0], chunk_size):
            sl = slice(s, s + chunk_size)
            parts.append(
                completion_forward(
                    model,
                    prompt_ids[sl],
                    prompt_mask[sl],
                    completion_ids[sl],
                    completion_mask[sl],
                    temperature=temperature,
                    completion_attention_mask=None
                    if completion_attention_mask is None
                    else completion_attention_mask[sl],
                ).logps
            )
    finally:
        model.train(was_training)
    return torch.cat(parts, dim=0)


def sequence_logprob(logps: Tensor, mask: Tensor) -> Tensor:
    """Sum of masked per-token log-probs per row (the sequence log-likelihood)."""
    return (logps * mask).sum(-1)
