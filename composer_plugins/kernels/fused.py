"""Log-probs whose LM-head gradients are formed in the forward pass, for a row-separable loss.

:func:`fused_logprobs` is :func:`~composer_plugins.kernels.chunked.chunked_logprobs` for the training
step's rollout rows when every loss reading them is a sum of per-row terms (the GRPO family, DPPO):
chunks hold whole rows, and each chunk's ``dL/dlogprobs`` comes from that loss while its logits are
alive, so a chunk costs three matmuls (logits, dL/dhidden, dL/dW) instead of four.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from composer_plugins.kernels.chunked import (
    _acc,
    _add_chunk_grads,
    _check_hidden,
    _chunk_logprobs,
    _dlogits_,
    _flat_rows,
    _logprob_grads,
    _manual,
    compute_dtype,
    resolve_chunk_size,
)


class _FusedLogProbs(torch.autograd.Function):
    """:func:`fused_logprobs`'s kernel: ``loss_of(s, e, logp_chunk)`` gives a chunk's dL/dlogp in the forward;
    backward scales the saved gradients when the upstream gradient is that one times a scalar (a loss scale, an
    accumulation divisor), else (a loss that is not row-separable) recomputes them exactly."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, ids: Tensor, bounds: list[tuple[int, int]], loss_of: Any, tau: float
    ) -> Tensor:
        n, acc = hidden.shape[0], _acc(weight)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        lse_all = torch.empty(n, dtype=acc, device=hidden.device)
        g_all = torch.zeros(n, dtype=acc, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        ctx.cd = compute_dtype(weight)
        with _manual(weight):
            wc = weight.detach().to(ctx.cd)
            for s, e in bounds:
                w, ssum, lp, lse_all[s:e], _ = _chunk_logprobs(hidden[s:e], wc, ids[s:e], tau, False)
                logp[s:e] = lp
                if need_h or need_w:
                    with torch.enable_grad():
                        live = lp.detach().requires_grad_(True)
                        loss = loss_of(s, e, live)
                        g = torch.autograd.grad(loss, live, allow_unused=True)[0] if loss.requires_grad else None
                    if g is not None:
                        g_all[s:e] = g
                        _add_chunk_grads(_dlogits_(w, ssum, ids[s:e], g, tau), hidden[s:e], wc, grad_h, grad_w, s, e)
                del w
        ctx.save_for_backward(hidden, weight, ids, lse_all)
        ctx.bounds, ctx.tau = bounds, tau
        ctx.grads = (grad_h, grad_w, g_all)
        return logp

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_h, grad_w, g_pre = ctx.grads
        ctx.grads = None
        go = grad_logp.to(g_pre.dtype)
        den = (g_pre * g_pre).sum()
        c = (go * g_pre).sum() / den if float(den) > 0 else den
        top = float(go.abs().max()) if go.numel() else 0.0
        if bool(torch.allclose(go, c * g_pre, rtol=1e-4, atol=1e-6 * top)):
            if grad_h is not None:
                grad_h.mul_(c.to(grad_h.dtype))
            gw = grad_w.mul_(c).to(ctx.saved_tensors[1].dtype) if grad_w is not None else None
            return grad_h, gw, None, None, None, None
        warnings.warn(
            "fused_logprobs: the log-probs' gradient is not the one their loss_fn predicted (a loss that is not "
            "row-separable, or other terms on them); recomputing the LM-head gradients exactly (four matmuls a chunk)",
            RuntimeWarning,
            stacklevel=2,
        )
        hidden, weight, ids, lse = ctx.saved_tensors
        gh, gw = _logprob_grads(hidden, weight, ids, lse, go, ctx.bounds, ctx.tau, ctx.cd, ctx.needs_input_grad[:2])
        return gh, gw, None, None, None, None


def row_bounds(mask: Tensor, chunk_size: int) -> list[tuple[int, int]]:
    """Ranges of the flat masked tokens (row-major) that hold whole rows, each at most ``chunk_size`` tokens
    unless one row alone has more (it is then a chunk of its own)."""
    out: list[tuple[int, int]] = []
    s = e = 0
    for c in mask.reshape(mask.shape[0], -1).sum(-1).tolist():
        if e > s and e - s + int(c) > chunk_size:
            out.append((s, e))
            s = e
        e += int(c)
    if e > s:
        out.append((s, e))
    return out


def fused_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    ids: Tensor,
    mask: Tensor,
    loss_fn: Any,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """:func:`chunked_logprobs` of ``(B, T)`` tokens whose gradients are formed in the forward pass.

    ``loss_fn(logprobs (B, T)) -> scalar`` is the loss the log-probs feed, which must be **row-separable**:
    a sum of per-row terms, each depending only on its own row's log-probs (batch-wide constants such as
    token counts are fine; a per-sequence ratio is fine, since chunks hold whole rows). Per chunk the
    kernel calls it with that chunk's rows live (the others held fixed) to get dL/dlogprobs, so one
    chunk costs three matmuls instead of four. The returned log-probs equal :func:`chunked_logprobs`'s
    (0 off ``mask``); feed them to that same loss: backward then only scales the gradients it saved.
    """
    _check_hidden("hidden", hidden, lm_head_weight)
    if ids.shape != hidden.shape[:-1] or mask.shape != ids.shape or ids.dim() != 2:
        raise ValueError(
            f"fused_logprobs: hidden {tuple(hidden.shape)}, ids {tuple(ids.shape)} and mask {tuple(mask.shape)} "
            "must be (B, T, H), (B, T), (B, T)"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    cs = resolve_chunk_size(chunk_size, lm_head_weight.shape[0], hidden.device)
    m = mask.bool()
    rows, idx = _flat_rows(hidden, m)
    assert idx is not None
    flat_ids = ids.reshape(-1).index_select(0, idx).long()

    def loss_of(s: int, e: int, live: Tensor) -> Tensor:
        full = live.new_zeros(ids.numel()).index_put((idx[s:e],), live)
        return loss_fn(full.reshape(ids.shape))

    logp = _FusedLogProbs.apply(rows, lm_head_weight, flat_ids, row_bounds(m, cs), loss_of, float(temperature))
    return logp.new_zeros(ids.numel()).index_put((idx,), logp).reshape(ids.shape)
