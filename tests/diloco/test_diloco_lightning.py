"""The DiLoCo callback with an arbitrary LightningModule (an MLP here), in-process, one replica.

A real torchft lighthouse and manager run in the test process; one replica is enough to check the
Lightning wiring: the outer step, the stop rule on the torchft step, checkpoints and resume.
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo, param_digest
from composer_plugins.diloco.launch import Lighthouse
from composer_plugins.diloco.strategy import DiLoCoCallback


class MLP(pl.LightningModule):
    def __init__(self, two_optimizers: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.two = two_optimizers
        self.automatic_optimization = not two_optimizers

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[override]
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return [opt, torch.optim.SGD(self.parameters(), lr=0.1)] if self.two else opt


def data(n: int = 512) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    y = x.sum(1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def fit(model: pl.LightningModule, max_steps: int, callbacks: list, ckpt_path: str | None = None) -> pl.Trainer:
    t = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    t.fit(model, data(), ckpt_path=ckpt_path)
    return t


@pytest.fixture
def lighthouse() -> Iterator[str]:
    lh = Lighthouse(heartbeat_timeout_ms=1000)
    try:
        yield lh.address
    finally:
        lh.shutdown()


def replica(lighthouse: str) -> ReplicaInfo:
    return ReplicaInfo(lighthouse=lighthouse, replica_id="replica0")


def test_outer_sgd_lr1_reproduces_plain_training(lighthouse):
    """With outer SGD(lr=1, no momentum) one replica's DiLoCo update is exactly its inner trajectory."""
    torch.manual_seed(0)
    plain = MLP()
    init = {k: v.clone() for k, v in plain.state_dict().items()}
    fit(plain, 12, [])

    torch.manual_seed(0)
    m = MLP()
    m.load_state_dict(init)
    cfg = DiLoCoConfig(sync_every=4, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False)
    cb = DiLoCoCallback(cfg, replica(lighthouse))
    t = fit(m, 12, [cb])
    assert t.global_step == 12
    assert [r["outer_step"] for r in cb.history] == [1, 2, 3]
    assert all(r["committed"] and r["participants"] == 1 for r in cb.history)
    for a, b in zip(plain.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert cb.manager is None  # closed at the end of fit


def test_default_outer_nesterov_changes_the_update(lighthouse):
    torch.manual_seed(0)
    a = MLP()
    init = {k: v.clone() for k, v in a.state_dict().items()}
    cb_a = DiLoCoCallback(
        DiLoCoConfig(sync_every=4, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False), replica(lighthouse)
    )
    fit(a, 8, [cb_a])
    b = MLP()
    b.load_state_dict(init)
    cb_b = DiLoCoCallback(DiLoCoConfig(sync_every=4), replica(lighthouse))
    fit(b, 8, [cb_b])
    assert param_digest(a.parameters())[0] != param_digest(b.parameters())[0]
    assert cb_b.bytes_allreduced == 2 * 4 * sum(p.numel() for p in b.parameters())


def test_stops_on_outer_steps_and_checkpoints_resume(lighthouse, tmp_path):
    ckdir = tmp_path / "ck"
    torch.manual_seed(0)
    m = MLP()
    cfg = DiLoCoConfig(sync_every=2, outer_steps=3, checkpoint_dir=str(ckdir), checkpoint_every=2)
    cb = DiLoCoCallback(cfg, replica(lighthouse))
    t = fit(m, 100, [cb])
    assert t.global_step == 6  # 3 outer steps of H=2, not max_steps
    assert sorted(p.name for p in ckdir.iterdir()) == ["diloco-outer000002.ckpt"]
    ck = torch.load(ckdir / "diloco-outer000002.ckpt", weights_only=False)
    state = next(v for k, v in ck["callbacks"].items() if "DiLoCoCallback" in k)
    assert state["manager"]["step"] == 2 and len(state["outer_optimizers"]) == 1
    assert ck["global_step"] == 4

    # resume: the torchft step, outer momentum and global weights come back with the checkpoint
    m2 = MLP()
    cb2 = DiLoCoCallback(DiLoCoConfig(sync_every=2, outer_steps=4), replica(lighthouse))
    t2 = fit(m2, 100, [cb2], ckpt_path=str(ckdir / "diloco-outer000002.ckpt"))
    assert [r["outer_step"] for r in cb2.history] == [3, 4]
    assert t2.global_step == 8

    # what the resume restores, checked right after attach
    m3 = MLP()
    cb3 = DiLoCoCallback(DiLoCoConfig(sync_every=2), replica(lighthouse))
    cb3.load_state_dict(state)
    cb3.attach(m3, torch.optim.Adam(m3.parameters(), lr=1e-2))
    try:
        assert cb3.outer_step == 2
        saved = state["outer_optimizers"][0]["state"]
        got = cb3.outer_optimizers[0].state_dict()["state"]
        assert saved.keys() == got.keys() and saved
        for k in saved:
            torch.testing.assert_close(got[k]["momentum_buffer"], saved[k]["momentum_buffer"])
        frag = cb3.diloco._fragments[0]
        for k, v in state["global_params"][0].items():
            torch.testing.assert_close(frag.original_parameters[k], v)
    finally:
        cb3.close()


def test_needs_exactly_one_optimizer(lighthouse):
    class Two(MLP):
        def training_step(self, batch, batch_idx):  # type: ignore[override]
            return None

    with pytest.raises(ComposerPluginsError, match="exactly one optimizer"):
        fit(Two(two_optimizers=True), 2, [DiLoCoCallback(DiLoCoConfig(sync_every=2), replica(lighthouse))])
