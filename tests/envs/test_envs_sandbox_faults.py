"""The sandbox under faults: host paths read-only, bounded writes, no process outliving a SIGKILLed scorer, the
wall-clock limit enforced inside, leftover directories removed, and the allow-list view of the host."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from composer_plugins.envs.sandbox import (
    OWNER_FILE,
    Sandbox,
    SandboxLimits,
    isolation_info,
    remove_leftover_sandboxes,
)

FAST = SandboxLimits(wall_time_s=20, memory_mb=None)
NS = isolation_info().namespaces
needs_ns = pytest.mark.skipif(not NS, reason="namespace isolation is not available on this machine")


def sandbox_pids(sandbox_id: str) -> list[int]:
    """Live processes carrying ``CP_SANDBOX_ID=<sandbox_id>`` (every sandboxed process does)."""
    marker = f"CP_SANDBOX_ID={sandbox_id}".encode()
    out = []
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            if marker in Path(f"/proc/{e.name}/environ").read_bytes().split(b"\0"):
                state = Path(f"/proc/{e.name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
                if state != b"Z":
                    out.append(int(e.name))
        except OSError:
            continue
    return out


def any_sandbox_ids() -> set[str]:
    ids = set()
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                for kv in Path(f"/proc/{e.name}/environ").read_bytes().split(b"\0"):
                    if kv.startswith(b"CP_SANDBOX_ID="):
                        ids.add(kv.split(b"=", 1)[1].decode())
            except OSError:
                pass
    return ids


WRITES = textwrap.dedent(
    """
    import os
    name = os.environ["PROBE"]
    for p in ["/var/tmp/" + name, "/dev/shm/" + name, "here.txt"]:
        try:
            with open(p, "w") as f:
                f.write("x")
            print("WROTE", p)
        except OSError as e:
            print("DENIED", p, e.errno)
    """
)


@pytest.mark.parametrize(
    "layer", [pytest.param("kernel", marks=needs_ns), "guard"], ids=["namespaces-kernel-only", "guard"]
)
def test_host_paths_are_read_only_except_the_work_dir(layer):
    kw = {"isolation": "namespaces", "audit_guard": False} if layer == "kernel" else {"isolation": "guard"}
    probe = f"cp-probe-{uuid.uuid4().hex[:8]}"
    try:
        res = Sandbox(FAST, **kw).run_code(WRITES, env={"PROBE": probe})
        assert res.returncode == 0, res.tail()
        assert f"DENIED /var/tmp/{probe}" in res.stdout, res.stdout
        assert "WROTE here.txt" in res.stdout
        # /dev/shm: refused (guard) or a private tmpfs of the sandbox (kernel); never the host's
        assert not Path("/dev/shm", probe).exists() and not Path("/var/tmp", probe).exists()
    finally:
        for d in ("/var/tmp", "/dev/shm"):
            Path(d, probe).unlink(missing_ok=True)


@pytest.mark.parametrize("mode", ["auto", "guard"])
def test_total_writes_are_bounded(mode):
    lim = SandboxLimits(wall_time_s=30, memory_mb=None, max_file_mb=8, max_disk_mb=40)
    code = textwrap.dedent(
        """
        import time
        for i in range(100):  # 100 files of 4 MiB, each under the file-size limit: 400 MiB in all
            with open(f"f{i}.bin", "wb") as f:
                f.write(b"x" * (4 << 20))
            time.sleep(0.02)
        print("wrote everything")
        """
    )
    res = Sandbox(lim, isolation=mode).run_code(code)
    assert res.killed == "disk_limit", (res.killed, res.tail())
    assert "wrote everything" not in res.stdout


SCORER = textwrap.dedent(
    """
    import sys
    from composer_plugins.envs.sandbox import Sandbox, SandboxLimits
    wall = float(sys.argv[2])
    sb = Sandbox(SandboxLimits(wall_time_s=wall, cpu_time_s=600, memory_mb=None), isolation=sys.argv[1],
                 allow_subprocess=True, tmp_dir=sys.argv[3])
    # a child process and a grandchild that leaves the process group, all spinning
    code = "import os, subprocess, sys, time\\n" \\
           "subprocess.Popen([sys.executable, '-c', 'while True: pass'], start_new_session=True)\\n" \\
           "print('started', flush=True)\\n" \\
           "while True: time.sleep(0.1)\\n"
    sb.run_code(code, limits=sb.limits)
    """
)


def start_scorer(mode: str, wall: float, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    before = any_sandbox_ids()
    proc = subprocess.Popen(
        [sys.executable, "-c", SCORER, mode, str(wall), str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = {i for i in any_sandbox_ids() - before if i.startswith("cp-sandbox-")}
        mine = [i for i in new if (tmp / i).exists()]
        if mine and len(sandbox_pids(mine[0])) >= 3:  # launcher, target and its grandchild are running
            return proc, mine[0]
        if proc.poll() is not None:
            pytest.fail(f"the scorer exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the sandboxed processes never started")


def wait_gone(sandbox_id: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = sandbox_pids(sandbox_id)
        if not left:
            return []
        time.sleep(0.1)
    return sandbox_pids(sandbox_id)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", [pytest.param("namespaces", marks=needs_ns), "guard"])
def test_sigkill_of_the_scorer_leaves_nothing_running_and_the_next_start_cleans_up(mode, tmp_path):
    proc, sid = start_scorer(mode, wall=120, tmp=tmp_path)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        left = wait_gone(sid, 20)  # far below the 120 s wall limit: they die with the scorer
        assert not left, f"still running after the scorer was killed: {left}"
    finally:
        for pid in sandbox_pids(sid):
            os.kill(pid, signal.SIGKILL)
    assert (tmp_path / sid).is_dir()  # the dead scorer could not remove it
    res = Sandbox(FAST, isolation=mode, tmp_dir=str(tmp_path)).run_code("print('hi')")
    assert res.ok and "hi" in res.stdout
    assert not (tmp_path / sid).exists(), "the next sandbox start did not remove the leftover directory"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", [pytest.param("namespaces", marks=needs_ns), "guard"])
def test_wall_limit_is_enforced_inside_when_the_scorer_cannot(mode, tmp_path):
    proc, sid = start_scorer(mode, wall=3, tmp=tmp_path)
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # the scorer is alive but can enforce nothing
        left = wait_gone(sid, 40)
        assert not left, f"still running past the wall limit with the scorer stopped: {left}"
    finally:
        for pid in sandbox_pids(sid):
            os.kill(pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_leftover_directories_of_dead_owners_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / "cp-sandbox-dead"
    (gone / "work").mkdir(parents=True)
    stat = Path(f"/proc/{os.getpid()}/stat").read_bytes()
    started = stat[stat.rfind(b")") + 2 :].split()[19].decode()
    (gone / OWNER_FILE).write_text(f"{dead.pid} 0\n")
    live = tmp_path / "cp-sandbox-live"
    live.mkdir()
    (live / OWNER_FILE).write_text(f"{os.getpid()} {started}\n")
    other = tmp_path / "not-a-sandbox"
    other.mkdir()
    assert remove_leftover_sandboxes(tmp_path) == [str(gone)]
    assert live.exists() and other.exists() and not gone.exists()


@pytest.mark.parametrize("mode", [pytest.param("namespaces", marks=needs_ns), "guard"])
def test_allowlist_mode_hides_other_copies_of_a_repository(mode):
    # another checkout of the repository somewhere on the host (outside home and the temp dir)
    copy = Path(tempfile.mkdtemp(prefix="cp-repo-copy-", dir="/var/tmp"))
    try:
        (copy / "solution.py").write_text("SECRET = 42\n")
        copy.chmod(0o755)  # readable by anyone, as a checkout usually is
        code = f"print(open({str(copy / 'solution.py')!r}).read())"
        seen = Sandbox(FAST, isolation=mode).run_code(code)
        assert "SECRET = 42" in seen.stdout  # the default view: every path not hidden is readable
        res = Sandbox(FAST, isolation=mode, expose="allowlist").run_code(code + "\nimport json, email\n")
        assert "SECRET = 42" not in res.stdout and res.returncode != 0, res.stdout
        ok = Sandbox(FAST, isolation=mode, expose="allowlist").run_code("import json, csv; print('stdlib ok')")
        assert ok.ok and "stdlib ok" in ok.stdout, ok.tail()
    finally:
        shutil.rmtree(copy, ignore_errors=True)
