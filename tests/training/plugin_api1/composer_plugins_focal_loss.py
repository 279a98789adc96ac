"""The ``focal_pg`` loss channel of composer-plugins-focal (imported only when a run builds it).

The entry-point module (``composer_plugins_focal``) registers this class by its import path, so listing
plugins, ``--help`` and config errors never import torch for it.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from composer_plugins.losses.base import LossChannel


class FocalPolicyGradient(LossChannel):
    """Focal-weighted token policy gradient: -A · (1-p)^γ · log p over completion tokens."""

    requires = ("logprobs", "advantages", "completion_mask")

    def __init__(self, weight: float = 1.0, gamma: float = 2.0, name: str | None = "focal_pg") -> None:
        super().__init__(weight=weight, name=name)
        self.gamma = float(gamma)

    def forward(self, model_outputs: Any, batch: Any) -> tuple[Tensor, dict[str, Any]]:
        logp: Tensor = self.get("logprobs", model_outputs, batch)  # model_outputs first, then batch
        adv: Tensor = batch["advantages"]
        mask = batch["completion_mask"].to(logp.dtype)
        focal = (1.0 - logp.detach().exp()).clamp_min(0.0) ** self.gamma
        per_token = -adv.unsqueeze(-1) * focal * logp
        loss = (per_token * mask).sum() / mask.sum().clamp_min(1.0)
        return loss, {"focal_weight": (focal * mask).sum() / mask.sum().clamp_min(1.0)}


__all__ = ["FocalPolicyGradient"]
