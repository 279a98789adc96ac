"""Replay preference channel: DPO (TRL semantics) or SimPO (princeton-nlp/SimPO) over chosen/rejected pairs.

Inputs, one entry per pair (tabled in docs/losses.md, "Input keys"): the policy's summed log-probs of the
chosen and rejected completions (``chosen_logps``, ``rejected_logps``), the reference model's for dpo
(``ref_chosen_logps``, ``ref_rejected_logps``), optional lengths (ipo length normalisation; simpo averages
with them when the length-averaged ``*_avg_logps`` are absent).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor

from composer_plugins.losses import functional as LF
from composer_plugins.losses.base import LossChannel

METHODS: tuple[str, ...] = ("dpo", "simpo")
_DPO_KEYS = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
_SIMPO_OPTIONS = (
    ("chosen_avg_logps", "rejected_avg_logps"),
    ("chosen_logps", "rejected_logps", "chosen_lengths", "rejected_lengths"),
)


class ReplayPreferenceChannel(LossChannel):
    """Preference loss over replayed chosen/rejected pairs: ``dpo`` (sigmoid|ipo|hinge) or ``simpo``.

    ``beta`` defaults to 0.1 for dpo and 2.0 for simpo; ``loss_type`` is ``sigmoid``/``ipo``/``hinge`` for dpo,
    ``sigmoid``/``hinge`` for simpo; ``gamma_beta_ratio`` is SimPO's target margin γ/β (docs/losses.md,
    "Preferences").
    """

    kind: ClassVar[str] = "pairs"
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        weight: float = 1.0,
        method: str = "dpo",
        beta: float | None = None,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        gamma_beta_ratio: float = 0.25,
        name: str | None = None,
        label: str | None = None,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown replay method {method!r}; valid: {', '.join(METHODS)}")
        valid = ("sigmoid", "ipo", "hinge") if method == "dpo" else ("sigmoid", "hinge")
        if loss_type not in valid:
            raise ValueError(f"unknown {method} loss_type {loss_type!r}; valid: {', '.join(valid)}")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        super().__init__(weight=weight, name=label or name or f"replay_{method}")
        self.method = method
        self.beta = float(beta if beta is not None else (0.1 if method == "dpo" else 2.0))
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        self.loss_type = loss_type
        self.label_smoothing = float(label_smoothing)
        self.gamma_beta_ratio = float(gamma_beta_ratio)
        self.needs_reference = method == "dpo"  # type: ignore[misc]
        self.input_options = () if method == "dpo" else _SIMPO_OPTIONS  # type: ignore[misc]

    def required_inputs(self) -> tuple[str, ...]:
        return _DPO_KEYS if self.method == "dpo" else ()

    def forward(self, inputs: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        g = self.get
        if self.method == "dpo":
            out = LF.dpo_loss(
                *(g(k, inputs) for k in _DPO_KEYS),
                beta=self.beta,
                loss_type=self.loss_type,  # type: ignore[arg-type]
                label_smoothing=self.label_smoothing,
                chosen_lengths=g("chosen_lengths", inputs),
                rejected_lengths=g("rejected_lengths", inputs),
            )
        else:
            chosen = g("chosen_avg_logps", inputs)
            rejected = g("rejected_avg_logps", inputs)
            if chosen is None or rejected is None:
                c_len = g("chosen_lengths", inputs)
                r_len = g("rejected_lengths", inputs)
                chosen = g("chosen_logps", inputs) / c_len.clamp(min=1)
                rejected = g("rejected_logps", inputs) / r_len.clamp(min=1)
            out = LF.simpo_loss(
                chosen,
                rejected,
                beta=self.beta,
                gamma_beta_ratio=self.gamma_beta_ratio,
                label_smoothing=self.label_smoothing,
                loss_type=self.loss_type,  # type: ignore[arg-type]
            )
        return out.loss, out.metrics

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self.method!r}, loss_type={self.loss_type!r}, beta={self.beta}"
