"""Functional loss API of composer-plugins: exact restatements of the upstream losses users trust.

Pure functions of tensors (no modules, no registry), typed and shape-checked, each naming the upstream
code it restates (the list: docs/losses.md, "Functional API"). Functions that also report metrics return a
:class:`LossOutput` ``(loss, metrics)`` whose values are detached 0-d tensors (no device sync is forced).
It is the one import for the whole API: it re-exports the advantages, the importance-sampling correction,
the tensor helpers, the TAID schedule and the chunked hidden-state kernels.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from composer_plugins.kernels.chunked import (
    DEFAULT_CHUNK_SIZE,
    chunked_distill,
    chunked_entropy_aware_opd,
    chunked_generalized_jsd,
    chunked_logprobs,
    chunked_taid_loss,
    reduction_denominator,
)
from composer_plugins.kernels.divergences import EntropyOPDKernel, JSDKernel, TAIDKernel
from composer_plugins.kernels.fused import fused_logprobs
from composer_plugins.kernels.select import KERNEL_SETTINGS, KernelPick, pick_kernels
from composer_plugins.losses.advantages import group_advantages, rloo_advantages
from composer_plugins.losses.correction import IS_MODES, importance_sampling_correction
from composer_plugins.losses.ops import LossOutput, _require_same, _shape, masked_mean, nanstd, selective_log_softmax
from composer_plugins.losses.taid import TAIDScheduler

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "IS_MODES",
    "KERNEL_SETTINGS",
    "POLICY_LOSS_TYPES",
    "KernelPick",
    "LossOutput",
    "TAIDScheduler",
    "chunked_distill",
    "chunked_entropy_aware_opd",
    "chunked_generalized_jsd",
    "chunked_logprobs",
    "chunked_taid_loss",
    "dpo_loss",
    "dppo_kl_loss",
    "entropy_aware_opd",
    "fused_logprobs",
    "generalized_jsd",
    "group_advantages",
    "importance_sampling_correction",
    "kl_estimate",
    "masked_mean",
    "nanstd",
    "pick_kernels",
    "policy_loss",
    "rloo_advantages",
    "selective_log_softmax",
    "simpo_loss",
    "taid_loss",
]

#: Loss types accepted by :func:`policy_loss`: the one place they are written.
PolicyLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "gspo"]
POLICY_LOSS_TYPES: tuple[str, ...] = get_args(PolicyLossType)


# -- policy losses ---------------------------------------------------------------------------------
def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: Literal["k1", "k2", "k3"] = "k3") -> Tensor:
    """Per-token estimate of KL(π‖π_ref) from sampled-token log-probs (Schulman's k1/k2/k3).

    ``k1 = log π - log π_ref``; ``k2 = ½ (log π - log π_ref)²``;
    ``k3 = exp(log π_ref - log π) - (log π_ref - log π) - 1`` (TRL GRPO's estimator).
    """
    _require_same("logprobs", logprobs, "ref_logprobs", ref_logprobs)
    if estimator == "k3":
        d = ref_logprobs - logprobs
        return torch.exp(d) - d - 1
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    raise ValueError(f"unknown KL estimator {estimator!r}; valid: 'k1', 'k2', 'k3'")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    loss_type: PolicyLossType = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: Literal["token", "sequence"] | None = None,
    beta: float = 0.0,
    ref_logprobs: Tensor | None = None,
    max_completion_length: int | None = None,
    *,
    num_items_in_batch: Tensor | float | None = None,
    kl_estimator: Literal["k1", "k2", "k3"] = "k3",
    use_bias_correction_kl: bool = True,
    delta: float | None = None,
    importance_sampling_ratio: Tensor | None = None,
) -> LossOutput:
    """Clipped policy-gradient loss with TRL 1.16 ``GRPOTrainer._compute_loss`` semantics.

    Per token, with ``r = exp(log_w)``, ``log_w = logprobs - old_logprobs`` (``"token"`` level)
    or its masked mean per sequence (``"sequence"``, GSPO):

    * ``grpo``/``bnpo``/``dr_grpo``/``dapo``/``gspo``: ``-min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)``
      (``r`` first capped at ``delta`` when given — two-sided GRPO);
    * ``cispo``: ``-stopgrad(min(r, ε_high))·A·logprobs`` (note: TRL caps at ``epsilon_high`` itself);
    * times ``importance_sampling_ratio`` when given (vLLM truncated IS correction);
    * plus ``beta·KL`` (``kl_estimator``, TRL uses ``k3``), multiplied by ``r`` when
      ``use_bias_correction_kl`` (TRL default True).

    Each ``loss_type``'s aggregation, ``num_items_in_batch`` under gradient accumulation (the loss is not
    divided by the accumulation steps) and the metrics: docs/losses.md ("Policy losses"). ``logprobs``,
    ``old_logprobs`` (``None``: ``logprobs.detach()``) and ``mask`` are ``(B, T)``, ``advantages`` ``(B,)`` or
    ``(B, T)``; ``epsilon_high`` defaults to ``epsilon_low``, ``importance_sampling_level`` to ``"sequence"``
    for ``gspo`` (else token), ``max_completion_length`` to ``T``; ``beta != 0`` needs ``ref_logprobs``.
    """
    if loss_type not in POLICY_LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(POLICY_LOSS_TYPES)}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {_shape(logprobs)}")
    _require_same("mask", mask, "logprobs", logprobs)
    if old_logprobs is not None:
        _require_same("old_logprobs", old_logprobs, "logprobs", logprobs)
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages shape {_shape(advantages)} must be (B,)=({logprobs.shape[0]},) or (B, T)")
        adv = advantages.unsqueeze(1)
    elif advantages.dim() == 2:
        _require_same("advantages", advantages, "logprobs", logprobs)
        adv = advantages
    else:
        raise ValueError(f"advantages must be (B,) or (B, T), got shape {_shape(advantages)}")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs (the reference model's per-token log-probs)")
    if ref_logprobs is not None:
        _require_same("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    level = importance_sampling_level or ("sequence" if loss_type == "gspo" else "token")
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown importance_sampling_level {level!r}; valid: 'token', 'sequence'")
    eps_high = epsilon_low if epsilon_high is None else epsilon_high

    mask_f = mask.to(logprobs.dtype)
    adv = adv.to(logprobs.dtype)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    log_ratio = logprobs - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)

    per_token_kl: Tensor | None = None
    if beta != 0.0:
        assert ref_logprobs is not None
        per_token_kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    if loss_type == "cispo":
        clamped = torch.clamp(coef_1, max=eps_high).detach()
        per_token_loss = -clamped * adv * logprobs
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)

    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    if per_token_kl is not None:
        per_token_loss = per_token_loss + beta * per_token_kl

    if loss_type in ("grpo", "gspo"):
        loss = ((per_token_loss * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask_f).sum() / mask_f.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else logprobs.shape[1]
        loss = (per_token_loss * mask_f).sum() / (per_token_loss.size(0) * length)
    else:  # dapo, cispo
        if num_items_in_batch is None:
            norm = mask_f.sum().clamp(min=1.0)
        else:
            norm = torch.as_tensor(num_items_in_batch, dtype=logprobs.dtype, device=logprobs.device).clamp(min=1.0)
        loss = (per_token_loss * mask_f).sum() / norm

    metrics = _policy_metrics(loss_type, coef_1, adv, mask_f, epsilon_low, eps_high, per_token_kl)
    return LossOutput(loss, metrics)


@torch.no_grad()
def _policy_metrics(
    loss_type: str,
    coef_1: Tensor,
    adv: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    per_token_kl: Tensor | None,
) -> dict[str, Tensor | float]:
    coef_1 = coef_1.detach()

    def gmean(x: Tensor) -> Tensor:
        if x.shape[1] == 1:  # sequence level: one value per sequence
            return x.sum() / max(x.shape[0], 1)
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    def seq_mean(x: Tensor) -> Tensor:
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)  # NaN for empty rows, skipped by nanmin/nanmax

    out: dict[str, Tensor | float] = {"tokens": mask.sum().detach()}
    out["ratio_mean"] = gmean(coef_1.expand_as(mask) if coef_1.shape[1] == 1 else coef_1)
    if per_token_kl is not None:
        out["kl"] = gmean(per_token_kl.detach())
    if loss_type == "cispo":
        out["cispo_clip_ratio"] = gmean(((coef_1 > eps_high) & (adv > 0)).float())
    else:
        low = ((coef_1 < 1 - eps_low) & (adv < 0)).float()
        high = ((coef_1 > 1 + eps_high) & (adv > 0)).float()
        out["clip_ratio/low_mean"] = gmean(low)
        out["clip_ratio/high_mean"] = gmean(high)
        out["clip_ratio/region_mean"] = gmean(((low + high) > 0).float())
        lo, hi = seq_mean(low), seq_mean(high)
        out["clip_ratio/low_min"] = _nanreduce(lo, torch.min)
        out["clip_ratio/high_max"] = _nanreduce(hi, torch.max)
    return out


def _nanreduce(x: Tensor, fn: object) -> Tensor:
    valid = x[~torch.isnan(x)]
    if valid.numel() == 0:
        return torch.tensor(float("nan"), device=x.device)
    return fn(valid)  # type: ignore[operator]


def dppo_kl_loss(
    trainer_logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    loss_weights: Tensor | None = None,
) -> LossOutput:
    """PRIME-RL's default RL loss: DPPO-Binary-TV trust-region mask + importance-weighted PG + squared-log-ratio KL.

    Restates ``default_loss_fn`` of ``src/prime_rl/trainer/rl/loss.py`` in PrimeIntellect-ai/prime-rl at
    commit ``559b44772e471d1538537b8805cc77f3824a5e64`` (formula last changed in
    ``e48a53853ef82dc4549645685cd0065b875f05fa``). Per token, with ``log_r = trainer - inference``,
    ``r = exp(log_r)`` and ``Δp = exp(trainer) - exp(inference)``:

    * masked (trust-region violation) = ``Δp > dppo_mask_high`` where ``A > 0``, else ``Δp < -dppo_mask_low``;
    * ``loss_t = -keep·adv_tau·A·r + kl_tau·loss_mask·log_r²`` with ``keep = loss_mask & ~masked``;
    * times ``loss_weights`` when given; summed per sample and over the batch.

    The result is the *sum* over samples of the summed token losses (docs/losses.md, "Policy losses"):
    divide it yourself (the ``dppo`` channel divides by the masked-token count by default).

    ``trainer_logprobs`` is ``(B, T)`` or ``(T,)``; ``inference_logprobs``, ``loss_mask`` and the optional
    ``loss_weights`` (PRIME-RL's component weight stream) have its shape, ``advantages`` it or ``(B,)``.

    Returns:
        :class:`LossOutput`; metrics follow PRIME-RL: ``masked_mismatch_kl``, ``unmasked_mismatch_kl``,
        ``is_masked``, ``is_masked_low``, ``is_masked_high``, ``masked_advantage_positive``,
        ``masked_advantage_negative`` (means over the relevant tokens of the whole batch), plus ``tokens``.
    """
    _require_same("inference_logprobs", inference_logprobs, "trainer_logprobs", trainer_logprobs)
    _require_same("loss_mask", loss_mask, "trainer_logprobs", trainer_logprobs)
    if loss_weights is not None:
        _require_same("loss_weights", loss_weights, "trainer_logprobs", trainer_logprobs)
    if advantages.shape != trainer_logprobs.shape:
        if trainer_logprobs.dim() == 2 and advantages.shape == trainer_logprobs.shape[:1]:
            advantages = advantages.unsqueeze(-1).expand_as(trainer_logprobs)
        else:
            raise ValueError(
                f"advantages shape {_shape(advantages)} must be (B,) or equal trainer_logprobs shape "
                f"{_shape(trainer_logprobs)}"
            )
    mask = loss_mask.bool()
    log_r = trainer_logprobs - inference_logprobs
    ratio = torch.exp(log_r)
    mismatch_kl = ratio - log_r - 1

    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    invalid_high = probs_diff > dppo_mask_high
    invalid_low = probs_diff < -dppo_mask_low
    pos = advantages > 0
    neg = advantages < 0
    is_masked = torch.where(pos, invalid_high, invalid_low)
    is_masked_high = pos & invalid_high
    is_masked_low = neg & invalid_low
    drop = mask & is_masked
    keep = mask & ~is_masked

    adv = adv_tau * advantages
    pg = keep * adv * ratio
    kl = mask * log_r**2
    per_token = -pg + kl_tau * kl
    if loss_weights is not None:
        per_token = per_token * loss_weights
    loss = per_token.sum()

    with torch.no_grad():

        def smean(values: Tensor, m: Tensor) -> Tensor:
            return values[m].float().sum() / m.sum().clamp(min=1)

        metrics: dict[str, Tensor | float] = {
            "masked_mismatch_kl": smean(mismatch_kl.detach(), drop),
            "unmasked_mismatch_kl": smean(mismatch_kl.detach(), keep),
            "is_masked": smean(is_masked, mask),
            "is_masked_low": smean(is_masked_low, mask),
            "is_masked_high": smean(is_masked_high, mask),
            "masked_advantage_positive": smean(pos, drop),
            "masked_advantage_negative": smean(neg, drop),
            "tokens": mask.sum(),
        }
    return LossOutput(loss, metrics)


# -- distillation (materialised reference path) ----------------------------------------------------
def _check_logits(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None) -> None:
    _require_same("teacher_logits", teacher_logits, "student_logits", student_logits)
    if student_logits.dim() < 2:
        raise ValueError(f"logits must be (..., V), got shape {_shape(student_logits)}")
    if mask is not None and tuple(mask.shape) != tuple(student_logits.shape[:-1]):
        raise ValueError(f"mask shape {_shape(mask)} must equal logits.shape[:-1] = {_shape(student_logits)[:-1]}")


def _reduce_tokens(per_token: Tensor, mask: Tensor | None, reduction: str, vocab: int) -> Tensor:
    if reduction in ("token", "none"):
        return per_token * mask.to(per_token.dtype) if mask is not None else per_token
    if reduction not in ("batchmean", "sum", "mean"):
        raise ValueError(f"unknown reduction {reduction!r}; valid: batchmean, sum, mean, token")
    vals = per_token if mask is None else per_token[mask.bool()]
    if reduction == "sum":
        return vals.sum()
    return vals.sum() / reduction_denominator(reduction, vals.numel(), mask is not None, per_token.shape, vocab)


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: Literal["batchmean", "sum", "mean", "token"] = "batchmean",
) -> Tensor:
    """Generalised Jensen–Shannon divergence (GKD, Agarwal et al. 2024, Eq. 1) with TRL semantics.

    Same values as ``trl.experimental.gkd.GKDTrainer.generalized_jsd_loss`` with ``labels != -100`` ⇔
    ``mask`` (``beta`` 0: forward KL, 1: reverse KL; docs/losses.md, "Distillation").

    Reductions: ``batchmean`` = sum over masked tokens / their number (at least 1; without a mask,
    / ``student_logits.shape[0]``), ``sum``, ``mean`` = sum / (tokens × V) (TRL's element mean),
    ``token`` = per-token divergence ``(...)`` (0 off-mask). Computed in float32.

    Materialises the ``(..., V)`` softmax intermediates; for long sequences use
    :func:`chunked_generalized_jsd` on hidden states instead.
    """
    _check_logits(student_logits, teacher_logits, mask)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    per_token = JSDKernel(beta=float(beta), temperature=float(temperature)).value(student_logits, teacher_logits)
    return _reduce_tokens(per_token, mask, reduction, student_logits.shape[-1])


def taid_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None, t: float | Tensor) -> Tensor:
    """TAID distillation loss at interpolation ``t`` (SakanaAI/TAID ``TAID.compute_loss``).

    The masked token mean of :class:`~composer_plugins.kernels.divergences.TAIDKernel`'s loss (float32); an
    empty mask gives 0, not NaN. ``t`` in [0, 1] comes from a :class:`TAIDScheduler` you step yourself (the
    ``hint_distill`` channel does).
    """
    _check_logits(student_logits, teacher_logits, mask)
    tv = float(t)
    if not 0.0 <= tv <= 1.0:
        raise ValueError(f"TAID t must be in [0, 1], got {tv}")
    per_token = TAIDKernel(t=tv).value(student_logits, teacher_logits.detach())
    if mask is None:
        return per_token.mean()
    m = mask.reshape(per_token.shape).to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp(min=1.0)


def entropy_aware_opd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor | None = None,
    entropy_threshold: float = 0.8,
    fkl_weight: float = 1.0,
    top_k: int | None = None,
    temperature: float = 1.0,
    reduction: Literal["batchmean", "sum", "mean", "token"] = "batchmean",
) -> Tensor:
    """Entropy-aware on-policy distillation (Jin et al., 2026, arXiv:2603.07079, Eq. 9–10).

    Per token, with student ``p_t`` and teacher ``q_t`` at ``temperature``::

        loss_t = KL(p_t ‖ q_t) + fkl_weight · 1[H(q_t) > entropy_threshold] · KL(q_t ‖ p_t)

    ``top_k=k`` takes the forward KL over the teacher's renormalised top-k (Eq. 10). The rule and its
    source: docs/losses.md ("Distillation"). Reductions as :func:`generalized_jsd`.
    """
    _check_logits(student_logits, teacher_logits, mask)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    kernel = EntropyOPDKernel(
        entropy_threshold=float(entropy_threshold), fkl_weight=float(fkl_weight), top_k=top_k, temperature=temperature
    )
    per_token = kernel.value(student_logits, teacher_logits.detach())
    return _reduce_tokens(per_token, mask, reduction, student_logits.shape[-1])


# -- preference losses -----------------------------------------------------------------------------
def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid",
    label_smoothing: float = 0.0,
    *,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> LossOutput:
    """Direct Preference Optimisation loss, TRL ``DPOTrainer`` semantics (reverse-KL f-divergence).

    With ``Δ = (chosen - ref_chosen) - (rejected - ref_rejected)`` (sequence log-prob sums):

    * ``sigmoid``: ``-(1-ε)·logσ(βΔ) - ε·logσ(-βΔ)`` (``ε = label_smoothing``; ε=0 is TRL 1.16's
      sigmoid, ε>0 the conservative-DPO form of the original DPO code / earlier TRL);
    * ``hinge``: ``relu(1 - βΔ)``;
    * ``ipo``: ``(Δ' - 1/(2β))²`` where ``Δ'`` divides each side's log-ratio by its completion length
      when ``chosen_lengths``/``rejected_lengths`` are given (TRL 1.16's length-normalised IPO).

    Returns the mean over pairs and metrics ``rewards/chosen``, ``rewards/rejected``,
    ``rewards/accuracies``, ``rewards/margins`` (TRL's, with rewards ``β·log-ratio``).
    """
    for n, x in (
        ("rejected_logps", rejected_logps),
        ("ref_chosen_logps", ref_chosen_logps),
        ("ref_rejected_logps", ref_rejected_logps),
    ):
        _require_same(n, x, "chosen_logps", chosen_logps)
    if chosen_logps.dim() != 1:
        raise ValueError(f"chosen_logps must be (N,) per-sequence log-probs, got shape {_shape(chosen_logps)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen_lr = chosen_logps - ref_chosen_logps
    rejected_lr = rejected_logps - ref_rejected_logps
    delta = chosen_lr - rejected_lr
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
        if label_smoothing:
            losses = losses * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        c, r = chosen_lr, rejected_lr
        if chosen_lengths is not None:
            c = c / chosen_lengths.to(c.dtype).clamp(min=1.0)
        if rejected_lengths is not None:
            r = r / rejected_lengths.to(r.dtype).clamp(min=1.0)
        losses = (c - r - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; valid: 'sigmoid', 'ipo', 'hinge'")
    return LossOutput(losses.mean(), _pref_metrics(beta * chosen_lr.detach(), beta * rejected_lr.detach()))


def simpo_loss(
    chosen_avg_logps: Tensor,
    rejected_avg_logps: Tensor,
    beta: float = 2.0,
    gamma_beta_ratio: float = 0.25,
    label_smoothing: float = 0.0,
    loss_type: Literal["sigmoid", "hinge"] = "sigmoid",
) -> LossOutput:
    """SimPO (Meng et al., 2024), princeton-nlp/SimPO ``SimPOTrainer.simpo_loss`` semantics.

    With length-averaged log-probs and ``x = (chosen_avg - rejected_avg) - gamma_beta_ratio``:
    ``sigmoid``: ``-(1-ε)·logσ(βx) - ε·logσ(-βx)``; ``hinge``: ``relu(1 - βx)``. Mean over pairs;
    rewards are ``β·avg_logps``.
    """
    _require_same("rejected_avg_logps", rejected_avg_logps, "chosen_avg_logps", chosen_avg_logps)
    if chosen_avg_logps.dim() != 1:
        raise ValueError(f"chosen_avg_logps must be (N,), got shape {_shape(chosen_avg_logps)}")
    logits = (chosen_avg_logps - rejected_avg_logps) - gamma_beta_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:
        raise ValueError(f"unknown SimPO loss_type {loss_type!r}; valid: 'sigmoid', 'hinge'")
    return LossOutput(
        losses.mean(), _pref_metrics(beta * chosen_avg_logps.detach(), beta * rejected_avg_logps.detach())
    )


def _pref_metrics(chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, Tensor | float]:
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "pairs": float(chosen_rewards.shape[0]),
    }
