"""Ctrl-C (a real SIGINT) to ``composer-plugins diloco`` (issue 51): the replicas are terminated, and the launcher
says what was kept (the run's states in the store) and how to continue (the same command with ``--run-id``), exit
130, as every long-running command does."""

from __future__ import annotations

import signal
import time

import pytest
from serverless_support import cli, logs, records, store_url

pytestmark = pytest.mark.slow


def test_ctrl_c_says_where_the_run_is_kept_and_how_to_continue_and_exits_130(tmp_path):
    log_dir = tmp_path / "logs"
    url = store_url("file", tmp_path, "sigint")
    args = ["toy.max_steps=100000", "-S", "diloco.transport=object_store", "-S", f"diloco.store={url}"]
    proc = cli(tmp_path, "logs", "--run-id", "sigint-run", *args)
    try:
        deadline = time.monotonic() + 180
        while len(records(log_dir, 0)) < 2:
            assert proc.poll() is None, proc.communicate()[0] + logs(log_dir)
            assert time.monotonic() < deadline, logs(log_dir)
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 130, out
    last = out.strip().splitlines()[-1]
    assert last == (
        f"interrupted: all replicas terminated; the run's global states are kept in {url}; "
        "continue it with the same command and --run-id sigint-run"
    ), out
    assert "Traceback" not in out
