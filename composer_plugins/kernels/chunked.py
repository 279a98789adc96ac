"""Memory-efficient log-probs and distillation divergences straight from hidden states.

:func:`chunked_logprobs`, :func:`chunked_distill` and its per-criterion forms walk the tokens in chunks of
``chunk_size`` rows inside a custom :class:`torch.autograd.Function`, so no ``B×T×V`` logits are materialised;
``dL/dlogits`` is closed-form, formed in the forward (``grad_mode="precompute"``, the teachers' top-k,
:mod:`composer_plugins.kernels.fused`) or by recomputing each chunk's logits in backward. Why and how:
docs/losses.md ("Memory-efficient (chunked) versions").

Every matmul runs in the autocast dtype (:func:`compute_dtype`; bf16 under ``torch.autocast``), with
autocast off inside the kernel, so the element-wise math is fp32 and ``dL/dW`` adds into an fp32 buffer.
Peak extra memory is ``O(chunk_size × V)`` instead of ``O(T × V)``; gradients equal the materialised path's up
to floating-point summation order. Only the rows selected by ``mask`` are computed at all.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from composer_plugins.kernels.divergences import EntropyOPDKernel, JSDKernel, Kernel, TAIDKernel, _rowdot, _up

#: Rows per chunk used where a caller asks for a fixed size. At V=151,936 one fp32 chunk of logits is 155 MB.
DEFAULT_CHUNK_SIZE = 256

#: Logit elements one chunk may hold on the CPU (64 MiB in fp32): 96 rows at V=151,936.
CHUNK_ELEMENTS = 1 << 24

#: Rows per chunk on an accelerator when the memory budget allows (Liger's size: matmuls near peak throughput).
CHUNK_ROWS = 1024

#: Share of the accelerator's free memory one chunk's vocabulary-sized buffers may take.
MEMORY_FRACTION = 0.25

#: Bytes per logit a chunk holds at its peak: fp32 logits, one fp32 gradient/probability buffer, a
#: compute-dtype copy of the gradient and the kernels' temporaries.
CHUNK_BYTES_PER_LOGIT = 16


def auto_chunk_size(
    vocab: int, device: Any = None, *, free_bytes: int | None = None, fraction: float = MEMORY_FRACTION
) -> int:
    """Rows per chunk for ``device`` and its memory: a multiple of 16, at least 16.

    On CUDA (or with ``free_bytes`` given): as many rows as ``fraction`` of the free memory
    (``torch.cuda.mem_get_info``) holds at :data:`CHUNK_BYTES_PER_LOGIT` bytes per logit, at most
    :data:`CHUNK_ROWS` (1,024 on an H200 at V=151,936). On the CPU: small, :data:`CHUNK_ELEMENTS`
    logits (96 rows at V=151,936), at most 256 rows.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if free_bytes is None and dev.type == "cuda":
        free_bytes = int(torch.cuda.mem_get_info(dev)[0])
    if free_bytes is not None:
        rows = min(CHUNK_ROWS, int(free_bytes * fraction) // (max(int(vocab), 1) * CHUNK_BYTES_PER_LOGIT))
    else:
        rows = min(256, CHUNK_ELEMENTS // max(int(vocab), 1))
    return max(16, rows - rows % 16)


def resolve_chunk_size(chunk_size: int | None, vocab: int, device: Any = None) -> int:
    """``chunk_size`` when given (must be >= 1), else :func:`auto_chunk_size` for ``device``."""
    if chunk_size is None:
        return auto_chunk_size(vocab, device)
    if int(chunk_size) < 1:
        raise ValueError(
            f"chunk_size must be >= 1 (or None for a size chosen from the device's memory), got {chunk_size}"
        )
    return int(chunk_size)


_REDUCTIONS = ("batchmean", "sum", "mean", "token", "none")


def _acc(weight: Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 weights, float32 otherwise."""
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The matmul dtype: autocast's on ``weight``'s device when it is on (bf16), else ``weight``'s own."""
    dev = weight.device.type
    on = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
    return torch.get_autocast_dtype(dev) if on else weight.dtype


def _manual(weight: Tensor) -> Any:
    """Autocast off inside a kernel: it casts its matmuls itself, and its element-wise math stays fp32."""
    dev = weight.device.type
    return torch.autocast(dev, enabled=False) if torch.amp.is_autocast_available(dev) else contextlib.nullcontext()


def _logits(h: Tensor, wc: Tensor, tau: float = 1.0) -> Tensor:
    """One chunk's logits ``h @ wc.T / tau``: the product in the compute dtype ``wc.dtype``, upcast to fp32 first
    (a bf16 division writing into fp32 would round the quotient to bf16)."""
    z = _up(h.to(wc.dtype) @ wc.T)
    return z.div_(tau) if tau != 1.0 else z


def scale_saved(ctx: Any, grad_total: Tensor, what: str, fix: str) -> tuple[Tensor | None, Tensor | None]:
    """The gradients a kernel formed in its forward (``ctx.grads``), scaled in place by ``grad_total`` (once)."""
    if ctx.grads is None:
        raise RuntimeError(f"{what} supports one backward pass per forward; {fix}")
    grads, ctx.grads = ctx.grads, None  # scaled in place: no second V×H buffer
    for g in grads:
        if g is not None:
            g.mul_(grad_total.to(g.dtype))
    return grads


def _heads(weight: Tensor, t_weight: Tensor, cd: torch.dtype) -> tuple[Tensor, Tensor]:
    """The student's and the teacher's heads in the compute dtype (one copy when they share storage)."""
    wc = weight.detach().to(cd)
    same = t_weight.data_ptr() == weight.data_ptr() and t_weight.shape == weight.shape
    return wc, (wc if same else t_weight.to(cd))


def _add_chunk_grads(
    g: Tensor, h: Tensor, wc: Tensor, grad_h: Tensor | None, grad_w: Tensor | None, s: int, e: int
) -> None:
    """Back through ``z = h @ W.T`` for rows ``s:e`` (``g`` is dL/dz): write dL/dh, add dL/dW.

    Both products run in the compute dtype ``wc.dtype``; dL/dW adds into ``grad_w``'s fp32 buffer (a bf16
    product under autocast; in place when the compute dtype is the buffer's).
    """
    gc = g.to(wc.dtype)
    if grad_h is not None:
        grad_h[s:e] = gc @ wc
    if grad_w is not None and grad_w.dtype == wc.dtype:  # fp32 compute: in place, no V×H temporary
        grad_w.addmm_(gc.T, h.to(wc.dtype))
    elif grad_w is not None:
        grad_w.add_(gc.T @ h.to(wc.dtype))


def _precomputed(
    ctx: Any,
    hidden: Tensor,
    weight: Tensor,
    t_weight: Tensor,
    chunk_size: int,
    scale: float,
    token_weight: Tensor | None,
    chunk: Any,
) -> tuple[Tensor, list[Tensor]]:
    """``scale · Σ_rows token_weight · value`` over row chunks of ``hidden``, with the gradients formed meanwhile
    into ``ctx.grads`` (backward only scales them: :func:`scale_saved`), and each chunk's stats.

    ``chunk(s, e, wc, twc, go)`` gives rows ``s:e``'s ``(values, dL/dlogits or None, stats or None)`` from the
    student's and the teacher's heads in the compute dtype (:func:`_heads`) and ``go``, the rows' upstream
    gradient (None when no gradient is needed).
    """
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    n, acc = hidden.shape[0], _acc(weight)
    total = torch.zeros((), dtype=acc, device=hidden.device)
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    stats: list[Tensor] = []
    cd = compute_dtype(weight)
    with _manual(weight):
        wc, twc = _heads(weight, t_weight, cd)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            w = None if token_weight is None else token_weight[s:e].to(acc)
            go = None
            if need_h or need_w:
                go = torch.full((e - s,), scale, dtype=acc, device=hidden.device) if w is None else w * scale
            val, g, st = chunk(s, e, wc, twc, go)
            if st is not None:
                stats.append(st)
            if g is not None:
                _add_chunk_grads(g, hidden[s:e], wc, grad_h, grad_w, s, e)
                del g
            total += (val.sum() if w is None else (val * w).sum()) * scale
    ctx.grads = (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None)
    return total, stats


def _check_hidden(name: str, hidden: Tensor, weight: Tensor) -> None:
    if hidden.dim() < 2:
        raise ValueError(f"{name} must be (..., H) hidden states, got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"lm_head_weight must be (V, H), got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{name} hidden size {hidden.shape[-1]} does not match lm_head_weight (V, H)={tuple(weight.shape)}"
        )


def _flat_rows(hidden: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(..., H) -> (N, H) rows, keeping only ``mask`` rows when given; also the flat row index."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if mask is None:
        return flat, None
    idx = mask.reshape(-1).nonzero(as_tuple=True)[0]
    return flat.index_select(0, idx), idx


# -- log-probs -------------------------------------------------------------------------------------
def _chunk_logprobs(
    h: Tensor, wc: Tensor, ids: Tensor, tau: float, with_ent: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """One chunk: ``(exp(z - max) in the logits' buffer, its row sums, log-probs of ids, logsumexp, entropy)``."""
    z = _logits(h, wc, tau)
    picked = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    mx = z.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    z.sub_(mx)
    ent = None
    if with_ent:  # entropy = log S - <exp(z'), z'> / S  with z' = z - max, S = sum exp(z')
        w = z.exp()
        ssum = w.sum(-1)
        ent = ssum.log() - _rowdot(w, z) / ssum
        z = w
    else:
        ssum = z.exp_().sum(-1)
    lse = ssum.log() + mx.squeeze(-1)
    return z, ssum, picked - lse, lse, ent


def _dlogits_(w: Tensor, ssum: Tensor | None, ids: Tensor, g: Tensor, tau: float) -> Tensor:
    """``g · (onehot(ids) - p) / tau`` in ``w``'s buffer, ``p = w / ssum`` (``ssum`` None: ``w`` is ``p``)."""
    gt = g.to(w.dtype) / tau if tau != 1.0 else g.to(w.dtype)
    w.mul_((-gt if ssum is None else -gt / ssum).unsqueeze(-1))
    return w.scatter_add_(-1, ids.unsqueeze(-1), gt.unsqueeze(-1))


def _logprob_grads(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    lse: Tensor,
    grad: Tensor,
    bounds: list[tuple[int, int]],
    tau: float,
    cd: torch.dtype,
    need: tuple[bool, bool],
) -> tuple[Tensor | None, Tensor | None]:
    """dL/dhidden and dL/dW of per-token log-probs with upstream ``grad``, recomputing each chunk's logits."""
    grad_h = torch.empty_like(hidden) if need[0] else None
    grad_w = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device) if need[1] else None
    with _manual(weight):
        wc = weight.detach().to(cd)
        for s, e in bounds:
            p = _logits(hidden[s:e], wc, tau).sub_(lse[s:e].unsqueeze(-1)).exp_()
            _add_chunk_grads(_dlogits_(p, None, ids[s:e], grad[s:e], tau), hidden[s:e], wc, grad_h, grad_w, s, e)
            del p
    return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None)


class _ChunkedLogProbs(torch.autograd.Function):
    """Selected-token log-probs ``log softmax(h W^T / T)[ids]`` over row chunks; recomputes in backward.

    For a generic per-token output, whose loss is unknown here: four matmuls per chunk (logits, their
    recompute, dL/dh, dL/dW). :func:`fused_logprobs` needs three when the loss is row-separable.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, ids: Tensor, chunk_size: int, temperature: float, with_ent: bool
    ) -> tuple[Tensor, Tensor]:
        n, acc = hidden.shape[0], _acc(weight)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n if with_ent else 0, dtype=acc, device=hidden.device)
        lse_all = torch.empty(n, dtype=acc, device=hidden.device)
        ctx.cd = compute_dtype(weight)
        with _manual(weight):
            wc = weight.detach().to(ctx.cd)
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                _, _, logp[s:e], lse_all[s:e], en = _chunk_logprobs(hidden[s:e], wc, ids[s:e], temperature, with_ent)
                if en is not None:
                    ent[s:e] = en
        ctx.save_for_backward(hidden, weight, ids, lse_all)
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, ids, lse_all = ctx.saved_tensors
        n, cs = hidden.shape[0], ctx.chunk_size
        bounds = [(s, min(s + cs, n)) for s in range(0, n, cs)]
        gh, gw = _logprob_grads(
            hidden, weight, ids, lse_all, grad_logp, bounds, ctx.temperature, ctx.cd, ctx.needs_input_grad[:2]
        )
        return gh, gw, None, None, None, None


def chunked_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    ids: Tensor,
    *,
    mask: Tensor | None = None,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probs of ``ids`` under ``softmax(hidden @ lm_head_weight.T / temperature)``.

    Equals ``selective_log_softmax(hidden @ W.T / temperature, ids)`` (values and gradients with
    respect to ``hidden`` and ``lm_head_weight``) without materialising the ``(..., V)`` logits.

    Args:
        hidden: ``(..., H)`` final hidden states at the positions that *predict* ``ids`` (``(...)``).
        mask: optional ``(...)`` bool/0-1 mask; unmasked positions are not computed and return 0.
        chunk_size: rows of logits alive at once (None: :func:`auto_chunk_size` of the vocabulary).
        return_entropy: also return the per-token entropy of the distribution (no gradient).

    Returns:
        ``(...)`` float32 log-probs, or ``(logprobs, entropy)`` when ``return_entropy``.
    """
    _check_hidden("hidden", hidden, lm_head_weight)
    if ids.shape != hidden.shape[:-1]:
        raise ValueError(f"ids shape {tuple(ids.shape)} must equal hidden.shape[:-1] = {tuple(hidden.shape[:-1])}")
    if mask is not None and mask.shape != ids.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal ids shape {tuple(ids.shape)}")
    chunk_size = resolve_chunk_size(chunk_size, lm_head_weight.shape[0], hidden.device)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows, idx = _flat_rows(hidden, mask)
    flat_ids = ids.reshape(-1) if idx is None else ids.reshape(-1).index_select(0, idx)
    logp, ent = _ChunkedLogProbs.apply(
        rows, lm_head_weight, flat_ids.long(), int(chunk_size), float(temperature), bool(return_entropy)
    )

    def placed(v: Tensor) -> Tensor:  # back at the rows' places (0 off the mask), in the shape of ids
        return (v if idx is None else v.new_zeros(ids.numel()).index_put((idx,), v)).reshape(ids.shape)

    return (placed(logp), placed(ent)) if return_entropy else placed(logp)


# -- distillation divergences ----------------------------------------------------------------------
class _ChunkedDistill(torch.autograd.Function):
    """Per-token ``kernel(student_logits, teacher_logits)`` over row chunks; recomputes in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        s_hidden: Tensor,
        weight: Tensor,
        t_hidden: Tensor,
        t_weight: Tensor,
        kernel: Kernel,
        chunk_size: int,
        with_stats: bool,
    ) -> tuple[Tensor, Tensor]:
        n = s_hidden.shape[0]
        out = torch.empty(n, dtype=_acc(weight), device=s_hidden.device)
        stats_chunks: list[Tensor] = []
        ctx.cd = cd = compute_dtype(weight)
        with _manual(weight):
            wc, twc = _heads(weight, t_weight, cd)
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                val, _, st = kernel.compute(_logits(s_hidden[s:e], wc), _logits(t_hidden[s:e], twc), None, with_stats)
                out[s:e] = val
                if st is not None:
                    stats_chunks.append(st)
        stats = torch.cat(stats_chunks) if stats_chunks else out.new_zeros((n, 0))
        ctx.save_for_backward(s_hidden, weight, t_hidden, t_weight)
        ctx.kernel = kernel
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(stats)
        return out, stats

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, grad_stats: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        s_hidden, weight, t_hidden, t_weight = ctx.saved_tensors
        kernel: Kernel = ctx.kernel
        cs = ctx.chunk_size
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(s_hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device) if need_w else None
        n = s_hidden.shape[0]
        with _manual(weight):
            wc, twc = _heads(weight, t_weight, ctx.cd)
            for s in range(0, n, cs):
                e = min(s + cs, n)
                h = s_hidden[s:e]
                _, g, _ = kernel.compute(_logits(h, wc), _logits(t_hidden[s:e], twc), grad_out[s:e])  # consumes both
                assert g is not None
                _add_chunk_grads(g, h, wc, grad_h, grad_w, s, e)
                del g
        gw = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_h, gw, None, None, None, None, None


class _PrecomputedDistill(torch.autograd.Function):
    """``scale · Σ_i kernel_i`` whose gradients are formed *during* the forward pass.

    Valid when every token has the same weight in the loss (``batchmean``/``sum``/``mean``): the
    gradient of the scalar is then ``grad_output × (precomputed gradient)``, so no chunk has to be
    recomputed in backward. Same memory bound as the recompute path (``O(chunk × V)`` plus the
    ``V × H`` weight gradient, which is allocated in forward instead of backward) and two fewer
    logits matmuls per chunk.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        s_hidden: Tensor,
        weight: Tensor,
        t_hidden: Tensor,
        t_weight: Tensor,
        kernel: Kernel,
        chunk_size: int,
        with_stats: bool,
        scale: float,
        token_weight: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        def chunk(s: int, e: int, wc: Tensor, twc: Tensor, go: Tensor | None) -> Any:
            return kernel.compute(_logits(s_hidden[s:e], wc), _logits(t_hidden[s:e], twc), go, with_stats)

        total, chunks = _precomputed(ctx, s_hidden, weight, t_weight, chunk_size, scale, token_weight, chunk)
        stats = torch.cat(chunks) if chunks else total.new_zeros((s_hidden.shape[0], 0))
        ctx.mark_non_differentiable(stats)
        return total, stats

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, grad_stats: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        fix = "use grad_mode='recompute' to backpropagate through it more than once"
        return *scale_saved(ctx, grad_total, "chunked distillation with grad_mode='precompute'", fix), *[None] * 7


def reduction_denominator(reduction: str, n: int, masked: bool, shape: torch.Size, vocab: int) -> int:
    """What the scalar ``reduction`` divides the sum of ``n`` per-token values by (``masked``: a mask chose them)."""
    if reduction == "batchmean":
        # TRL GKD semantics: with a mask, the number of masked tokens (at least 1); without one, the batch dimension
        return max(n, 1) if masked else max(int(shape[0]) if len(shape) else 1, 1)
    # mean: element-wise over (tokens × vocabulary), as F.kl_div(reduction="mean") / TRL
    return max(n * vocab, 1) if reduction == "mean" else 1


def _reduce(per_token: Tensor, idx: Tensor | None, shape: torch.Size, reduction: str, vocab: int) -> Tensor:
    if reduction in ("token", "none"):
        if idx is not None:
            per_token = per_token.new_zeros(int(torch.Size(shape).numel())).index_put((idx,), per_token)
        return per_token.reshape(shape)
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / reduction_denominator(reduction, per_token.shape[0], idx is not None, shape, vocab)


def chunked_distill(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head_weight: Tensor,
    kernel: Kernel,
    mask: Tensor | None = None,
    *,
    teacher_lm_head_weight: Tensor | None = None,
    chunk_size: int | None = None,
    reduction: str = "batchmean",
    return_stats: bool = False,
    grad_mode: str = "recompute",
    token_weight: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reduce ``kernel`` over the masked tokens, computing logits chunk by chunk.

    The teacher side gets no gradient (``teacher_hidden`` and its weight are detached).

    Args:
        teacher_hidden: ``(..., H)`` aligned to the same tokens as ``student_hidden``.
        kernel: a per-token divergence from :mod:`composer_plugins.kernels.divergences`.
        teacher_lm_head_weight: teacher LM head when different from the student's (default: same, detached).
        reduction: ``batchmean`` (sum / #masked tokens, or / batch size without a mask — TRL GKD),
            ``sum``, ``mean`` (sum / (#tokens × V)), or ``token``/``none`` (per-token ``(...)`` tensor, 0 off-mask).
        return_stats: also return the kernel's per-token statistics ``(N, k)`` for the masked rows.
        grad_mode: ``"recompute"`` (default) or ``"precompute"`` (scalar reductions only; one backward per
            forward), docs/losses.md ("Memory-efficient (chunked) versions").
        token_weight: optional ``(...)`` per-token weights (no gradient; e.g. importance ratios): each
            token's divergence is multiplied by its weight before the reduction, whose denominator is
            unchanged (``batchmean``: still the number of masked tokens).
    """
    _check_hidden("student_hidden", student_hidden, lm_head_weight)
    if teacher_hidden.shape != student_hidden.shape:
        raise ValueError(
            f"teacher_hidden shape {tuple(teacher_hidden.shape)} must equal student_hidden shape "
            f"{tuple(student_hidden.shape)} (align the teacher's positions to the student's tokens)"
        )
    t_weight = (teacher_lm_head_weight if teacher_lm_head_weight is not None else lm_head_weight).detach()
    if t_weight.shape[0] != lm_head_weight.shape[0]:
        raise ValueError("teacher and student LM heads must share the vocabulary size")
    if mask is not None and tuple(mask.shape) != tuple(student_hidden.shape[:-1]):
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal student_hidden.shape[:-1] = {tuple(student_hidden.shape[:-1])}"
        )
    chunk_size = resolve_chunk_size(chunk_size, lm_head_weight.shape[0], student_hidden.device)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; valid: {', '.join(_REDUCTIONS)}")
    if grad_mode not in ("recompute", "precompute"):
        raise ValueError(f"unknown grad_mode {grad_mode!r}; valid: 'recompute', 'precompute'")
    m = mask.bool() if mask is not None else None
    s_rows, idx = _flat_rows(student_hidden, m)
    t_rows, _ = _flat_rows(teacher_hidden.detach(), m)
    w_rows: Tensor | None = None
    if token_weight is not None:
        if tuple(token_weight.shape) != tuple(student_hidden.shape[:-1]):
            raise ValueError(
                f"token_weight shape {tuple(token_weight.shape)} must equal student_hidden.shape[:-1] = "
                f"{tuple(student_hidden.shape[:-1])}"
            )
        flat_w = token_weight.detach().reshape(-1)
        w_rows = flat_w if idx is None else flat_w.index_select(0, idx)
    if grad_mode == "precompute":
        if reduction not in ("batchmean", "sum", "mean"):
            raise ValueError(
                f"grad_mode='precompute' needs a scalar reduction (batchmean, sum, mean), not {reduction!r}"
            )
        shape, vocab = student_hidden.shape[:-1], lm_head_weight.shape[0]
        denom = reduction_denominator(reduction, s_rows.shape[0], idx is not None, shape, vocab)
        total, stats = _PrecomputedDistill.apply(
            s_rows, lm_head_weight, t_rows, t_weight, kernel, int(chunk_size), bool(return_stats), 1.0 / denom, w_rows
        )
        return (total, stats) if return_stats else total
    per_token, stats = _ChunkedDistill.apply(
        s_rows, lm_head_weight, t_rows, t_weight, kernel, int(chunk_size), bool(return_stats)
    )
    if w_rows is not None:
        per_token = per_token * w_rows.to(per_token.dtype)
    out = _reduce(per_token, idx, student_hidden.shape[:-1], reduction, lm_head_weight.shape[0])
    if return_stats:
        return out, stats
    return out


def _chunked_scalar(hs: Tensor, ht: Tensor, w: Tensor, kernel: Kernel, mask: Tensor | None, **kw: Any) -> Tensor:
    out = chunked_distill(hs, ht, w, kernel, mask, **kw)
    assert isinstance(out, Tensor)
    return out


def chunked_generalized_jsd(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head_weight: Tensor,
    mask: Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    **kw: Any,
) -> Tensor:
    """:func:`~composer_plugins.losses.functional.generalized_jsd` from hidden states, chunked.

    Same value and gradients as ``generalized_jsd(student_hidden @ W.T, (teacher_hidden @ W.T).detach(),
    mask, beta, temperature, reduction)`` with ``O(chunk_size × V)`` peak memory. ``kw``: ``reduction``,
    ``chunk_size``, ``teacher_lm_head_weight`` and ``grad_mode`` of :func:`chunked_distill` (as in the two below).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    kernel = JSDKernel(beta=float(beta), temperature=float(temperature))
    return _chunked_scalar(student_hidden, teacher_hidden, lm_head_weight, kernel, mask, **kw)


def chunked_taid_loss(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head_weight: Tensor,
    mask: Tensor | None,
    t: float | Tensor,
    **kw: Any,
) -> Tensor:
    """:func:`~composer_plugins.losses.functional.taid_loss` from hidden states, chunked (token mean over ``mask``)."""
    if mask is None:
        mask = torch.ones(student_hidden.shape[:-1], dtype=torch.bool, device=student_hidden.device)
    return _chunked_scalar(student_hidden, teacher_hidden, lm_head_weight, TAIDKernel(t=float(t)), mask, **kw)


def chunked_entropy_aware_opd(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head_weight: Tensor,
    mask: Tensor | None = None,
    *,
    entropy_threshold: float = 0.8,
    fkl_weight: float = 1.0,
    top_k: int | None = None,
    temperature: float = 1.0,
    **kw: Any,
) -> Tensor:
    """:func:`~composer_plugins.losses.functional.entropy_aware_opd` from hidden states, chunked."""
    kernel = EntropyOPDKernel(
        entropy_threshold=float(entropy_threshold),
        fkl_weight=float(fkl_weight),
        top_k=top_k,
        temperature=float(temperature),
    )
    return _chunked_scalar(student_hidden, teacher_hidden, lm_head_weight, kernel, mask, **kw)
