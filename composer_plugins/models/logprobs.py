"""Per-token log-probabilities of completions under a causal LM (utilities, not losses).

Two paths: **hidden states** (what training uses): :func:`completion_hidden` runs the decoder body (no LM
head) micro-batch by micro-batch and :func:`completion_logprobs` takes the log-probs through the LM head
chunk by chunk (:func:`~composer_plugins.kernels.chunked.chunked_logprobs`), so no ``rows × tokens × vocab``
tensor exists, and activation checkpointing is the model's own, per decoder layer; **materialised**
(:func:`completion_forward`): the ``(N, C, V)`` logits at the completion positions, the reference the
hidden-state path is tested against. Position ids are derived from the attention mask exactly as HF
``generate`` does for left-padded prompts, so training-time log-probs match sampling-time ones.
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
    """``log softmax(logits / T)[labels]`` without materialising the full log-softmax tensor."""
    if temperature != 1.0:
        logits = logits / temperature
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sequence_inputs(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    completion_attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, attention_mask, position_ids)`` of left-padded prompts followed by right-padded completions.

    ``completion_attention_mask`` (default: ``completion_mask``) is what the model attends to in the
    completion part; multi-turn trajectories attend to observation tokens that the loss mask excludes.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    c_att = completion_mask if completion_attention_mask is None else completion_attention_mask
    attention_mask = torch.cat([prompt_mask, c_att.to(prompt_mask.dtype)], dim=1)
    return input_ids, attention_mask, position_ids_from_mask(attention_mask)


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
    ``completion_attention_mask``: as in :func:`sequence_inputs`.
    """
    input_ids, attention_mask, position_ids = sequence_inputs(
        prompt_ids, prompt_mask, completion_ids, completion_mask, completion_attention_mask
    )
    c = completion_ids.shape[1]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=c + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1, :]
    if temperature != 1.0:
        logits = logits / temperature
    logps = token_logprobs(logits, completion_ids)
    return CompletionForward(logps=logps, logits=logits if return_logits else None)


# -- hidden-state path -----------------------------------------------------------------------------


def lm_head_weight(model: Any) -> Tensor:
    """The ``(V, H)`` output-embedding matrix whose product with the final hidden states gives the logits.

    Raises ``ValueError`` for heads the chunked path cannot reproduce exactly (a bias, logit
    soft-capping, a logit scale), naming the model and the setting.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), Tensor):
        raise ValueError(
            f"{type(model).__name__} has no output embeddings (get_output_embeddings() gave {head!r}); "
            "training needs a causal LM with an LM head (an AutoModelForCausalLM)"
        )
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}: an LM head with a bias is not supported by the chunked loss path")
    cfg = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        v = getattr(cfg, attr, None)
        if v not in (None, 1, 1.0):
            raise ValueError(
                f"{type(model).__name__}: config.{attr}={v} transforms the logits after the LM head, which the "
                "chunked loss path does not reproduce; use a model without it"
            )
    return head.weight


def decoder_body(model: Any) -> Any:
    """The model without its LM head (HF ``base_model``), whose ``last_hidden_state`` feeds the head."""
    body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise ValueError(
            f"{type(model).__name__} exposes no decoder body (base_model); training needs a Hugging Face "
            "causal LM whose base_model returns last_hidden_state"
        )
    return body


def micro_batches(n: int, size: int | None) -> list[slice]:
    """Row slices of at most ``size`` rows (one slice of all ``n`` rows when ``size`` is None or >= n)."""
    if size is None or size >= n:
        return [slice(0, n)]
    if size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {size}")
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def completion_hidden(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    completion_attention_mask: Tensor | None = None,
    micro_batch_size: int | None = None,
) -> Tensor:
    """``(N, C, H)`` final hidden states at the positions predicting each completion token.

    The body runs ``micro_batch_size`` rows at a time, each a plain forward: what it keeps for backward
    is the model's choice (with HF gradient checkpointing on, each decoder layer's input; its activations
    are recomputed one layer at a time in backward).
    """
    input_ids, attention_mask, position_ids = sequence_inputs(
        prompt_ids, prompt_mask, completion_ids, completion_mask, completion_attention_mask
    )
    body = decoder_body(model)
    c = completion_ids.shape[1]

    def run(ids: Tensor, att: Tensor, pos: Tensor) -> Tensor:
        out = body(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False)
        return out.last_hidden_state[:, -(c + 1) : -1].contiguous()

    slices = micro_batches(input_ids.shape[0], micro_batch_size)
    if len(slices) == 1:
        return run(input_ids, attention_mask, position_ids)
    return torch.cat([run(input_ids[sl], attention_mask[sl], position_ids[sl]) for sl in slices], dim=0)


def completion_logprobs(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    completion_attention_mask: Tensor | None = None,
    micro_batch_size: int | None = None,
    chunk_size: int | None = None,
    return_hidden: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probs ``(N, C)`` of the completion tokens at ``temperature``, from hidden states.

    Positions outside ``completion_mask`` are not computed and hold 0. Differentiable (with
    respect to every parameter) when gradients are enabled; ``return_hidden`` also returns the
    ``(N, C, H)`` hidden states they came from (e.g. for a distillation channel on the same rows).
    """
    from composer_plugins.kernels.chunked import chunked_logprobs

    hidden = completion_hidden(
        model,
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        completion_attention_mask=completion_attention_mask,
        micro_batch_size=micro_batch_size,
    )
    logps = chunked_logprobs(
        hidden,
        lm_head_weight(model),
        completion_ids,
        mask=completion_mask.bool(),
        chunk_size=chunk_size,
        temperature=temperature,
    )
    assert isinstance(logps, Tensor)
    return (logps, hidden) if return_hidden else logps


@torch.no_grad()
def completion_logprobs_no_grad(
    model: Any,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    micro_batch_size: int | None = 64,
    chunk_size: int | None = None,
    completion_attention_mask: Tensor | None = None,
) -> Tensor:
    """Detached per-token log-probs (old / reference policy) in eval mode, ``micro_batch_size`` rows at a time.

    Chunked from hidden states (:func:`completion_logprobs`); 0 off ``completion_mask``.
    """
    was_training = model.training
    model.eval()
    try:
        parts = []
        for sl in micro_batches(prompt_ids.shape[0], micro_batch_size):
            lp = completion_logprobs(
                model,
                prompt_ids[sl],
                prompt_mask[sl],
                completion_ids[sl],
                completion_mask[sl],
                temperature=temperature,
                completion_attention_mask=None if completion_attention_mask is None else completion_attention_mask[sl],
                chunk_size=chunk_size,
            )
            assert isinstance(lp, Tensor)
            parts.append(lp)
    finally:
        model.train(was_training)
    return torch.cat(parts, dim=0)


def sequence_logprob(logps: Tensor, mask: Tensor) -> Tensor:
    """Sum of masked per-token log-probs per row (the sequence log-likelihood)."""
    return (logps * mask).sum(-1)
