"""The ``gpu`` tier: tests marked ``gpu`` need a CUDA device and are skipped, with the reason, where none is.

A test whose logic also runs on the CPU at a tiny shape is parametrized over :data:`gpu_support.DEVICES`:
its ``cpu`` case runs in CI, its ``cuda`` case carries the ``gpu`` mark. ``bash scripts/gpu_check.sh`` runs
this folder on a GPU machine (see benchmarks/README.md, "GPU check").
"""

from __future__ import annotations

import pytest
import torch

NO_CUDA = (
    "needs a CUDA device (torch.cuda.is_available() is False here); "
    "run `bash scripts/gpu_check.sh` on a GPU machine for this tier"
)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
