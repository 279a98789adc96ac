"""The ``focal_pg`` loss channel of composer-plugins-focal (imported only when a run builds it).

The entry-point module (``composer_plugins_focal``) registers this class by its import path, so listing
plugins, ``--help`` and config errors never import torch for it.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from composer_plugins.api import LossChannel


class FocalPolicyGradient(LossChannel):
    """Focal-weighted token policy gradient: -A · (1-p)^γ · log p over completion tokens."""

    kind = "custom"  # its own policy gradient: composing backends run it, re-implementing ones refuse it
    requires = ("logprobs", "advantages", "completion_mask")

    def __init__(self, weight: float = 1.0, gamma: float = 2.0, name: str | None = "focal_pg") -> None:
        super().__init__(weight=weight, name=name)
        self.gamma = float(gamma)

    def forward(self, inputs: Any) -> tuple[Tensor, dict[str, Any]]:
        logp: Tensor = inputs["logprobs"]  # one mapping: the model's outputs and the step record's fields
        adv: Tensor = inputs["advantages"]
        mask = inputs["completion_mask"].to(logp.dtype)
        focal = (1.0 - logp.detach().exp()).clamp_min(0.0) ** self.gamma
        per_token = -adv.unsqueeze(-1) * focal * logp
        loss = (per_token * mask).sum() / mask.sum().clamp_min(1.0)
        return loss, {"focal_weight": (focal * mask).sum() / mask.sum().clamp_min(1.0)}


__all__ = ["FocalPolicyGradient"]
