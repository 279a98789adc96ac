"""DiLoCo through an object store, as a user runs it: ``composer-plugins diloco --transport object_store``
against moto's S3 server (started and stopped here, loopback only) and against ``file://``.

Parity with the torchft path (bitwise), kill -9 of a replica and its restart (heals from the store), a
straggler left out of a round then caught up, exactly one manifest when two replicas close a round at
once, a run directory of another run refused, and the config checked once before any replica starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from serverless_support import HERE, WAIT_S, FaultyProxy, cli, finish, logs, records, result, store_url

from composer_plugins import procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def test_object_store_run_equals_torchft_run_bitwise(tmp_path):
    common = ("toy.max_steps=48",)
    a = cli(tmp_path, "tf", *common)
    finish(a, tmp_path / "tf")
    b = cli(
        tmp_path,
        "os",
        *common,
        "-S",
        "diloco.transport=object_store",
        "-S",
        f"diloco.store={store_url('file', tmp_path, 'parity')}",
    )
    finish(b, tmp_path / "os")
    # the second run really went through the store (were the transport setting ignored, this would compare the
    # torchft path with itself)
    assert list((tmp_path / "store-parity").rglob("manifest.json"))
    tf = [result(tmp_path / "tf", i) for i in (0, 1)]
    os_ = [result(tmp_path / "os", i) for i in (0, 1)]
    assert tf[0]["param_hash"] == tf[1]["param_hash"] == os_[0]["param_hash"] == os_[1]["param_hash"]
    assert tf[0]["eval_loss"] == os_[0]["eval_loss"]
    r_tf, r_os = records(tmp_path / "tf", 1), records(tmp_path / "os", 1)
    assert [r["param_hash"] for r in r_tf] == [r["param_hash"] for r in r_os]
    common_fields = {"outer_step", "committed", "participants", "healed", "param_hash", "inner_step", "replica"}
    assert common_fields <= set(r_os[0]) and common_fields <= set(r_tf[0])
    assert [(r["healed"], r["participants"]) for r in r_tf] == [(r["healed"], r["participants"]) for r in r_os]


def _pid(launcher: int, index: int, restart: int = 0) -> int | None:
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


def _wait(proc: subprocess.Popen[str], log_dir: Path, what: str, pred: Any) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if value := pred():
            return value
        if proc.poll() is not None:
            pytest.fail(f"the launcher exited while waiting for {what}\n{proc.stdout.read()}\n{logs(log_dir)}")
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}\n{logs(log_dir)}")


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_kill_9_replica_restarts_and_rejoins_from_the_store(tmp_path, request, kind):
    env = request.getfixturevalue("moto") if kind == "s3" else {}
    log_dir = tmp_path / "logs"
    proc = cli(
        tmp_path,
        "logs",
        "--max-restarts",
        "1",
        "toy.max_steps=160",
        "-S",
        "diloco.transport=object_store",
        "-S",
        f"diloco.store={store_url(kind, tmp_path, 'kill')}",
        "-S",
        "diloco.round_timeout_s=120",
        env=env,
    )
    try:
        _wait(proc, log_dir, "replica 1's third sync", lambda: len(records(log_dir, 1)) >= 3)
        pid = _wait(proc, log_dir, "replica 1's pid", lambda: _pid(proc.pid, 1))
        os.kill(pid, signal.SIGKILL)
        killed_at = max(r["outer_step"] for r in records(log_dir, 1))
        out = finish(proc, log_dir)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert "replica 1: exit codes [-9, 0] (restarts 1)" in out, out
    r0, r1 = records(log_dir, 0), records(log_dir, 1)
    back = [r for r in r1 if r["restart"] == 1]
    assert back and back[0]["healed"] and back[0]["outer_step"] > killed_at, back[:2]
    by0 = {r["outer_step"]: r for r in r0 if r["committed"]}
    joined = [r for r in back if r["committed"]]
    assert joined and all(r["participants"] == 2 for r in joined), back
    for r in joined:
        assert r["param_hash"] == by0[r["outer_step"]]["param_hash"], f"diverged at {r['outer_step']}"
    a, b = result(log_dir, 0), result(log_dir, 1)
    assert a["param_hash"] == b["param_hash"] and a["outer_step"] == b["outer_step"] == 160 // 8
    assert b["heal_count"] >= 1


def test_straggler_is_left_out_then_catches_up(tmp_path):
    log_dir = tmp_path / "logs"
    env = {
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "STRAGGLE_REPLICA": "1",
        "STRAGGLE_STEP": "20",
        "STRAGGLE_S": "6",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "composer_plugins",
            "diloco",
            "--replicas",
            "2",
            "--target",
            "store_fault_target:run",
            "--log-dir",
            str(log_dir),
            "--timeout",
            str(WAIT_S),
            "diloco.sync_every=8",
            "toy.max_steps=96",
            f"toy.output={log_dir}/result{{replica}}.json",
            "diloco.transport=object_store",
            f"diloco.store={store_url('file', tmp_path, 'late')}",
            "diloco.round_timeout_s=2",
        ],
        cwd=tmp_path,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    finish(proc, log_dir)
    r0, r1 = records(log_dir, 0), records(log_dir, 1)
    alone = [r for r in r0 if r["participants"] == 1]
    late = [r for r in r1 if not r["committed"]]
    assert alone and late, (r0, r1)
    assert late[0]["healed"] and late[0]["outer_step"] >= alone[0]["outer_step"]
    # caught up: later rounds have both again, with the same weights
    by0 = {r["outer_step"]: r for r in r0}
    after = [r for r in r1 if r["committed"] and r["round"] > late[0]["round"]]
    assert after and all(r["participants"] == 2 for r in after)
    assert all(r["param_hash"] == by0[r["outer_step"]]["param_hash"] for r in after)
    assert result(log_dir, 0)["param_hash"] == result(log_dir, 1)["param_hash"]


def test_two_replicas_closing_a_round_at_once_make_one_manifest(moto, monkeypatch, tmp_path):
    from composer_plugins.diloco.objstore import RoundStore
    from composer_plugins.diloco.store import ObjectStore

    for k, v in moto.items():
        monkeypatch.setenv(k, v)
    url = store_url("s3", tmp_path, "race")
    for trial in range(5):
        stores = [RoundStore(ObjectStore(url)) for _ in range(2)]
        gate = threading.Barrier(2)
        got: list[tuple[dict[str, Any], bool]] = [None, None]  # type: ignore[list-item]

        def close(
            i: int, stores: list = stores, gate: threading.Barrier = gate, got: list = got, trial: int = trial
        ) -> None:
            gate.wait()
            # each saw a different set: only one of the two proposals becomes the round
            got[i] = stores[i].close_round(trial, {i: f"grad-{i}-0"}, closer=i)

        threads = [threading.Thread(target=close, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(created for _, created in got) == [False, True]
        assert got[0][0] == got[1][0] == stores[0].manifest(trial)
        keys = [k for k in stores[0].store.list(RoundStore.round_dir(trial)) if k.endswith("manifest.json")]
        assert len(keys) == 1


def test_store_of_another_run_is_refused_with_a_located_error(tmp_path):
    url = store_url("file", tmp_path, "other")
    first = cli(tmp_path, "a", "toy.max_steps=16", "diloco.transport=object_store", f"diloco.store={url}")
    finish(first, tmp_path / "a")
    second = cli(tmp_path, "b", "toy.max_steps=16", "diloco.transport=object_store", f"diloco.store={url}")
    finish(second, tmp_path / "b", rc=1)
    text = (tmp_path / "b" / "replica0.log").read_text()
    assert "diloco.store" in text and "holds another run" in text and "run_id" in text and "fresh prefix" in text


def test_bad_diloco_key_is_reported_once_before_any_replica_starts(tmp_path):
    proc = cli(tmp_path, "bad", "-S", "diloco.bogus=1")
    out = finish(proc, tmp_path / "bad", rc=2)
    assert "diloco.bogus" in out and "Traceback" not in out
    assert not (tmp_path / "bad").exists() or not list((tmp_path / "bad").glob("replica*.log"))
    proc = cli(tmp_path, "bad2", "-S", "diloco.transport=object_store", "-S", "diloco.store=s4://x/y")
    out = finish(proc, tmp_path / "bad2", rc=2)
    assert "diloco.store" in out and "Did you mean 's3'" in out


def test_pseudo_gradient_codecs_checksums_and_int8_size():
    from composer_plugins.diloco.store import CorruptObjectError, decode_vector, encode_vector, pack, unpack

    g = torch.Generator().manual_seed(0)
    v = torch.randn(50_000, generator=g) * 1e-3
    sizes = {}
    for c in ("none", "bf16", "int8"):
        header, body = encode_vector(v, c)
        data = pack(header, body)
        h, b = unpack(data)
        d = decode_vector(h, b)
        sizes[c] = len(data)
        err = float((d - v).norm() / v.norm())
        assert err == 0.0 if c == "none" else err < {"bf16": 0.005, "int8": 0.02}[c], (c, err)
        with pytest.raises(CorruptObjectError):
            unpack(data[:-3])  # torn
        flipped = bytearray(data)
        flipped[-1] ^= 1
        with pytest.raises(CorruptObjectError):
            unpack(bytes(flipped))
    assert sizes["int8"] <= sizes["none"] / 4, sizes
    assert sizes["bf16"] <= sizes["none"] / 2 + 200, sizes


def test_an_object_whose_header_is_json_but_not_an_object_is_corrupt_naming_what_it_is():
    """A header that parses as JSON but is a list, a number or a string is a corrupt object (was AttributeError)."""
    import struct

    from composer_plugins.diloco.store import MAGIC, CorruptObjectError, unpack

    for header in (b"[1, 2]", b"7", b'"x"', b"null"):
        data = MAGIC + struct.pack("<I", len(header)) + header + b"body"
        with pytest.raises(CorruptObjectError, match=r"round 3/mean: its header is a JSON \w+, not an object"):
            unpack(data, "round 3/mean")


def test_ten_second_store_outage_is_survived_with_retries(moto, tmp_path):
    """A fault-injecting proxy in front of moto: 5 s of ``503 SlowDown`` then 5 s of dropped connections (open
    ones cut too) after a few syncs; both replicas wait it out (store_retry_s > the outage) and end equal."""
    host, port = moto["AWS_ENDPOINT_URL"].rsplit("//", 1)[1].split(":")
    proxy = FaultyProxy((host, int(port)))
    log_dir = tmp_path / "logs"
    try:
        proc = cli(
            tmp_path,
            "logs",
            "toy.max_steps=96",
            "-S",
            "diloco.transport=object_store",
            "-S",
            f"diloco.store={store_url('s3', tmp_path, 'outage')}",
            "-S",
            "diloco.store_retry_s=60",
            "-S",
            "diloco.round_timeout_s=60",
            env={**moto, "AWS_ENDPOINT_URL": proxy.endpoint},
        )
        try:
            _wait(proc, log_dir, "replica 0's second sync", lambda: len(records(log_dir, 0)) >= 2)
            before = len(records(log_dir, 0))
            proxy.outage(10.0)
            t0 = time.monotonic()
            out = finish(proc, log_dir)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    finally:
        proxy.close()
    assert time.monotonic() - t0 >= 10.0 and proxy.refused["503"] > 0 and proxy.refused["drop"] > 0, proxy.refused
    assert "exit codes [0]" in out
    a, b = result(log_dir, 0), result(log_dir, 1)
    assert a["param_hash"] == b["param_hash"] and a["outer_step"] == b["outer_step"] == 96 // 8
    r0, r1 = records(log_dir, 0), records(log_dir, 1)
    for rs in (r0, r1):
        assert all(r["committed"] and r["participants"] == 2 for r in rs), rs  # nobody left out
        hit = [r for r in rs if r["store_retries"] > 0]
        assert hit and max(r["sync_seconds"] for r in hit) > 5.0, rs  # the sync that waited out the outage
    assert all(r["round"] >= before - 1 for r in r0 if r["store_retries"] > 0)
    assert [r["param_hash"] for r in r0] == [r["param_hash"] for r in r1]
