"""The launcher path of a restart, as a user runs it: ``composer-plugins diloco --max-restarts 1 ...``, then
``kill -9`` of replica 1's process. The restarted process must rejoin the job: heal from the live peer at
its first sync, take the peers' torchft step, bring ``participants`` back to 2, and hold bit-identical
weights after every later sync; both finish on the same torchft step with the same weights.

The second test lands the kill while the peer is inside the all-reduce of a sync (the killed replica holds
its all-reduce, see ``diloco_fault_target.py``): the peer's sync fails and rolls back, then the same.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from composer_plugins import procs

HERE = Path(__file__).parent
WAIT_S = 240.0
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def records(log_dir: Path, index: int) -> list[dict[str, Any]]:
    p = log_dir / f"replica{index}.sync.jsonl"
    out = []
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # being written
                pass
    return out


def launch(
    tmp_path: Path, target: str, *overrides: str, env: dict[str, str] | None = None, options: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "composer_plugins",
        "diloco",
        "--replicas",
        "2",
        "--max-restarts",
        "1",
        "--target",
        target,
        "--log-dir",
        str(tmp_path / "logs"),
        "--timeout",
        str(WAIT_S),
        *options,
        "diloco.sync_every=8",
        "toy.max_steps=160",
        *overrides,
    ]
    return subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def logs(tmp_path: Path) -> str:
    out = []
    for p in sorted((tmp_path / "logs").glob("replica*.log")):
        lines = [ln for ln in p.read_text(errors="replace").splitlines() if "torchft::" not in ln]
        out.append(f"--- {p.name} ---\n" + "\n".join(lines[-40:]))
    return "\n".join(out)


def wait_for(proc: subprocess.Popen[str], tmp_path: Path, what: str, pred: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the launcher exited ({proc.returncode}) while waiting for {what}\n{logs(tmp_path)}")
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}\n{logs(tmp_path)}")


def replica_pid(launcher: int, index: int, restart: int = 0) -> int | None:
    """The pid of replica ``index`` (as ``ps``/``/proc`` shows it to a user: its environment says which)."""
    for pid in procs.descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"COMPOSER_DILOCO_REPLICA_INDEX={index}".encode() in env and (
            f"COMPOSER_DILOCO_RESTART={restart}".encode() in env
        ):
            return pid
    return None


def finish(proc: subprocess.Popen[str], tmp_path: Path) -> str:
    try:
        out, _ = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the launcher did not finish\n{out}\n{logs(tmp_path)}")
    assert proc.returncode == 0, f"{out}\n{logs(tmp_path)}"
    assert "replica 0: exit codes [0] (restarts 0)" in out, out
    assert "replica 1: exit codes [-9, 0] (restarts 1)" in out, out
    return out


def check_rejoined(log_dir: Path, killed_at: int) -> None:
    r0, r1 = records(log_dir, 0), records(log_dir, 1)
    by_step0 = {r["outer_step"]: r for r in r0 if r["committed"]}
    back = [r for r in r1 if r["restart"] == 1]
    assert back, "the restarted replica never synced"
    first = back[0]
    # healed from the live peer at its first sync, at the peers' torchft step (not step 1 with fresh weights)
    assert first["healed"] and first["committed"], first
    assert first["outer_step"] > killed_at, (first, killed_at)
    for r in back:
        assert r["committed"] and r["participants"] == 2, r
        assert r["param_hash"] == by_step0[r["outer_step"]]["param_hash"], f"diverged at step {r['outer_step']}"
    # replica 0: participants back to 2 from the rejoin on, to its last sync, which is replica 1's last
    assert all(r["participants"] == 2 for r in r0 if r["outer_step"] >= first["outer_step"])
    assert r0[-1]["outer_step"] == back[-1]["outer_step"] >= 160 // 8
    out0 = json.loads((log_dir / "result0.json").read_text())
    out1 = json.loads((log_dir / "result1.json").read_text())
    assert out0["param_hash"] == out1["param_hash"] == r0[-1]["param_hash"]
    assert out0["outer_step"] == out1["outer_step"] and out1["heal_count"] == 1


@pytest.mark.parametrize("heartbeat_ms", [None, 1000], ids=["as-in-the-issue", "fast-heartbeat"])
def test_cli_restarted_replica_rejoins_after_kill_9(tmp_path, heartbeat_ms):
    # With a 1 s heartbeat timeout the lighthouse drops the dead replica long before its restart has
    # imported torch, so the survivor races to the end of this short run: it must wait at its last sync.
    log_dir = tmp_path / "logs"
    options = ("--heartbeat-timeout-ms", str(heartbeat_ms)) if heartbeat_ms else ()
    proc = launch(tmp_path, "toy", f"toy.output={log_dir}/result{{replica}}.json", options=options)
    try:
        wait_for(proc, tmp_path, "replica 1's third sync", lambda: len(records(log_dir, 1)) >= 3)
        pid = wait_for(proc, tmp_path, "replica 1's pid", lambda: replica_pid(proc.pid, 1))
        os.kill(pid, signal.SIGKILL)
        killed_at = max(r["outer_step"] for r in records(log_dir, 1))
        finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    check_rejoined(log_dir, killed_at)


def test_cli_restarted_replica_rejoins_after_kill_during_allreduce(tmp_path):
    log_dir, marks = tmp_path / "logs", tmp_path / "marks"
    marks.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "FAULT_DIR": str(marks),
        "FAULT_HOLD_REPLICA": "1",
        "FAULT_HOLD_SYNC": "3",
        "FAULT_HOLD_S": "120",
    }
    out = f"toy.output={log_dir}/result{{replica}}.json"
    proc = launch(tmp_path, "diloco_fault_target:run", "diloco.timeout_s=30", out, env=env)
    held, peer = marks / "allreduce-r1-restart0-sync3", marks / "allreduce-r0-restart0-sync3"
    try:
        # replica 0 is inside the all-reduce of sync 3, waiting for replica 1, which holds its own
        both_inside = lambda: held.exists() and peer.exists()  # noqa: E731
        wait_for(proc, tmp_path, "both replicas inside the all-reduce of sync 3", both_inside)
        os.kill(int(held.read_text()), signal.SIGKILL)
        finish(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    r0 = records(log_dir, 0)
    # the sync in flight failed on the survivor and was rolled back (torchft), then it went on
    failed = [r for r in r0 if not r["committed"]]
    assert failed and failed[0]["outer_step"] == 2, r0[:5]
    check_rejoined(log_dir, killed_at=2)
