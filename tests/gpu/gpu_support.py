"""What the ``gpu`` tier's tests share: the device parametrization and CUDA bookkeeping."""

from __future__ import annotations

import pytest
import torch

#: ``cpu`` (runs in CI, at a tiny shape) and ``cuda`` (the ``gpu`` tier, at a real shape).
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
#: Qwen2.5's vocabulary (151,936 rows in the released checkpoints).
QWEN_VOCAB = 151_936


def sync(device: str) -> None:
    """Wait for queued CUDA work (so a failure surfaces in the test that caused it)."""
    if device == "cuda":
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
