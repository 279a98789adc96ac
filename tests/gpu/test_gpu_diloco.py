"""The object-store DiLoCo round with the parameters on the training device (``file://`` store).

One replica, H = 2, two rounds, through the public API (:class:`ObjectStoreDiLoCoCallback` attached to a plain
model and optimizer, as outside Lightning): the pseudo-gradient is encoded (``none`` / ``bf16`` / ``int8``),
written, read back, the outer step applied. On CUDA the weights must end where the same run on the CPU ends.
This is the path whose ``.numpy()`` of a CUDA tensor (``diloco/store.py``, ``encode_vector``) no CPU run sees.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_support import DEVICES, sync
from torch import nn

pytest.importorskip("obstore")  # the `serverless` extra (in `all`); on the GPU machine from scripts/gpu_wheels.sh


def _run(device: str, compress: str, store: Path) -> tuple[list[torch.Tensor], list[dict]]:
    from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
    from composer_plugins.diloco.objstore import ObjectStoreDiLoCoCallback

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = DiLoCoConfig(transport="object_store", store=f"file://{store}", sync_every=2, compress=compress)
    cb = ObjectStoreDiLoCoCallback(cfg, ReplicaInfo(run_id=f"gpu-{compress}"))
    cb.attach(model, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, 16, generator=g)
    y = x.sum(-1, keepdim=True).tanh()
    try:
        for i in range(4):
            loss = nn.functional.mse_loss(model(x[i].to(device)), y[i].to(device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(device)
    finally:
        cb.close()
    for p in model.parameters():
        assert p.device.type == device
    return [p.detach().float().cpu() for p in model.parameters()], cb.history


@pytest.mark.parametrize("compress", ["none", "bf16", "int8"])
@pytest.mark.parametrize("device", DEVICES)
def test_object_store_round_with_parameters_on_the_device(device, compress, tmp_path):
    params, history = _run(device, compress, tmp_path / device)
    assert [r["outer_step"] for r in history if r["committed"]] == [1, 2], history
    assert all(r["bytes_written"] > 0 for r in history)
    assert list((tmp_path / device).rglob("*")), "nothing was written to the store"
    if device == "cuda":
        on_cpu, _ = _run("cpu", compress, tmp_path / "cpu-twin")
        # fp32 sums differ in the last bits between devices; a compressed value may then round one step apart
        tol = {"none": (1e-4, 1e-5), "bf16": (1e-3, 5e-4), "int8": (1e-3, 1e-3)}[compress]
        for a, b in zip(params, on_cpu, strict=True):
            torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])
