"""The loss-channel contract and the composer that sums channels.

A channel declares the batch fields it needs (``requires``). When any is absent from a
batch the composer skips it and reports ``<name>/skipped = 1`` instead of a fake zero
loss. ``forward(model_outputs, batch)`` returns ``(loss, metrics)``; the composer returns
``Σ weight_i · loss_i`` and every channel's metrics prefixed with its name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn


class LossChannel(nn.Module):
    """Base class of every loss channel (built-in or third-party).

    Subclasses set ``requires`` (batch/model-output keys the channel reads) and implement
    :meth:`forward`. ``weight`` scales the channel inside :class:`ChannelComposer`.
    """

    #: Keys (in ``batch`` or ``model_outputs``) this channel reads; absent keys skip the channel.
    requires: ClassVar[tuple[str, ...]] = ()
    #: True when the channel needs a teacher forward pass (hint distillation).
    needs_teacher: ClassVar[bool] = False
    #: True when the channel needs reference-model log-probs.
    needs_reference: ClassVar[bool] = False

    def __init__(self, weight: float = 1.0, name: str | None = None) -> None:
        super().__init__()
        self.weight = float(weight)
        self.name = name or type(self).__name__

    def missing_inputs(self, model_outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> list[str]:
        """Required keys found in neither ``batch`` nor ``model_outputs`` (or present but ``None``)."""
        return [
            k for k in self.requires
            if batch.get(k) is None and model_outputs.get(k) is None
        ]  # fmt: skip

    def forward(self, model_outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        """Return ``(scalar loss, metrics)`` for this batch."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward(model_outputs, batch)")

    def extra_repr(self) -> str:
        return f"name={self.name!r}, weight={self.weight}"


class ChannelComposer(nn.Module):
    """Sums ``weight · loss`` over channels, skipping (and reporting) channels whose inputs are absent."""

    def __init__(self, channels: Sequence[LossChannel]) -> None:
        super().__init__()
        names = [c.name for c in channels]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"two loss channels share the name(s) {sorted(dupes)}; give each a distinct name=")
        self.channels = nn.ModuleList(channels)

    def forward(self, model_outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        total: Tensor | None = None
        metrics: dict[str, Any] = {}
        for ch in self.channels:
            if ch.weight == 0.0:
                metrics[f"{ch.name}/skipped"] = 1.0
                continue
            missing = ch.missing_inputs(model_outputs, batch)
            if missing:
                metrics[f"{ch.name}/skipped"] = 1.0
                metrics[f"{ch.name}/missing"] = ",".join(missing)
                continue
            loss, m = ch(model_outputs, batch)
            metrics[f"{ch.name}/skipped"] = 0.0
            metrics[f"{ch.name}/loss"] = loss.detach()
            for k, v in m.items():
                metrics[f"{ch.name}/{k}"] = v
            term = ch.weight * loss
            total = term if total is None else total + term
        if total is None:
            device = _first_tensor_device(model_outputs, batch)
            total = torch.zeros((), device=device, requires_grad=False)
        metrics["loss"] = total.detach()
        return total, metrics


def _first_tensor_device(*maps: Mapping[str, Any]) -> torch.device:
    for m in maps:
        for v in m.values():
            if isinstance(v, Tensor):
                return v.device
    return torch.device("cpu")
