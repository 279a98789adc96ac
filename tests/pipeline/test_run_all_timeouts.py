"""``benchmarks/run_all``: a default timeout by mode, a report of what a stuck benchmark waited for, no orphans."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from composer_plugins import procs

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and PR_SET_PDEATHSIG"),
]

# Starts a grandchild in its own process group and one in a session of its own (out of reach of killpg),
# writes the three pids, then blocks "waiting for the peer" forever.
HANG = textwrap.dedent("""
    import os, subprocess, sys, time
    from composer_plugins.procs import waiting_for

    def waiting_in_here():
        time.sleep(600)

    def run(quick=False):
        same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        open(os.environ["FAKE_PIDS"], "w").write(f"{os.getpid()} {same.pid} {own.pid}")
        with waiting_for("the peer that never answers"):
            waiting_in_here()
""")

LEAK = textwrap.dedent("""
    import os, subprocess, sys

    def run(quick=False):
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        open(os.environ["FAKE_PIDS"], "w").write(str(p.pid))
        return {"name": "leak", "results": {}, "ratios": {}, "targets": {}}
""")


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import run_all

    pkg = tmp_path / "fakeslow"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bench_hang.py").write_text(HANG)
    (pkg / "bench_leak.py").write_text(LEAK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "pids"))
    return run_all, tmp_path


def _alive(pid: int) -> bool:
    info = procs.proc_info(pid)
    return info is not None and info.state != "Z"


def test_default_timeout_depends_on_the_mode(fake) -> None:
    run_all, _ = fake
    assert run_all.default_timeout(True) == run_all.DEFAULT_TIMEOUT_S["quick"] > 0
    assert run_all.default_timeout(False) == run_all.DEFAULT_TIMEOUT_S["full"] > run_all.default_timeout(True)


def test_benchmark_past_the_default_timeout_is_reported_and_its_whole_tree_killed(fake, monkeypatch, capsys) -> None:
    run_all, tmp_path = fake
    monkeypatch.setitem(run_all.DEFAULT_TIMEOUT_S, "quick", 3.0)
    t0 = time.monotonic()
    report = run_all.run_all(quick=True, modules=["fakeslow.bench_hang"], log_dir=tmp_path / "logs")
    took = time.monotonic() - t0
    (b,) = report["benchmarks"]
    assert not b["ok"] and took < 20
    err = b["error"]
    assert err.startswith("timed out after 3s (the default for --quick runs)"), err
    assert "waiting for the peer that never answers" in err
    assert "bench_hang.py" in err and "in waiting_in_here" in err  # where its main thread was stuck
    pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), procs.describe(pids)  # benchmark, grandchild, own-session grandchild
    out = capsys.readouterr().out
    assert "hang TIMED OUT after 3s" in out and "FAILED: timed out after 3s" in out
    assert "waiting for the peer that never answers" in out and "in waiting_in_here" in out
    assert "most recent call first" in (tmp_path / "logs" / "hang.stderr.log").read_text()  # the stacks, kept
    assert report["timeout_s"] == 3.0


def test_processes_a_finished_benchmark_left_behind_are_killed_and_reported(fake, capsys) -> None:
    run_all, tmp_path = fake
    res = run_all.run_one("fakeslow.bench_leak", quick=True, timeout=60)
    assert res["ok"], res
    (pid,) = [int(x) for x in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    assert "leak left 1 process(es) behind; killed them" in capsys.readouterr().out


def test_explicit_zero_timeout_means_none(fake) -> None:
    run_all, _ = fake
    res = run_all.run_one("fakeslow.bench_leak", quick=True, timeout=0)
    assert res["ok"], res
