"""Distillation from teachers that send only their top-k log-probs per token (on-policy distillation).

The teacher side of a batch is :class:`TeacherTopK`: for ``N`` teachers, per row and student token, each
teacher's ``K`` most likely ids, their log-probs and a mask of the positions it scored; nothing of size
``rows × tokens × vocab`` exists on the teacher side. Several teachers are merged per token, inside each
chunk (:func:`merge_teachers`), into their weighted mixture over the union of their ids plus a tail bucket;
:func:`agreement_mask` keeps the positions where ``k`` teachers' top-1 agree; bad scores are dropped and
counted in :class:`TeacherDistillOutput`. The rules: docs/losses.md ("Several teachers").

:func:`chunked_teacher_distill` walks the student's hidden states in chunks of rows (the ``(chunk, V)``
logits are the only vocabulary-sized buffer) and forms the gradients during the forward pass;
:func:`teacher_distill_reference` is the same loss from materialised logits, differentiated by autograd
(the plain path it is tested against).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from composer_plugins.kernels.chunked import _acc, _check_hidden, _logits, _precomputed, resolve_chunk_size, scale_saved
from composer_plugins.kernels.divergences import (
    TAIL_FLOOR,
    TEACHER_LOGPROB_FLOOR,
    TeacherTopKKernel,
    _log1mexp,
    bucket_divergence,
)


@dataclass
class TeacherTopK:
    """The teachers' top-k scores of a batch of student completions, as tensors.

    Attributes:
        ids: ``(B, N, T, K)`` token ids in the **student's** vocabulary; ``-1`` (or ``>= V``) = no
            entry (a teacher with fewer than ``K`` ids at a position, or a position it did not score).
        logprobs: ``(B, N, T, K)`` the teachers' log-probs of those ids (any float dtype).
        mask: ``(B, N, T)`` bool: the positions each teacher scored.
        names: the ``N`` teachers' names (the channel's ``weights`` are looked up by them).
    """

    ids: Tensor
    logprobs: Tensor
    mask: Tensor
    names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.ids.dim() != 4 or tuple(self.logprobs.shape) != tuple(self.ids.shape):
            raise ValueError(
                f"teacher scores: ids {tuple(self.ids.shape)} and logprobs {tuple(self.logprobs.shape)} must both "
                "be (B, N teachers, T, K)"
            )
        if tuple(self.mask.shape) != tuple(self.ids.shape[:3]):
            raise ValueError(
                f"teacher scores: mask {tuple(self.mask.shape)} must be (B, N, T) = {tuple(self.ids.shape[:3])}"
            )
        if self.names and len(self.names) != self.ids.shape[1]:
            raise ValueError(f"teacher scores: {len(self.names)} names for {self.ids.shape[1]} teachers")
        if not self.names:
            self.names = tuple(f"teacher{i}" for i in range(self.ids.shape[1]))

    @property
    def nbytes(self) -> int:
        """Bytes held (ids, log-probs and mask)."""
        return sum(t.numel() * t.element_size() for t in (self.ids, self.logprobs, self.mask))

    def rows(self, index: Tensor | Sequence[int]) -> TeacherTopK:
        """The scores of rows ``index`` (a micro-batch)."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.ids.device)
        return TeacherTopK(self.ids[idx], self.logprobs[idx], self.mask[idx], self.names)

    def to(self, device: Any) -> TeacherTopK:
        return TeacherTopK(self.ids.to(device), self.logprobs.to(device), self.mask.to(device), self.names)

    @classmethod
    def from_rows(cls, per_teacher: Mapping[str, Sequence[Any | None]], length: int, device: Any = None) -> TeacherTopK:
        """Pack per-row scores: ``{teacher: [row scores or None, ...]}``, each with ``token_ids`` ``[T_i, K]``,
        ``logprobs`` ``[T_i, K]`` and ``mask`` ``[T_i]`` (a :class:`~composer_plugins.teachers.scoring.TeacherScores`).

        Rows are right-padded to ``length`` tokens and every teacher to the largest ``K``; a row a
        teacher did not score (``None``) has an all-false mask.
        """
        names = tuple(per_teacher)
        if not names:
            raise ValueError("teacher scores: no teacher")
        n_rows = {len(v) for v in per_teacher.values()}
        if len(n_rows) != 1:
            raise ValueError(f"teacher scores: teachers scored different numbers of rows {sorted(n_rows)}")
        B = n_rows.pop()
        K = max([int(s.token_ids.shape[-1]) for v in per_teacher.values() for s in v if s is not None] or [1])
        ids = torch.full((B, len(names), length, K), -1, dtype=torch.long)
        lps = torch.zeros((B, len(names), length, K), dtype=torch.float32)
        mask = torch.zeros((B, len(names), length), dtype=torch.bool)
        for n, name in enumerate(names):
            for b, s in enumerate(per_teacher[name]):
                if s is None:
                    continue
                t = min(int(s.token_ids.shape[0]), length)
                k = int(s.token_ids.shape[-1])
                ids[b, n, :t, :k] = s.token_ids[:t].long()
                lps[b, n, :t, :k] = s.logprobs[:t].float()
                mask[b, n, :t] = s.mask[:t].bool()
        if device is not None:
            ids, lps, mask = ids.to(device), lps.to(device), mask.to(device)
        return cls(ids, lps, mask, names)

    @classmethod
    def from_sampled(
        cls, completion_ids: Tensor, teacher_logprobs: Tensor, mask: Tensor, name: str = "teacher"
    ) -> TeacherTopK:
        """One teacher that reports only its log-prob of each sampled token (PRIME-RL's ``teacher_logprobs``):
        ``K = 1`` with the sampled ids, so each token is a two-way distribution (the token, the rest)."""
        return cls(
            completion_ids.long().unsqueeze(1).unsqueeze(-1),
            teacher_logprobs.unsqueeze(1).unsqueeze(-1),
            mask.bool().unsqueeze(1),
            (name,),
        )


def mixture_weights(names: Sequence[str], weights: Mapping[str, float] | Sequence[float] | None) -> Tensor:
    """The ``N`` teachers' mixture weights: by name from a mapping (absent names weigh 0), or in order.

    A mapping may name teachers the batch lacks (one that missed its deadline): they are simply not
    in the mixture, which is renormalised per token over the teachers present (the channel reports
    them as ``absent/<name>``); the step goes on.
    """
    if weights is None:
        return torch.ones(len(names), dtype=torch.float64)
    if isinstance(weights, Mapping):
        return torch.tensor([float(weights.get(n, 0.0)) for n in names], dtype=torch.float64)
    if len(weights) != len(names):
        raise ValueError(f"{len(weights)} teacher weights for {len(names)} teachers {list(names)}")
    return torch.tensor([float(w) for w in weights], dtype=torch.float64)


def agreement_mask(ids: Tensor, logprobs: Tensor, present: Tensor, min_agree: int) -> Tensor:
    """``(...)`` bool: positions where at least ``min_agree`` of the present teachers share the top-1 id.

    ``ids``, ``logprobs``: ``(..., N, K)``; ``present``: ``(..., N)``.
    """
    valid = ids >= 0
    lp = torch.where(valid, logprobs.float(), torch.full_like(logprobs, -math.inf, dtype=torch.float32))
    top1 = ids.gather(-1, lp.argmax(-1, keepdim=True)).squeeze(-1)  # (..., N)
    ok = present & valid.any(-1)
    same = (top1.unsqueeze(-1) == top1.unsqueeze(-2)) & ok.unsqueeze(-1) & ok.unsqueeze(-2)
    return same.sum(-1).amax(-1) >= int(min_agree)


def merge_teachers(
    ids: Tensor, logprobs: Tensor, present: Tensor, weights: Tensor, vocab: int
) -> tuple[Tensor, Tensor, Tensor]:
    """One distribution per row from ``N`` teachers' top-k: ``(union ids, log-probs + tail, valid)``.

    Args:
        ids: ``(n, N, K)`` ids (``-1`` or ``>= vocab``: none); logprobs: ``(n, N, K)``.
        present: ``(n, N)`` the teachers that scored each row; weights: ``(N,)`` mixture weights,
            renormalised per row over the present teachers.

    Returns:
        ``ids (n, M)`` (``M = N·K``; invalid slots hold 0), ``lt (n, M + 1)``: the mixture's log-prob
        of each id, then of its tail bucket, and ``valid (n, M)``.
    """
    n, N, K = ids.shape
    dt = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    valid = present.unsqueeze(-1) & (ids >= 0) & (ids < vocab)
    lp = logprobs.to(dt).clamp(min=TEACHER_LOGPROB_FLOOR)
    # one path for one teacher and for many: an id repeated within a teacher's top-k (several teacher
    # tokens aligned to one student id) holds the sum of their probabilities, whatever N is
    w = weights.to(device=ids.device, dtype=dt).unsqueeze(0) * present.to(dt)
    w = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(dt).tiny)
    p = torch.where(valid, lp.exp() * w.unsqueeze(-1), torch.zeros_like(lp)).reshape(n, N * K)
    flat = torch.where(valid, ids, torch.full_like(ids, vocab)).reshape(n, N * K)
    srt, order = flat.sort(-1)
    ps = p.gather(-1, order)
    first = torch.ones_like(srt, dtype=torch.bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    grp = first.long().cumsum(-1) - 1
    q = torch.zeros_like(ps).scatter_add_(-1, grp, ps)
    uid = torch.full_like(srt, vocab).scatter_(-1, grp, srt)
    uvalid = uid < vocab
    uid = torch.where(uvalid, uid, torch.zeros_like(uid))
    logq = torch.where(uvalid, q.clamp(min=torch.finfo(dt).tiny).log(), torch.zeros_like(q))
    logq = logq.clamp(min=TEACHER_LOGPROB_FLOOR)
    lse = torch.logsumexp(torch.where(uvalid, logq, torch.full_like(logq, -math.inf)), -1, keepdim=True)
    tail = _log1mexp(lse.clamp(max=-TAIL_FLOOR))
    return uid, torch.cat([logq, tail], -1), uvalid


#: a teacher position whose entries' probabilities (duplicate ids merged: their sum) exceed ``1 + MASS_TOLERANCE``
#: is invalid (a log-prob above 0, a top-k summing above 1): left out of the loss and counted
MASS_TOLERANCE = 1e-2


def usable_entries(ids: Tensor, logprobs: Tensor, vocab: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(ok, nonfinite, invalid)`` for ``(..., K)`` teacher entries: ``ok`` the entries that can be distilled (an
    id in ``[0, vocab)``, a log-prob that is not NaN / ``+inf``, at a valid position), ``nonfinite`` the entries
    with such a log-prob, ``invalid`` ``(...)`` the positions whose probability mass exceeds
    ``1 + MASS_TOLERANCE`` (every entry there is left out)."""
    real = (ids >= 0) if vocab is None else (ids >= 0) & (ids < vocab)
    nonfinite = real & (torch.isnan(logprobs) | (logprobs == math.inf))
    ok = real & ~nonfinite
    mass = torch.where(ok, logprobs.float().exp(), torch.zeros((), device=ids.device)).sum(-1)
    invalid = mass > 1.0 + MASS_TOLERANCE
    return ok & ~invalid.unsqueeze(-1), nonfinite, invalid


@dataclass
class _Rows:
    """The positions to distil, flat: row index, ``ids``/``lps`` ``(n, N, K)``, ``present`` ``(n, N)``, and what
    was left out of the completion tokens' scores (non-finite log-probs, ids outside the vocabulary, positions of
    more than all the probability)."""

    idx: Tensor
    ids: Tensor
    lps: Tensor
    present: Tensor
    nonfinite: int
    out_of_vocab: int
    invalid: int


def _teacher_rows(scores: TeacherTopK, mask: Tensor, min_agree: int | None, vocab: int, mix: Tensor) -> _Rows:
    """The entries that can be distilled (:func:`usable_entries`; the others count as absent, ``-1``), as flat
    rows. A teacher is present at a token when it scored it, has an entry there and its mixture weight is > 0;
    a token is distilled where a teacher is present (and ``min_agree`` holds)."""
    ok, bad, wrong = usable_entries(scores.ids, scores.logprobs, vocab)
    ids = torch.where(ok, scores.ids, torch.full_like(scores.ids, -1))
    lps = torch.where(ok, scores.logprobs, torch.zeros_like(scores.logprobs))
    counted = scores.mask.bool() & mask.bool().unsqueeze(1)
    nonfinite = int((bad & counted.unsqueeze(-1)).sum())
    out_of_vocab = int(((scores.ids >= vocab) & counted.unsqueeze(-1)).sum())
    invalid = int((wrong & counted).sum())
    weighted = (mix > 0).to(scores.mask.device).view(1, -1, 1)
    present = scores.mask.bool() & ok.any(-1) & weighted  # (B, N, T)
    sel = mask.bool() & present.any(1)
    if min_agree is not None and min_agree > 1:
        sel &= agreement_mask(ids.transpose(1, 2), lps.transpose(1, 2), present.transpose(1, 2), min_agree)
    idx = sel.reshape(-1).nonzero(as_tuple=True)[0]
    B, N, T, K = scores.ids.shape
    flat_ids = ids.transpose(1, 2).reshape(B * T, N, K).index_select(0, idx)
    flat_lps = lps.transpose(1, 2).reshape(B * T, N, K).index_select(0, idx)
    pres = present.transpose(1, 2).reshape(B * T, N).index_select(0, idx)
    return _Rows(idx, flat_ids, flat_lps, pres, nonfinite, out_of_vocab, invalid)


class _TeacherDistill(torch.autograd.Function):
    """``scale · Σ_i w_i · D_i`` over rows, gradients formed in the forward pass (one backward)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        ids: Tensor,
        lps: Tensor,
        present: Tensor,
        mix: Tensor,
        kernel: TeacherTopKKernel,
        chunk_size: int,
        scale: float,
        token_weight: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        acc = _acc(weight)

        def chunk(s: int, e: int, wc: Tensor, _twc: Tensor, go: Tensor | None) -> Any:
            uid, lt, uvalid = merge_teachers(ids[s:e], lps[s:e], present[s:e], mix, weight.shape[0])
            return kernel.compute(_logits(hidden[s:e], wc).to(acc), uid, lt, uvalid, go)  # consumes the logits

        total, chunks = _precomputed(ctx, hidden, weight, weight, chunk_size, scale, token_weight, chunk)
        stats = torch.cat(chunks).to(acc) if chunks else total.new_zeros((0, 2))
        ctx.mark_non_differentiable(stats)
        return total, stats

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, grad_stats: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return *scale_saved(ctx, grad_total, "chunked teacher distillation", "call it again"), *[None] * 8


@dataclass
class TeacherDistillOutput:
    """What :func:`chunked_teacher_distill` returns: the loss and per-token diagnostics of the rows used."""

    loss: Tensor
    tokens: int
    #: ``(n, 2)``: the student's and the teachers' mass on the ids, per distilled token.
    coverage: Tensor
    #: teacher entries at completion tokens left out because their log-prob was NaN or ``+inf``
    nonfinite: int = 0
    #: teacher entries at completion tokens left out because their id is ``>= V`` (outside the student's vocabulary)
    out_of_vocab: int = 0
    #: teacher positions at completion tokens left out because their probabilities sum above 1 + MASS_TOLERANCE
    invalid: int = 0


def _check_scores(scores: TeacherTopK, mask: Tensor) -> None:
    if tuple(scores.mask.shape[::2]) != tuple(mask.shape):
        raise ValueError(
            f"teacher scores cover (B, T) = {tuple(scores.mask.shape[::2])} but the completion mask is "
            f"{tuple(mask.shape)}: score the same rows and right-pad to the same length"
        )


def chunked_teacher_distill(
    hidden: Tensor,
    lm_head_weight: Tensor,
    scores: TeacherTopK,
    mask: Tensor,
    kernel: TeacherTopKKernel,
    *,
    weights: Mapping[str, float] | Sequence[float] | None = None,
    min_agree: int | None = None,
    chunk_size: int | None = None,
    token_weight: Tensor | None = None,
    denominator: float | None = None,
) -> TeacherDistillOutput:
    """Mean over the distilled tokens of ``kernel`` between the student (from hidden states) and the teachers.

    Args:
        mask: ``(B, T)`` completion tokens that count; a token is distilled where at least one
            teacher scored it (and, with ``min_agree``, that many teachers' top-1 agree).
        weights: mixture weights by teacher name (or in order); default equal.
        token_weight: optional ``(B, T)`` per-token weights (no gradient).
        denominator: divide the sum by this instead of the number of distilled tokens.
    """
    _check_hidden("hidden", hidden, lm_head_weight)
    _check_scores(scores, mask)
    if tuple(hidden.shape[:2]) != tuple(mask.shape):
        raise ValueError(f"hidden {tuple(hidden.shape)} must be (B, T, H) with (B, T) = mask {tuple(mask.shape)}")
    mix = mixture_weights(scores.names, weights)
    r = _teacher_rows(scores, mask, min_agree, int(lm_head_weight.shape[0]), mix)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, r.idx)
    tw = None if token_weight is None else token_weight.detach().reshape(-1).index_select(0, r.idx)
    n = int(r.idx.numel())
    denom = float(denominator) if denominator is not None else float(max(n, 1))
    cs = resolve_chunk_size(chunk_size, lm_head_weight.shape[0], hidden.device)
    total, cov = _TeacherDistill.apply(
        rows, lm_head_weight, r.ids, r.lps, r.present, mix, kernel, int(cs), 1.0 / max(denom, 1e-12), tw
    )
    return TeacherDistillOutput(total, n, cov, r.nonfinite, r.out_of_vocab, r.invalid)


def teacher_distill_reference(
    logits: Tensor,
    scores: TeacherTopK,
    mask: Tensor,
    kernel: TeacherTopKKernel,
    *,
    weights: Mapping[str, float] | Sequence[float] | None = None,
    min_agree: int | None = None,
    token_weight: Tensor | None = None,
    denominator: float | None = None,
) -> TeacherDistillOutput:
    """:func:`chunked_teacher_distill` from materialised ``(B, T, V)`` logits, differentiated by autograd."""
    _check_scores(scores, mask)
    mix = mixture_weights(scores.names, weights)
    r = _teacher_rows(scores, mask, min_agree, int(logits.shape[-1]), mix)
    z = logits.reshape(-1, logits.shape[-1]).index_select(0, r.idx)
    uid, lt, uvalid = merge_teachers(r.ids, r.lps, r.present, mix, logits.shape[-1])
    per = kernel.value(z, uid, lt, uvalid)
    if token_weight is not None:
        per = per * token_weight.detach().reshape(-1).index_select(0, r.idx).to(per.dtype)
    n = int(r.idx.numel())
    denom = float(denominator) if denominator is not None else float(max(n, 1))
    with torch.no_grad():
        _, _, cov = kernel.compute(z.detach().clone(), uid, lt, uvalid)
    return TeacherDistillOutput(per.sum() / denom, n, cov, r.nonfinite, r.out_of_vocab, r.invalid)


def sampled_token_scored(teacher_logprobs: Tensor) -> Tensor:
    """Where a sampled-token teacher stream holds a score (finite, or ``-inf``): NaN, ``+inf`` and a probability
    above ``1 + MASS_TOLERANCE`` are none."""
    t = teacher_logprobs
    return (torch.isfinite(t) & (t <= math.log1p(MASS_TOLERANCE))) | (t == float("-inf"))


def sampled_token_divergence(student_logprobs: Tensor, teacher_logprobs: Tensor, kernel: TeacherTopKKernel) -> Tensor:
    """Per-token divergence when each side gives only its log-prob of the **sampled** token (``K = 1``).

    Each token is the two-way distribution (the sampled token, everything else), as
    :meth:`TeacherTopK.from_sampled` through :func:`chunked_teacher_distill`, but from log-probs the
    trainer already holds (PRIME-RL's ``trainer_logprobs`` and its teacher stream): differentiable in
    ``student_logprobs`` by autograd. ``kernel.temperature`` is not applied (the log-probs are as given).
    A teacher entry that is NaN or +inf is no score: its token's divergence is 0 (leave it out of the
    denominator with :func:`sampled_token_scored`).
    """
    s = student_logprobs.float() if student_logprobs.dtype not in (torch.float32, torch.float64) else student_logprobs
    t = teacher_logprobs.to(s.dtype)
    # a NaN or +inf teacher log-prob is no score (as in the top-k path): that token's divergence is 0
    scored = sampled_token_scored(t)
    t = torch.where(scored, t, torch.zeros_like(t)).clamp(min=TEACHER_LOGPROB_FLOOR)
    # the rest of the mass; where the token holds it all the tail is floored without gradient (as the kernel)
    s_top = s.clamp(max=-TAIL_FLOOR)
    s_top = torch.where(s < -TAIL_FLOOR, s_top, s_top.detach())
    ls = torch.stack([s, _log1mexp(s_top)], -1)
    lt = torch.stack([t, _log1mexp(t.clamp(max=-TAIL_FLOOR))], -1)
    valid = torch.ones_like(ls, dtype=torch.bool)
    per = bucket_divergence(ls, lt, valid, kernel.jsd_beta)[0]
    return torch.where(scored, per, torch.zeros_like(per))
