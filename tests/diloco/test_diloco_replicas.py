"""Multi-process DiLoCo on CPU: a torchft lighthouse plus replica processes of the tiny causal LM.

Every replica appends one JSON line per sync (torchft step, committed, participants, healed, SHA-256 of
its parameters) to ``replica<i>.sync.jsonl``; the tests compare those files across replicas.
All processes run in their own process groups and are killed in ``finally`` even when a test fails.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from composer_plugins.diloco.launch import ReplicaGroup, replica_argv

pytestmark = pytest.mark.slow

WAIT_S = 150.0  # generous: replicas import torch + lightning on a busy machine


def records(log_dir: Path, index: int) -> list[dict[str, Any]]:
    p = log_dir / f"replica{index}.sync.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written right now
            pass
    return out


def tail(group: ReplicaGroup, n: int = 30) -> str:
    parts = []
    for r in group.replicas:
        p = group.log_path(r.index)
        if p is not None and p.exists():
            lines = [ln for ln in p.read_text(errors="replace").splitlines() if "torchft::" not in ln]
            parts.append(f"--- replica{r.index}.log ---\n" + "\n".join(lines[-n:]))
    return "\n".join(parts)


def wait_for(
    group: ReplicaGroup, what: str, pred: Callable[[], Any], timeout: float = WAIT_S, watch: tuple[int, ...] = (0, 1)
) -> Any:
    """Poll ``pred`` until truthy; fail early (with the logs) if a watched replica dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        for r in group.replicas:
            if r.index in watch and r.handle is not None and r.handle.poll() not in (None, 0):
                pytest.fail(f"replica {r.index} died while waiting for {what}\n{tail(group)}")
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{tail(group)}")


@pytest.fixture
def make_group(tmp_path: Path) -> Iterator[Callable[..., ReplicaGroup]]:
    groups: list[ReplicaGroup] = []

    def make(n: int, overrides: list[str], **kw: Any) -> ReplicaGroup:
        log_dir = tmp_path / f"run{len(groups)}"
        argv = lambda i: replica_argv("toy", None, [*overrides, f"toy.output={log_dir}/result{i}.json"])  # noqa: E731
        g = ReplicaGroup(argv, n, log_dir=log_dir, heartbeat_timeout_ms=1500, grace_s=5, **kw)
        groups.append(g)
        return g.start()

    make.tmp_path = tmp_path  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for g in groups:
            g.stop()


def test_two_replicas_hold_identical_weights_after_every_sync(make_group):
    h, outer = 4, 5
    ckdir = make_group.tmp_path / "ck"
    g = make_group(
        2,
        [
            f"diloco.sync_every={h}",
            f"toy.max_steps={h * outer}",
            f"diloco.checkpoint_dir={ckdir}",
            "diloco.checkpoint_every=2",
        ],
    )
    res = g.wait(timeout=WAIT_S)
    assert res.ok, f"{res}\n{tail(g)}"
    r0, r1 = records(g.log_dir, 0), records(g.log_dir, 1)
    # every sync committed with both replicas in the quorum, at the same torchft steps
    assert [r["outer_step"] for r in r0] == [r["outer_step"] for r in r1] == list(range(1, outer + 1))
    for a, b in zip(r0, r1, strict=True):
        assert a["committed"] and b["committed"]
        assert a["participants"] == b["participants"] == 2
        assert a["inner_step"] == b["inner_step"]
        assert a["param_hash"] == b["param_hash"], f"weights differ after sync at torchft step {a['outer_step']}"
    # the weights do change between syncs (the hash is not trivially constant)
    assert len({r["param_hash"] for r in r0}) == outer
    # init_sync: the replicas start from different seeds; one healed from the other at step 0
    assert sum(r["healed"] for r in r0 + r1) == 1
    # one all-reduce of every parameter (fp32) per sync: DiLoCo traffic is 1/H of per-step DDP
    out0 = json.loads((g.log_dir / "result0.json").read_text())
    out1 = json.loads((g.log_dir / "result1.json").read_text())
    assert out0["seed"] != out1["seed"]
    assert out0["param_hash"] == out1["param_hash"] == r0[-1]["param_hash"]
    assert out0["bytes_allreduced"] == outer * 4 * out0["num_params"]
    assert out0["eval_loss"] == out1["eval_loss"]
    # checkpoints: exactly one replica (participating rank 0) writes each one, tagged with the torchft step
    for a, b in zip(r0, r1, strict=True):
        assert a["writes_checkpoint"] + b["writes_checkpoint"] == (a["outer_step"] % 2 == 0)
    assert sorted(p.name for p in ckdir.iterdir()) == ["diloco-outer000002.ckpt", "diloco-outer000004.ckpt"]


def test_streaming_fragments_sync_one_fragment_at_a_time(make_group):
    h, frags, syncs = 4, 2, 6
    g = make_group(
        2,
        [
            f"diloco.sync_every={h}",
            f"diloco.num_fragments={frags}",
            f"toy.max_steps={h // frags * syncs}",
            f"diloco.outer_steps={syncs}",
        ],
    )
    res = g.wait(timeout=WAIT_S)
    assert res.ok, f"{res}\n{tail(g)}"
    r0, r1 = records(g.log_dir, 0), records(g.log_dir, 1)
    assert [r["fragment"] for r in r0] == [i % frags for i in range(syncs)]
    for a, b in zip(r0, r1, strict=True):
        assert a["committed"] and b["committed"] and a["participants"] == 2
        assert a["fragment_hash"] == b["fragment_hash"], f"fragment {a['fragment']} differs at {a['outer_step']}"
    # each sync all-reduces one fragment, about half the model
    out0 = json.loads((g.log_dir / "result0.json").read_text())
    per_sync = [b["bytes_allreduced"] - a["bytes_allreduced"] for a, b in itertools.pairwise(r0)]
    assert sum(per_sync[:2]) == 4 * out0["num_params"]
    assert all(0.3 < s / (4 * out0["num_params"]) < 0.7 for s in per_sync)


def test_killed_replica_is_dropped_and_restarted_one_heals_from_peer(make_group):
    h = 8
    # a long run: the test stops it with the STOP file once the restarted replica has rejoined
    g = make_group(2, [f"diloco.sync_every={h}", "toy.max_steps=10000000"])
    log_dir = g.log_dir

    def both_synced() -> bool:
        return all(sum(r["committed"] and r["participants"] == 2 for r in records(log_dir, i)) >= 2 for i in (0, 1))

    wait_for(g, "two joint syncs", both_synced)
    g.kill(1)  # SIGKILL the whole process group of replica 1
    assert g.replicas[1].handle.wait(30) is not None
    killed_at = max(r["outer_step"] for r in records(log_dir, 1))
    n0 = len(records(log_dir, 0))

    # replica 0 keeps training alone: the lighthouse drops the dead replica from the quorum
    solo = wait_for(
        g,
        "replica 0 to commit alone",
        lambda: [r for r in records(log_dir, 0)[n0:] if r["committed"] and r["participants"] == 1],
        watch=(0,),
    )
    assert solo[0]["outer_step"] > killed_at

    g.restart(1)  # a fresh process: torchft step 0, new weights from its own seed
    healed = wait_for(
        g,
        "the restarted replica to heal",
        lambda: [r for r in records(log_dir, 1) if r["restart"] == 1 and r["healed"]],
    )[0]
    wait_for(
        g,
        "joint syncs after the rejoin",
        lambda: sum(r["restart"] == 1 and r["committed"] for r in records(log_dir, 1)) >= 3,
    )
    g.request_stop(at_outer_step=max(r["outer_step"] for r in records(log_dir, 0)) + 3)
    res = g.wait(timeout=WAIT_S)
    assert res.exit_codes[0] == [0], f"{res}\n{tail(g)}"
    assert res.exit_codes[1] == [-9, 0], res  # SIGKILLed, then the restarted run finished

    r0 = {r["outer_step"]: r for r in records(log_dir, 0) if r["committed"]}
    after = [r for r in records(log_dir, 1) if r["restart"] == 1]
    # it recovered the current state instead of starting over: it jumped to the peers' torchft step at its
    # first sync (it asks for that quorum after one local step, not H), with replica 0's weights from then on
    assert healed is after[0] or healed == after[0]
    assert healed["inner_step"] == 1 and healed["committed"]
    assert healed["outer_step"] > solo[0]["outer_step"]
    for r in after:
        assert r["committed"] and r["participants"] == 2
        assert r["param_hash"] == r0[r["outer_step"]]["param_hash"], f"diverged at torchft step {r['outer_step']}"
    # both finished at the requested step with the same final weights
    out0 = json.loads((log_dir / "result0.json").read_text())
    out1 = json.loads((log_dir / "result1.json").read_text())
    assert out0["outer_step"] == out1["outer_step"] and out0["param_hash"] == out1["param_hash"]
    assert out1["heal_count"] == 1 and out1["inner_steps"] < out0["inner_steps"]
