"""``composer_plugins.procs``: bounded waits on children, no orphans, and runs whose timeout kills the whole tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from composer_plugins import procs

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG are Linux-only"),
]

PY = sys.executable


def alive(pid: int) -> bool:
    info = procs.proc_info(pid)
    return info is not None and info.state != "Z"


def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def read_pids(path: Path, n: int, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            pids = [int(x) for x in path.read_text().split()]
            if len(pids) >= n:
                return pids
        time.sleep(0.05)
    raise AssertionError(f"{path} did not get {n} pids")


# A child that starts a grandchild in its own session (setsid), writes both pids, then sleeps.
SPAWNER = textwrap.dedent("""
    import subprocess, sys, time, os
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    open(sys.argv[1], "w").write(f"{os.getpid()} {g.pid}")
    time.sleep(300)
""")


def test_failed_child_is_named_at_once_with_its_output_and_siblings_are_stopped(tmp_path):
    with procs.Children("t") as kids:
        kids.start("sleeper", [PY, "-c", "import time; time.sleep(300)"], log_path=tmp_path / "sleeper.log")
        kids.start(
            "crasher",
            [PY, "-c", "import sys, time; time.sleep(0.3); print('about to fail', flush=True); sys.exit(3)"],
            log_path=tmp_path / "crasher.log",
        )
        t0 = time.monotonic()
        with pytest.raises(procs.ChildFailed) as ei:
            kids.wait(120)
        assert time.monotonic() - t0 < 10  # not at the deadline
    msg = str(ei.value)
    assert "crasher" in msg and "exited with code 3" in msg and "about to fail" in msg and "stopped sleeper" in msg
    assert ei.value.child is not None and ei.value.child.name == "crasher"
    assert wait_gone([c.pid for c in kids.children])


def test_killed_child_is_reported_with_its_signal(tmp_path):
    with procs.Children("t") as kids:
        c = kids.start("victim", [PY, "-c", "import time; time.sleep(300)"], log_path=tmp_path / "v.log")
        threading.Timer(0.5, lambda: os.kill(c.pid, signal.SIGKILL)).start()
        with pytest.raises(procs.ChildFailed, match="victim .* was killed by SIGKILL"):
            kids.wait(60)


def test_stuck_child_is_dumped_and_killed_at_the_deadline(tmp_path):
    code = (
        "import faulthandler, signal, time\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        "def stuck_here():\n    time.sleep(300)\nstuck_here()\n"
    )
    with procs.Children("t") as kids:
        c = kids.start("stuck", [PY, "-c", code], log_path=tmp_path / "stuck.log")
        t0 = time.monotonic()
        with pytest.raises(procs.ChildFailed) as ei:
            kids.wait(2.0)
        assert time.monotonic() - t0 < 10
    msg = str(ei.value)
    assert "stuck" in msg and "still running after 2s" in msg
    assert "in stuck_here" in msg  # its Python stack, from faulthandler, in the message
    assert wait_gone([c.pid])


def test_straggler_after_a_clean_exit_is_bounded(tmp_path):
    with procs.Children("t", dump_signal=None) as kids:
        kids.start("quick", [PY, "-c", "pass"])
        kids.start("hangs on exit", [PY, "-c", "import time; time.sleep(300)"])
        with pytest.raises(procs.ChildFailed, match="hangs on exit .* still running 1s after quick exited 0"):
            kids.wait(120, straggler_s=1.0)


def test_kill_all_reaches_grandchildren_in_their_own_sessions(tmp_path):
    out = tmp_path / "pids"
    with procs.Children("t") as kids:
        kids.start("spawner", [PY, "-c", SPAWNER, str(out)])
        child, grandchild = read_pids(out, 2)
        assert procs.proc_info(grandchild).sid != procs.proc_info(child).sid  # not in the child's group
        assert grandchild in procs.tagged_pids(kids.tag)
    assert wait_gone([child, grandchild])


def test_child_dies_with_a_sigkilled_parent(tmp_path):
    """The parent runs no cleanup at all; PR_SET_PDEATHSIG still takes its child down."""
    out = tmp_path / "pids"
    parent_code = (
        "import sys, time\nfrom composer_plugins import procs\n"
        "kids = procs.Children('p')\n"
        f"c = kids.start('sleeper', [sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(out)!r}, 'w').write(str(c.pid))\ntime.sleep(300)\n"
    )
    parent = subprocess.Popen([PY, "-c", parent_code], start_new_session=True)
    try:
        (child,) = read_pids(out, 1)
        assert alive(child)
        parent.kill()
        parent.wait(10)
        assert wait_gone([child])
    finally:
        procs.kill_tree(parent.pid if parent.poll() is None else None)


def test_wait_announces_what_it_waits_for(tmp_path, monkeypatch):
    status = tmp_path / "status"
    monkeypatch.setenv(procs.WAIT_STATUS_ENV, str(status))
    seen: list[str] = []
    with procs.Children("t") as kids:
        kids.start("w0", [PY, "-c", "import time; time.sleep(0.5)"])
        threading.Timer(0.2, lambda: seen.append(status.read_text())).start()
        kids.wait(30)
    assert seen and seen[0].startswith("w0 (pid ")
    assert status.read_text() == ""  # cleared once the wait is over


@pytest.mark.slow
def test_conftest_kills_and_reports_what_a_test_leaves_behind(tmp_path):
    """The suite's safety net: a process a test forgot is killed once the test is over, with a warning."""
    (tmp_path / "conftest.py").write_text((Path(__file__).parents[1] / "conftest.py").read_text())
    pidfile = tmp_path / "pid"
    (tmp_path / "test_leak.py").write_text(
        textwrap.dedent(f"""
        import subprocess, sys
        import pytest

        @pytest.fixture
        def server():
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
            yield p  # and never stopped

        def test_leaks(server):
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
            open({str(pidfile)!r}, "w").write(f"{{server.pid}} {{p.pid}}")
            assert False, "fails, and cleans nothing up"
    """)
    )
    res = subprocess.run(
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "test_leak.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    server, leaked = read_pids(pidfile, 2)
    assert wait_gone([server, leaked]), out
    assert "LeftoverProcessWarning" in out and "fixture 'server' left 1 process(es)" in out
    assert "test test_leak.py::test_leaks left 1 process(es)" in out


@pytest.mark.slow
def test_conftest_spares_the_test_process_own_mpi_singleton_daemon(tmp_path):
    """An MPI-linked import (seen on the GPU image) starts ``orted --singleton-died-pipe`` as a child of the test
    process for the process's life, and the process exits 195 once it dies: the sweep must leave it alone (the
    GPU tier once ended at the test after the first one that imported it), and still kill a real leftover."""
    (tmp_path / "conftest.py").write_text((Path(__file__).parents[1] / "conftest.py").read_text())
    pidfile = tmp_path / "pid"
    (tmp_path / "test_mpi.py").write_text(
        textwrap.dedent(f"""
        import os, subprocess, sys, threading, time

        DAEMON = None

        def test_imports_an_mpi_library():
            global DAEMON
            # what OpenMPI's singleton does: a daemon child, and the parent exits 195 when it dies
            DAEMON = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                                       "orted", "--hnp", "--singleton-died-pipe", "39"])
            def watch():
                DAEMON.wait()
                os._exit(195)
            threading.Thread(target=watch, daemon=True).start()
            leak = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            open({str(pidfile)!r}, "w").write(f"{{DAEMON.pid}} {{leak.pid}}")

        def test_next_one_still_runs():
            time.sleep(0.5)
            assert DAEMON.poll() is None
    """)
    )
    res = subprocess.run(
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "test_mpi.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = res.stdout + res.stderr
    daemon, leaked = read_pids(pidfile, 2)
    try:
        assert res.returncode == 0, out
        assert "2 passed" in out, out
        assert wait_gone([leaked]), out
        assert "test_imports_an_mpi_library left 1 process(es)" in out, out
    finally:
        procs.kill_tree(daemon)


def test_run_timeout_kills_the_whole_tree(tmp_path):
    out = tmp_path / "pids"
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run([PY, "-c", SPAWNER, str(out)], timeout=3)
    assert time.monotonic() - t0 < 15
    assert wait_gone(read_pids(out, 2))  # the child and its grandchild in a session of its own


def test_run_returns_like_subprocess_run_and_kills_background_leftovers(tmp_path):
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
        f"open({str(tmp_path / 'bg')!r}, 'w').write(str(p.pid))\nprint('done')\n"
    )
    res = procs.run([PY, "-c", code], timeout=60, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "done"
    assert wait_gone(read_pids(tmp_path / "bg", 1))
    with pytest.raises(subprocess.CalledProcessError):
        procs.run([PY, "-c", "raise SystemExit(4)"], timeout=60, check=True)
