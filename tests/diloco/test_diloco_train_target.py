"""`--target train`: the launcher runs the project's `train` config (ComposerModule) as 2 DiLoCo replicas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from composer_plugins.diloco.launch import ReplicaGroup, replica_argv

pytestmark = pytest.mark.slow


def test_project_train_config_as_two_replicas(tmp_path: Path):
    run = tmp_path / "run"
    overrides = [
        "sft.enabled=false",
        "losses.hint_distill.enabled=false",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=2",
        "rollout.max_new_tokens=4",
        "trainer.max_steps=4",
        "trainer.enable_progress_bar=false",
        "trainer.num_threads=1",
        "optim.weight_decay=0.05",  # the weights move every step even where the tiny policy earns no reward
        "eval.at_start=false",
        "eval.at_end=false",
        "diloco.sync_every=2",
        f"output_dir={run}",
        f"cache_dir={tmp_path / 'cache'}",
    ]
    logs = tmp_path / "logs"
    with ReplicaGroup(replica_argv("train", None, overrides), 2, log_dir=logs, grace_s=5) as g:
        res = g.wait(timeout=240)
    tails = "\n".join((logs / f"replica{i}.log").read_text(errors="replace")[-3000:] for i in (0, 1))
    assert res.ok, f"{res}\n{tails}"

    recs = [[json.loads(x) for x in (logs / f"replica{i}.sync.jsonl").read_text().splitlines()] for i in (0, 1)]
    assert [r["outer_step"] for r in recs[0]] == [r["outer_step"] for r in recs[1]] == [1, 2]
    for a, b in zip(*recs, strict=True):
        assert a["committed"] and b["committed"] and a["participants"] == b["participants"] == 2
        assert a["param_hash"] == b["param_hash"]
    assert recs[0][0]["param_hash"] != recs[0][1]["param_hash"]

    # per-replica outputs, own seeds; one shared DiLoCo checkpoint per sync, written once
    d0, d1 = (json.loads((run / f"replica{i}" / "diloco.json").read_text()) for i in (0, 1))
    assert d0["param_hash"] == d1["param_hash"] and d0["outer_step"] == d1["outer_step"] == 2
    assert (d0["seed"], d1["seed"]) == (0, 1)  # config seed + replica index: own tasks (data shard) and sampling
    assert (run / "replica0" / "history.csv").exists() and (run / "replica1" / "history.csv").exists()
    assert sorted(p.name for p in (run / "diloco_checkpoints").iterdir()) == [
        "diloco-outer000001.ckpt",
        "diloco-outer000002.ckpt",
    ]
    assert sum(r["writes_checkpoint"] for rs in recs for r in rs) == 2
    assert not (run / "replica0" / "checkpoints").exists()  # Lightning's per-replica ModelCheckpoint is off
