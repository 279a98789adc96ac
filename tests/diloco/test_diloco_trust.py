"""What a team trusts an object-store DiLoCo run with (issue 34), through ``composer-plugins diloco`` against
moto's S3 server (loopback) as a user runs it:

* nothing executable crosses the store: a pickle that would create a file, planted as a state, a
  pseudo-gradient, a manifest, ``init`` and ``run.json``, is refused with an error naming the object, and the
  file is never created;
* one starting point: a replica restarted before round 0 and a replica 0 that starts late both take ``init``;
* no single writer: the replica that closed a round is killed before it writes the round's state, then every
  replica is killed; a relaunch with ``--run-id`` rebuilds the state and finishes the run;
* identity: a fresh run on an old prefix is refused, naming the ``--run-id`` that continues it; two launchers
  with ``--first-index`` join one run.

Every run ends with the same ``param_hash`` on every replica.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from serverless_support import HERE, WAIT_S, cli, finish, logs, records, result, store_url

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def _fault_env(moto: dict[str, str], **faults: object) -> dict[str, str]:
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**moto, "PYTHONPATH": path, **{k: str(v) for k, v in faults.items()}}


def _same_weights(log_dir: Path, steps: int, h: int = 8) -> None:
    a, b = result(log_dir, 0), result(log_dir, 1)
    assert a["param_hash"] == b["param_hash"], (a, b)
    assert a["outer_step"] == b["outer_step"] == steps // h
    by0 = {r["outer_step"]: r["param_hash"] for r in records(log_dir, 0)}
    by1 = {r["outer_step"]: r["param_hash"] for r in records(log_dir, 1)}
    both = sorted(set(by0) & set(by1))
    assert both and all(by0[s] == by1[s] for s in both), [(s, by0[s] == by1[s]) for s in both]


def _s3(moto: dict[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=moto["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


class _Evil:
    """Unpickling this creates ``path`` (what a pickle planted in a bucket could do, and worse)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _pickles(marker: Path) -> dict[str, bytes]:
    """The planted objects: a bare pickle, and a pickle inside a well-formed envelope with a valid checksum."""
    from composer_plugins.diloco.store import pack

    raw = pickle.dumps({"global_params": _Evil(marker)})
    return {
        "raw": raw,
        "grad": pack({"kind": "grad", "codec": "none", "numel": 1}, raw),
        "state": pack({"kind": "state", "tree": {"X": ["float32", [1], 0, 4]}}, raw),
        "manifest": pack({"kind": "manifest"}, raw),
        "init": pack({"kind": "init"}, raw),
        "run": pack({"kind": "run"}, raw),
    }


def _objstore(url: str) -> tuple[str, ...]:
    return ("-S", "diloco.transport=object_store", "-S", f"diloco.store={url}")


def test_pickles_in_every_object_kind_are_refused_and_never_run(moto, tmp_path):
    marker = tmp_path / "PWNED"
    evil = _pickles(marker)
    s3 = _s3(moto)
    url = store_url("s3", tmp_path, "pickle")
    prefix = url.removeprefix("s3://runs/")
    first = cli(tmp_path, "a", "toy.max_steps=16", "--run-id", "pickled", *_objstore(url), env=moto)
    finish(first, tmp_path / "a")
    # a state newer than any real one, a pseudo-gradient of the next round for each replica, a later manifest
    s3.put_object(Bucket="runs", Key=f"{prefix}/state/00000099", Body=evil["raw"])
    s3.put_object(Bucket="runs", Key=f"{prefix}/state/00000098", Body=evil["state"])
    for i in (0, 1):
        s3.put_object(Bucket="runs", Key=f"{prefix}/rounds/00000002/grad-{i}-9", Body=evil["grad"])
    s3.put_object(Bucket="runs", Key=f"{prefix}/rounds/00000003/manifest.json", Body=evil["manifest"])
    again = cli(tmp_path, "b", "toy.max_steps=40", "--run-id", "pickled", *_objstore(url), env=moto)
    # init and run.json, each planted in a fresh prefix before a run starts there
    runs = {}
    for kind, key in (("init", "init"), ("run", "run.json")):
        u = store_url("s3", tmp_path, f"pickle-{kind}")
        s3.put_object(Bucket="runs", Key=f"{u.removeprefix('s3://runs/')}/{key}", Body=evil[kind])
        runs[key] = (u, cli(tmp_path, f"c-{kind}", "toy.max_steps=16", "--run-id", "fresh", *_objstore(u), env=moto))
    finish(again, tmp_path / "b", rc=1)
    text = logs(tmp_path / "b")
    assert "state/00000099" in text and "state/00000098" in text and "refused" in text, text
    assert "grad-1-9" in text and "grad-0-9" in text, text
    assert f"{prefix}/rounds/00000003/manifest.json" in text and "not a DiLoCo data object" in text, text
    r0, r1 = records(tmp_path / "b", 0), records(tmp_path / "b", 1)
    # round 2 (outer step 3) ran from state/00000001 with the replicas' own pseudo-gradients, on both the same
    assert [r["round"] for r in r0] == [r["round"] for r in r1] == [2]
    assert r0[-1]["param_hash"] == r1[-1]["param_hash"] and r0[-1]["participants"] == 2
    for key, (u, proc) in runs.items():
        finish(proc, tmp_path / f"c-{'init' if key == 'init' else 'run'}", rc=1)
        text = logs(tmp_path / f"c-{'init' if key == 'init' else 'run'}")
        assert f"{u.removeprefix('s3://')}/{key}" in text and "refused" in text, (key, text)
    assert not marker.exists(), "a pickle from the store was run"


def test_restart_before_round_0_and_a_late_replica_0_start_from_init(moto, tmp_path):
    """Replica 1 is killed at inner step 3 (before round 0 closes) and restarted; replica 0 starts only once that
    restart has begun training, and 5 s later still (beyond ``round_timeout_s`` = 2): the restarted replica 1
    waits for ``init`` at round 0, both start from it, and every replica ends with the same weights.

    Replica 0 waits on the event (``$FAULT_DIR/started-1-1``, written by replica 1's restart), not on a time
    guessed for it: under load a restart takes longer, and a fixed delay let replica 0 close rounds alone first.
    """
    log_dir, fault_dir = tmp_path / "logs", tmp_path / "faults"
    fault_dir.mkdir()
    env = _fault_env(
        moto, DIE_REPLICA=1, DIE_STEP=3, LATE_REPLICA=0, LATE_S=5, LATE_AFTER="started-1-1", FAULT_DIR=fault_dir
    )
    url = store_url("s3", tmp_path, "early")
    proc = cli(
        tmp_path,
        "logs",
        "--max-restarts",
        "1",
        "toy.max_steps=32",
        *_objstore(url),
        "-S",
        "diloco.round_timeout_s=2",
        env=env,
        target="store_fault_target:run",
    )
    out = finish(proc, log_dir)
    assert "replica 1: exit codes [-9, 0] (restarts 1)" in out, out
    assert sorted(p.name for p in fault_dir.glob("started-*")) == ["started-0-0", "started-1-0", "started-1-1"]
    assert "own weights" not in logs(log_dir)
    _same_weights(log_dir, 32)
    # replica 1 died before its first sync; its restart reached round 0's sync before replica 0 had written
    # init, so its first record is round 0's, started from init
    first = records(log_dir, 1)[0]
    assert first["restart"] == 1 and first["healed"] and first["round"] == 0, first


def _wait_for(proc: subprocess.Popen[str], log_dir: Path, what: str, pred: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        if proc.poll() is not None:
            pytest.fail(f"the launcher exited while waiting for {what}\n{proc.stdout.read()}\n{logs(log_dir)}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{logs(log_dir)}")
        time.sleep(0.02)


def test_closer_killed_between_manifest_and_state_then_all_replicas_relaunched(moto, tmp_path):
    url = store_url("s3", tmp_path, "wedge")
    s3 = _s3(moto)
    prefix = url.removeprefix("s3://runs/")
    log_dir = tmp_path / "a"
    env = _fault_env(moto, DIE_AFTER_MANIFEST_ROUND=2)
    # states every 3 rounds (2, 5, 8, 11): the rounds between are replayed from their manifests
    proc = cli(
        tmp_path,
        "a",
        "--max-restarts",
        "1",
        "toy.max_steps=96",
        "--run-id",
        "wedge-1",
        *_objstore(url),
        "-S",
        "diloco.round_timeout_s=60",
        "-S",
        "diloco.state_every=3",
        env=env,
        target="store_fault_target:run",
    )
    try:
        # the closer of round 2 died after its manifest, before state/00000002; its restart rebuilds it
        _wait_for(
            proc,
            log_dir,
            "a restarted replica past round 3",
            lambda: any(r["restart"] == 1 and r["round"] >= 3 for i in (0, 1) for r in records(log_dir, i)),
        )
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="runs", Prefix=f"{prefix}/state/").get("Contents", [])]
        assert f"{prefix}/state/00000002" in keys and f"{prefix}/state/00000001" not in keys, keys
        os.kill(proc.pid, signal.SIGKILL)  # the launcher: its replicas die with it (PR_SET_PDEATHSIG)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = max(r["outer_step"] for i in (0, 1) for r in records(log_dir, i))
    assert killed_at < 96 // 8
    text = logs(log_dir)
    assert "rebuilt" in text and "state/00000002" in text, text
    # a fresh run on the old prefix is refused, naming the id that continues it
    fresh = cli(tmp_path, "b", "toy.max_steps=96", *_objstore(url), env=moto)
    finish(fresh, tmp_path / "b", rc=1)
    assert "holds another run" in logs(tmp_path / "b") and "--run-id wedge-1" in logs(tmp_path / "b")
    # all replicas gone: the relaunch continues the run where its store says it is
    again = cli(
        tmp_path,
        "c",
        "toy.max_steps=96",
        "--run-id",
        "wedge-1",
        *_objstore(url),
        "-S",
        "diloco.state_every=3",
        env=moto,
    )
    finish(again, tmp_path / "c")
    _same_weights(tmp_path / "c", 96)
    assert min(r["round"] for i in (0, 1) for r in records(tmp_path / "c", i)) >= killed_at - 1


def test_two_launchers_join_one_run_and_a_hand_started_replica_must_name_it(moto, tmp_path):
    url = store_url("s3", tmp_path, "two")
    log_dir = tmp_path / "logs"
    common = ("--total-replicas", "2", "toy.max_steps=24", *_objstore(url))
    a = cli(tmp_path, "logs", "--first-index", "0", "--run-id", "joint", *common, env=moto, replicas=1)
    b = cli(tmp_path, "logs", "--first-index", "1", "--run-id", "joint", *common, env=moto, replicas=1)
    finish(a, log_dir)
    finish(b, log_dir)
    _same_weights(log_dir, 24)
    assert all(r["participants"] == 2 for i in (0, 1) for r in records(log_dir, i))
    # without --run-id the second launcher would start another run: refused before anything starts
    c = cli(tmp_path, "c", "--first-index", "1", "--total-replicas", "2", *_objstore(url), env=moto, replicas=1)
    out = finish(c, tmp_path / "c", rc=2)
    assert "--run-id" in out and "diloco.run_id" in out
    # a replica started by hand (no launcher, no run id) is refused with the fix
    hand = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer_plugins.diloco.run",
            "--target",
            "toy",
            "toy.max_steps=8",
            "diloco.transport=object_store",
            f"diloco.store={url}",
        ],
        cwd=tmp_path,
        env={**os.environ, **moto, "COMPOSER_DILOCO_STORE": url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert hand.returncode == 2 and "diloco.run_id" in hand.stderr, hand.stderr[-2000:]
