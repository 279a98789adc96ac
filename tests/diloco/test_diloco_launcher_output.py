"""What a user sees of a DiLoCo run (issue 41, friction 9): a replica's progress bar counts its real steps (the
glue no longer doubles Lightning's ``max_steps`` up front), and ``composer-plugins diloco`` ends with a table of
every replica's rounds, final loss, parameter hash and model path."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from serverless_support import cli, finish, result, store_url

from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo
from composer_plugins.diloco.objstore import ObjectStoreDiLoCoCallback
from composer_plugins.diloco.toy import ToyConfig, toy_model, toy_stream
from composer_plugins.training.lightning.progress import StepProgressBar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


class _SeenBar(StepProgressBar):
    """The project's step bar, remembering its total and its count when training ends."""

    seen: tuple[Any, int] | None = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._bar is not None:
            self.seen = (self._bar.total, self._bar.n)
        super().on_train_end(trainer, pl_module)


def test_replica_progress_bar_counts_the_real_steps(tmp_path):
    toy = ToyConfig(max_steps=24)
    torch.manual_seed(0)
    model = toy_model(toy)
    cfg = DiLoCoConfig(transport="object_store", store=f"file://{tmp_path}/store", sync_every=8)
    cb = ObjectStoreDiLoCoCallback(cfg, ReplicaInfo(index=0, num_replicas=1, run_id="bar"))
    bar = _SeenBar()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=toy.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[cb, bar],
    )
    trainer.fit(model, torch.utils.data.DataLoader(toy_stream(toy, 0), batch_size=None))
    assert bar.seen == (24, 24), bar.seen  # not 24 of 48: the bar ends full
    assert trainer.global_step == 24 and trainer.max_steps == 24
    assert cb.history[-1]["outer_step"] == 3


def test_launcher_ends_with_a_table_of_rounds_loss_hash_and_model(tmp_path):
    log_dir = tmp_path / "logs"
    proc = cli(
        tmp_path,
        "logs",
        "toy.max_steps=16",
        "-S",
        "diloco.transport=object_store",
        "-S",
        f"diloco.store={store_url('file', tmp_path, 'table')}",
    )
    out = finish(proc, log_dir)
    a, b = result(log_dir, 0), result(log_dir, 1)
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("replica  rounds"))
    assert lines[head].split("  ")[0] == "replica" and "final loss (eval_loss)" in lines[head], out
    assert "param hash" in lines[head] and "model path" in lines[head], out
    rows = [ln.split() for ln in lines[head + 1 : head + 3]]
    for row, res in zip(rows, (a, b), strict=True):
        assert row[:4] == [str(res["replica"]), "2", f"{res['eval_loss']:.4f}", res["param_hash"][:12]], (row, out)
    assert lines[head + 3] == f"every replica ended on parameter hash {a['param_hash'][:12]}", out
    summary = json.loads((log_dir / "replica1.result.json").read_text())
    assert summary["rounds"] == 2 and summary["param_hash"] == b["param_hash"]


def test_replica_summary_of_a_train_run_names_its_model_dir(tmp_path):
    from composer_plugins.diloco.env import ENV_INDEX, ENV_SYNC_LOG
    from composer_plugins.diloco.launch import summary_table
    from composer_plugins.diloco.run import write_replica_summary
    from composer_plugins.training.runs.run import RunResult

    sync = tmp_path / "replica3.sync.jsonl"
    sync.write_text(json.dumps({"outer_step": 5, "param_hash": "ab" * 32}) + "\n")
    res = RunResult(
        metrics={"train/loss": 1.25, "train/reward": 0.5}, output_dir=str(tmp_path), model_dir=str(tmp_path / "model")
    )
    got = write_replica_summary(res, {ENV_SYNC_LOG: str(sync), ENV_INDEX: "3"})
    assert got == {
        "replica": 3,
        "restart": 0,
        "rounds": 5,
        "loss_name": "train/loss",
        "loss": 1.25,
        "param_hash": "ab" * 32,
        "model_path": str(tmp_path / "model"),
    }
    table = summary_table(tmp_path, [3, 4]).splitlines()
    assert table[0].split("  ")[0] == "replica" and "final loss (train/loss)" in table[0]
    assert table[1].split() == ["3", "5", "1.2500", "ab" * 6, str(tmp_path / "model")]
    assert table[2].split() == ["4", "-", "-", "-", "-"]  # a replica that left nothing
    assert write_replica_summary(res, {}) is None  # not launched: nothing written
