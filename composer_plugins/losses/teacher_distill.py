"""On-policy distillation from external teachers: the student pulled towards N teachers on its own tokens.

Per completion token of the student's rollout, a divergence between the student's next-token
distribution and the teachers' — given as each teacher's top-``K`` log-probs (what an inference
server returns), combined into a weighted mixture over the union of their ids plus a tail bucket
(:mod:`composer_plugins.kernels.teacher_topk`). ``reverse_kl`` (default: on-policy distillation's
``KL(student ‖ teacher)``), ``forward_kl`` or ``jsd`` with ``beta``. The input keys (``teacher_scores``,
``completion_mask``, the chunked ``hidden_states`` + ``lm_head_weight`` or the reference
``completion_logits``, the optional ``teacher_tokens_in_batch``) are tabled in docs/losses.md ("Input keys").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from composer_plugins.kernels.divergences import TEACHER_DIVERGENCES, TeacherTopKKernel
from composer_plugins.kernels.teacher_topk import (
    TeacherTopK,
    chunked_teacher_distill,
    sampled_token_divergence,
    sampled_token_scored,
    teacher_distill_reference,
    usable_entries,
)
from composer_plugins.losses.base import LossChannel

#: Re-exported for the layers above ``losses`` (training, testing, backends), which do not import ``kernels``.
__all__ = [
    "TeacherDistillChannel",
    "TeacherTopK",
    "TeacherTopKKernel",
    "as_teacher_topk",
    "sampled_token_divergence",
    "sampled_token_scored",
    "teacher_tokens",
]


def as_teacher_topk(value: Any) -> TeacherTopK:
    """A :class:`TeacherTopK` from itself or a mapping with ``ids``, ``logprobs``, ``mask`` (and ``names``)."""
    if isinstance(value, TeacherTopK):
        return value
    if isinstance(value, Mapping) and {"ids", "logprobs", "mask"} <= set(value):
        return TeacherTopK(value["ids"], value["logprobs"], value["mask"], tuple(value.get("names") or ()))
    raise TypeError(
        f"teacher_distill: teacher_scores must be a TeacherTopK (or a mapping with ids, logprobs, mask), got "
        f"{type(value).__name__}"
    )


def _weight_ok(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) and v >= 0


class TeacherDistillChannel(LossChannel):
    """Token-level distillation from N external teachers' top-k log-probs on the student's own tokens.

    ``temperature`` divides the student's logits only (the teachers' log-probs are used as sent);
    ``teachers`` and ``deadline_s`` are read by the training loop, not by the loss. The loss, ``weights``
    (renormalised per token over the teachers present; a missing one is reported as ``absent/<name>``),
    ``min_agree`` and every parameter: docs/losses.md ("On-policy distillation from external teachers").
    """

    kind: ClassVar[str] = "teacher"
    requires: ClassVar[tuple[str, ...]] = ("teacher_scores", "completion_mask")
    input_options: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("hidden_states", "lm_head_weight"),
        ("completion_logits",),
    )

    @classmethod
    def check_spec(cls, kwargs: Mapping[str, Any]) -> tuple[str, str] | None:
        """``(field, problem and fix)`` for a config entry this channel cannot train with, read when the config
        loads (before any stage runs); ``None`` when it can."""
        teachers = kwargs.get("teachers")
        if teachers is not None and not (isinstance(teachers, list | tuple) and teachers):
            return "teachers", (
                f"teacher_distill needs at least one teacher, got teachers: {teachers!r} (every step would distil "
                "nothing). HINT: name one, e.g. teachers: [{kind: causal_lm, id: big, model_path: Qwen/Qwen3-1.7B}], "
                "or turn the channel off (enabled: false)."
            )
        return None

    def __init__(
        self,
        weight: float = 1.0,
        divergence: str = "reverse_kl",
        beta: float = 0.5,
        temperature: float = 1.0,
        weights: Mapping[str, float] | None = None,
        min_agree: int | None = None,
        chunk_size: int | None = None,
        teachers: list[Any] | None = None,
        deadline_s: float | None = 30.0,
        name: str | None = None,
        label: str | None = None,
    ) -> None:
        if divergence not in TEACHER_DIVERGENCES:
            raise ValueError(
                f"unknown teacher_distill divergence {divergence!r}; valid: {', '.join(TEACHER_DIVERGENCES)}"
            )
        if min_agree is not None and (isinstance(min_agree, bool) or not isinstance(min_agree, int) or min_agree < 1):
            raise ValueError(f"min_agree must be a whole number >= 1 (or null), got {min_agree!r}")
        if weights is not None:
            if not isinstance(weights, Mapping):
                raise ValueError(f"weights must map teacher names to numbers, e.g. {{strong: 2.0}}, got {weights!r}")
            bad = {k: v for k, v in weights.items() if not _weight_ok(v)}
            if bad:
                raise ValueError(f"teacher weights must be finite numbers >= 0, got {bad}")
        problem = self.check_spec({"teachers": teachers})
        if problem:
            raise ValueError(f"{problem[0]}: {problem[1]}")
        if chunk_size is not None and int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1 (or null), got {chunk_size}")
        if deadline_s is not None and not float(deadline_s) > 0:
            raise ValueError(f"deadline_s must be > 0 seconds (or null: wait for every teacher), got {deadline_s!r}")
        super().__init__(weight=weight, name=label or name or "teacher_distill")
        self.kernel = TeacherTopKKernel(divergence=divergence, beta=float(beta), temperature=float(temperature))
        self.divergence = divergence
        self.weights = dict(weights) if weights is not None else None
        self.min_agree = min_agree
        self.chunk_size = None if chunk_size is None else int(chunk_size)
        self.teachers = list(teachers or [])
        self.deadline_s = None if deadline_s is None else float(deadline_s)

    def forward(self, inputs: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        g = self.get
        scores = as_teacher_topk(g("teacher_scores", inputs))
        mask = g("completion_mask", inputs).bool()
        hidden = g("hidden_states", inputs)
        head = g("lm_head_weight", inputs)
        kw: dict[str, Any] = {"weights": self.weights, "min_agree": self.min_agree}
        if hidden is not None and head is not None:
            out = chunked_teacher_distill(hidden, head, scores, mask, self.kernel, chunk_size=self.chunk_size, **kw)
            chunked = 1.0
        else:
            logits = g("completion_logits", inputs)
            out = teacher_distill_reference(logits, scores, mask, self.kernel, **kw)
            chunked = 0.0
        loss = out.loss
        n_global = g("teacher_tokens_in_batch", inputs)
        if n_global is not None and out.tokens:
            loss = loss * (out.tokens / max(float(n_global), 1.0))
        scored = scores.mask.bool() & mask.unsqueeze(1)
        absent = sorted(set(self.weights or ()) - set(scores.names))
        metrics: dict[str, Any] = {
            "tokens": float(out.tokens),
            "chunked": chunked,
            "empty": float(out.tokens == 0),
            "teachers": float(len(scores.names)),
            # fraction of the completion tokens distilled (min_agree, unscored positions and positions only
            # weight-0 teachers scored drop the rest)
            "coverage": out.tokens / max(float(mask.sum()), 1.0),
            # teacher entries left out: a NaN / +inf log-prob, an id outside the student's vocabulary; teacher
            # positions left out: probabilities summing above 1 (a log-prob above 0, duplicate ids)
            "nonfinite": float(out.nonfinite),
            "out_of_vocab": float(out.out_of_vocab),
            "invalid": float(out.invalid),
            # teachers the weights name that the batch lacks (missed the deadline): the mixture renormalises
            "teachers_absent": float(len(absent)),
        }
        for name in absent:
            metrics[f"absent/{name}"] = 1.0
        rows = mask.any(-1)  # a teacher that scored nothing of a row is absent there (a failed or missing row)
        for i, name in enumerate(scores.names):
            gone = float((rows & ~scores.mask[:, i].bool().any(-1)).sum())
            if gone:
                metrics[f"absent/{name}"] = gone / max(float(rows.sum()), 1.0)
        for i, name in enumerate(scores.names):
            metrics[f"scored/{name}"] = float(scored[:, i].sum()) / max(float(mask.sum()), 1.0)
        if out.tokens:
            cov = out.coverage.float().mean(0)
            metrics["student_topk_mass"] = cov[0]
            metrics["teacher_topk_mass"] = cov[1]
        return loss, metrics

    def extra_repr(self) -> str:
        extra = f", min_agree={self.min_agree}" if self.min_agree else ""
        return f"{super().extra_repr()}, divergence={self.divergence!r}{extra}"


def teacher_tokens(
    scores: TeacherTopK, mask: Tensor, vocab: int | None = None, weights: Mapping[str, float] | None = None
) -> Tensor:
    """Number of completion tokens at least one teacher scored with a usable entry (the channel's denominator
    without ``min_agree``): an id in ``[0, vocab)`` with a log-prob that is not NaN / ``+inf``, at a position
    whose probabilities sum to at most 1 + ε, from a teacher whose weight (``weights``, by name; default all) is
    > 0."""
    ok = usable_entries(scores.ids, scores.logprobs, None if vocab is None else int(vocab))[0]
    present = scores.mask.bool() & ok.any(-1)
    if weights is not None:
        on = torch.tensor([float(weights.get(n, 0.0)) > 0 for n in scores.names], device=present.device)
        present &= on.view(1, -1, 1)
    return (mask.bool() & present.any(1)).sum()
