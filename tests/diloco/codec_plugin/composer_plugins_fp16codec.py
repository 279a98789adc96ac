"""A third-party DiLoCo codec, as a separate distribution would ship it (``composer-plugins-fp16codec``): fp16
values, registered through ``register_codecs`` and found through its entry point (the tests put this directory
on ``PYTHONPATH``). Nothing under ``composer_plugins.diloco`` knows about it."""

from __future__ import annotations

from typing import Any

import torch

from composer_plugins import hookimpl
from composer_plugins.diloco.codecs import Codec
from composer_plugins.diloco.store import CorruptObjectError


class FP16(Codec):
    """fp16 values: half the fp32 bytes (a test plugin)."""

    tolerance = 1e-3

    def encode(self, vec: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        return {"scale": 1.0}, vec.to(torch.float16).numpy().tobytes()

    def decode(self, header: dict[str, Any], body: bytes, numel: int) -> torch.Tensor:
        if len(body) != 2 * numel:
            raise CorruptObjectError(f"fp16 body of {len(body)} bytes for {numel} values")
        if not numel:
            return torch.zeros(0)
        return torch.frombuffer(bytearray(body), dtype=torch.float16).to(torch.float32) * float(header["scale"])


@hookimpl
def register_codecs(register: Any) -> None:
    register("fp16", FP16)
