"""RL policy-loss channels: the GRPO family (TRL semantics) and PRIME-RL's DPPO+KL.

The input keys are tabled in docs/losses.md ("Input keys"). Under data parallel ``num_items_in_batch`` (the
``dapo``/``cispo``/``dppo`` normaliser) is the global active-token count / world size, as TRL, and
``max_completion_length`` (``dr_grpo``'s constant when the channel sets none) is the widest completion over all
ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from composer_plugins.losses import functional as LF
from composer_plugins.losses.base import LossChannel

#: Every policy-gradient channel kind: the functional loss types, then the DPPO+KL channel.
POLICY_KINDS: tuple[str, ...] = (*LF.POLICY_LOSS_TYPES, "dppo")

#: Per loss type: (epsilon_low, epsilon_high) used by the channels when not given.
#: grpo/bnpo/dr_grpo: TRL defaults; dapo: DAPO paper's clip-higher 0.28; cispo: ε_max=5.0
#: (ScaleRL, recommended in TRL's docs); gspo: the GSPO paper's 3e-4 / 4e-4.
CHANNEL_EPSILONS: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "bnpo": (0.2, 0.2),
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "cispo": (0.2, 5.0),
    "gspo": (3e-4, 4e-4),
}

_LOGPROB_OPTIONS: tuple[tuple[str, ...], ...] = (
    ("logprobs",),
    ("hidden_states", "lm_head_weight", "completion_ids"),
)


class _LogprobInputs(LossChannel):
    """Shared: read ``logprobs`` or compute them chunked from hidden states."""

    input_options: ClassVar[tuple[tuple[str, ...], ...]] = _LOGPROB_OPTIONS
    #: Per-token (and gspo's per-sequence) terms over batch-wide token/row counts: a sum over rows.
    row_separable: ClassVar[bool] = True
    #: Where off-mask positions of hidden-state log-probs take their (ratio-1) value from.
    fill_from: ClassVar[tuple[str, ...]] = ("old_logprobs",)

    def __init__(self, weight: float, name: str | None, temperature: float, chunk_size: int | None) -> None:
        super().__init__(weight=weight, name=name)
        if chunk_size is not None and int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1 (or null: chosen from the vocabulary), got {chunk_size}")
        self.temperature = float(temperature)
        self.chunk_size = None if chunk_size is None else int(chunk_size)

    def policy_logprobs(self, inputs: Mapping[str, Any]) -> Tensor:
        """``logprobs`` if given, else :func:`chunked_logprobs` of ``hidden_states`` under ``lm_head_weight``."""
        lp = self.get("logprobs", inputs)
        if lp is not None:
            return lp
        hidden = self.get("hidden_states", inputs)
        weight = self.get("lm_head_weight", inputs)
        ids = self.get("completion_ids", inputs)
        mask = self.get("completion_mask", inputs)
        keep = mask.bool()
        out = LF.chunked_logprobs(
            hidden, weight, ids, mask=keep, chunk_size=self.chunk_size, temperature=self.temperature
        )
        assert isinstance(out, Tensor)
        # positions off the mask are not computed; give them the sampling-time value (ratio 1) rather
        # than 0, so no exp(0 - old) overflow can turn into inf·0 = NaN in a masked sum
        for key in self.fill_from:
            ref = self.get(key, inputs)
            if ref is not None:
                return torch.where(keep, out, ref.detach().to(out.dtype))
        return out


class PolicyLossChannel(_LogprobInputs):
    """Clipped policy-gradient loss (grpo | bnpo | dr_grpo | dapo | cispo | gspo), TRL 1.16 semantics.

    See :func:`composer_plugins.losses.functional.policy_loss` for the exact formulas. Registered
    once per loss type; epsilons default to :data:`CHANNEL_EPSILONS` for the type.

    Args:
        epsilon_low, epsilon_high, importance_sampling_level, beta, kl_estimator, use_bias_correction_kl, delta:
            as :func:`~composer_plugins.losses.functional.policy_loss` (``beta != 0`` needs ``ref_logprobs``).
        max_completion_length: ``dr_grpo`` normaliser (default: the ``max_completion_length`` input, else T).
        temperature: sampling temperature, used when log-probs are computed from hidden states.
        chunk_size: token rows per chunk for the hidden-state path (None: chosen from the vocabulary).
        rows: ``all`` (every row) or ``correct``: only the rows whose reward is at least
            ``success_threshold`` (SRPO's routing: correct samples to the policy gradient, failed ones to
            hint distillation alone); the other rows' tokens are masked out of this channel.
        success_threshold: the reward at or above which a row counts as correct (``rows: correct``).
    """

    kind: ClassVar[str] = "policy"
    requires: ClassVar[tuple[str, ...]] = ("advantages", "completion_mask")

    def __init__(
        self,
        weight: float = 1.0,
        loss_type: str = "dapo",
        epsilon_low: float | None = None,
        epsilon_high: float | None = None,
        importance_sampling_level: str | None = None,
        beta: float = 0.0,
        kl_estimator: str = "k3",
        use_bias_correction_kl: bool = True,
        max_completion_length: int | None = None,
        delta: float | None = None,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        name: str | None = None,
        label: str | None = None,
        rows: str = "all",
        success_threshold: float = 1.0,
    ) -> None:
        if rows not in ("all", "correct"):
            raise ValueError(f"unknown rows {rows!r}; valid: 'all', 'correct'")
        if loss_type not in LF.POLICY_LOSS_TYPES:
            raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LF.POLICY_LOSS_TYPES)}")
        if kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"unknown kl_estimator {kl_estimator!r}; valid: 'k1', 'k2', 'k3'")
        if importance_sampling_level not in (None, "token", "sequence"):
            raise ValueError(
                f"unknown importance_sampling_level {importance_sampling_level!r}; valid: 'token', 'sequence'"
            )
        super().__init__(weight, label or name or loss_type, temperature, chunk_size)
        lo, hi = CHANNEL_EPSILONS[loss_type]
        self.loss_type = loss_type
        self.epsilon_low = float(lo if epsilon_low is None else epsilon_low)
        self.epsilon_high = float(hi if epsilon_high is None else epsilon_high)
        self.importance_sampling_level = importance_sampling_level
        self.beta = float(beta)
        self.kl_estimator = kl_estimator
        self.use_bias_correction_kl = bool(use_bias_correction_kl)
        self.max_completion_length = max_completion_length
        self.delta = delta
        self.needs_reference = self.beta != 0.0  # type: ignore[misc]
        self.rows = rows
        self.success_threshold = float(success_threshold)

    def required_inputs(self) -> tuple[str, ...]:
        req = (*self.requires, "ref_logprobs") if self.beta != 0.0 else tuple(self.requires)
        return (*req, "rewards") if self.rows == "correct" else req

    def _mask(self, inputs: Mapping[str, Any]) -> Tensor:
        mask = self.get("completion_mask", inputs)
        if self.rows == "all":
            return mask
        keep = (self.get("rewards", inputs).reshape(-1) >= self.success_threshold).to(mask.dtype)
        return mask * keep.unsqueeze(-1)

    def forward(self, inputs: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        g = self.get
        logprobs = self.policy_logprobs(inputs)
        out = LF.policy_loss(
            logprobs,
            g("old_logprobs", inputs),
            g("advantages", inputs),
            self._mask(inputs),
            loss_type=self.loss_type,  # type: ignore[arg-type]
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            importance_sampling_level=self.importance_sampling_level,  # type: ignore[arg-type]
            beta=self.beta,
            ref_logprobs=g("ref_logprobs", inputs) if self.beta != 0.0 else None,
            max_completion_length=(
                self.max_completion_length
                if self.max_completion_length is not None
                else g("max_completion_length", inputs)
            ),
            num_items_in_batch=g("num_items_in_batch", inputs),
            kl_estimator=self.kl_estimator,  # type: ignore[arg-type]
            use_bias_correction_kl=self.use_bias_correction_kl,
            delta=self.delta,
            importance_sampling_ratio=g("importance_sampling_ratio", inputs),
        )
        return out.loss, out.metrics

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, loss_type={self.loss_type!r}, epsilon=({self.epsilon_low}, {self.epsilon_high}), "
            f"beta={self.beta}" + (f", rows={self.rows!r}" if self.rows != "all" else "")
        )


class DPPOChannel(_LogprobInputs):
    """PRIME-RL's default loss: DPPO trust-region mask + importance-weighted PG + squared-log-ratio KL.

    See :func:`composer_plugins.losses.functional.dppo_kl_loss`. The summed token loss is divided by
    ``normalize``: ``"tokens"`` (default; ``num_items_in_batch`` if given, else the masked-token
    count, as PRIME-RL divides by its global loss-token count), ``"sequences"`` (B) or ``"none"``.

    With ``loss_weights``, tokens whose weight is zero leave the mask, as in PRIME-RL's ``rl_mask = mask &
    (rl_w != 0)``: they add nothing to the KL term, the metrics or the token count that divides the loss.
    """

    kind: ClassVar[str] = "policy"
    loss_type: ClassVar[str] = "dppo"
    requires: ClassVar[tuple[str, ...]] = ("inference_logprobs", "advantages", "completion_mask")
    fill_from: ClassVar[tuple[str, ...]] = ("inference_logprobs",)

    def __init__(
        self,
        weight: float = 1.0,
        dppo_mask_low: float = 0.2,
        dppo_mask_high: float = 0.2,
        adv_tau: float = 1.0,
        kl_tau: float = 1e-3,
        normalize: str = "tokens",
        temperature: float = 1.0,
        chunk_size: int | None = None,
        name: str | None = None,
        label: str | None = None,
    ) -> None:
        if normalize not in ("tokens", "sequences", "none"):
            raise ValueError(f"unknown normalize {normalize!r}; valid: 'tokens', 'sequences', 'none'")
        for k, v in (
            ("dppo_mask_low", dppo_mask_low),
            ("dppo_mask_high", dppo_mask_high),
            ("adv_tau", adv_tau),
            ("kl_tau", kl_tau),
        ):
            if v < 0:
                raise ValueError(f"{k} must be >= 0 (PRIME-RL constraint), got {v}")
        super().__init__(weight, label or name or "dppo", temperature, chunk_size)
        self.dppo_mask_low = float(dppo_mask_low)
        self.dppo_mask_high = float(dppo_mask_high)
        self.adv_tau = float(adv_tau)
        self.kl_tau = float(kl_tau)
        self.normalize = normalize

    def forward(self, inputs: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        g = self.get
        logprobs = self.policy_logprobs(inputs)
        mask = g("completion_mask", inputs).bool()
        weights = g("loss_weights", inputs)
        if weights is not None:
            mask = mask & (weights != 0)
        out = LF.dppo_kl_loss(
            logprobs,
            g("inference_logprobs", inputs),
            g("advantages", inputs),
            mask,
            dppo_mask_low=self.dppo_mask_low,
            dppo_mask_high=self.dppo_mask_high,
            adv_tau=self.adv_tau,
            kl_tau=self.kl_tau,
            loss_weights=weights,
        )
        loss = out.loss
        if self.normalize == "tokens":
            n = g("num_items_in_batch", inputs)
            denom = mask.sum() if n is None else n
            loss = loss / (denom.clamp(min=1) if isinstance(denom, Tensor) else max(float(denom), 1.0))
        elif self.normalize == "sequences":
            loss = loss / max(logprobs.shape[0], 1)
        return loss, out.metrics
