"""Ctrl-C during ``replay run`` (issue 51): a real SIGINT to the process mid-run says what was saved (the answers
in the cache) and how to continue, and exits 130 (it exited 0 with nothing printed, which a scheduler reads as
"finished")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from test_teachers_replay_cli import KEY_ENV, REPO, SECRET, _config, _teacher

from composer_plugins.teachers.cache import ReplayCache
from composer_plugins.testing.teacher_data import write_sample_traces


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_says_what_was_saved_and_how_to_continue_and_exits_130(srv, tmp_path):
    srv.configure(latency_s=0.05)
    traces = write_sample_traces(tmp_path / "traces.jsonl", n=90, wrong_every=3)
    teachers = [_teacher(srv, "teacher-a", max_concurrency=2), _teacher(srv, "teacher-b", max_concurrency=2)]
    cfg = _config(tmp_path, srv, traces, teachers=teachers, consensus={"k": 2}, normalize={"enabled": False})
    cmd = [sys.executable, "-m", "composer_plugins.core.cli", "replay", "run", "--config", str(cfg), "--no-progress"]
    env = {**os.environ, KEY_ENV: SECRET, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        preexec_fn=_sigint_default,
    )
    try:
        deadline = time.monotonic() + 120
        while srv.stats()["billed_calls"] < 30:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the replay did not make progress"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (out, err)
    with ReplayCache(tmp_path / "cache" / "replay.sqlite") as cache:
        cached = len(cache)
    assert 0 < cached < 180
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"interrupted: {cached} answer(s) saved in {tmp_path / 'cache' / 'replay.sqlite'}"), err
    assert "run the same command again" in line and "not paid again" in line, line
    assert "Traceback" not in err and SECRET not in out + err
