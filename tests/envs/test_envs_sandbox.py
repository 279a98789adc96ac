"""The sandbox fails safely under the attacks untrusted model code makes.

Every attack runs for real: infinite loops, fork bombs, huge outputs, memory and disk bombs,
connections to a loopback server the test starts, reading API keys (environment, /proc),
reading hidden files, forging the result channel, writing read-only trees, escaping the
process group. Each runs under the isolation this machine supports ("auto": namespaces where
unshare works) and under the audit-hook guard alone ("guard"); network and /proc attacks also
run against each layer on its own.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from composer_plugins.envs.sandbox import (
    Sandbox,
    SandboxError,
    SandboxLimits,
    copy_clean_tree,
    isolation_info,
    safe_env,
    scrub_tree,
)

INFO = isolation_info()
MODES = ["auto", "guard"]
FAST = SandboxLimits(wall_time_s=4, cpu_time_s=3, memory_mb=512, max_processes=12, max_output_bytes=20_000)


def make(mode: str, limits: SandboxLimits = FAST, **kw: object) -> Sandbox:
    return Sandbox(limits, isolation=mode, **kw)  # type: ignore[arg-type]


def alive_with_marker(sandbox_id: str) -> list[int]:
    """Processes (not zombies) whose environment carries this run's sandbox id."""
    marker = f"CP_SANDBOX_ID={sandbox_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


class CountingServer:
    """A loopback TCP server that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def server():
    srv = CountingServer()
    yield srv
    srv.close()


def test_isolation_info_and_auto_mode():
    assert INFO.mode in ("namespaces", "guard")
    assert make("auto").isolation == INFO.mode
    assert make("guard").isolation == "guard"
    if not INFO.namespaces:
        with pytest.raises(SandboxError, match="not available"):
            make("namespaces")


@pytest.mark.parametrize("mode", MODES)
def test_plain_run_and_scrubbed_environment(mode, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-SECRET-0451")
    monkeypatch.setenv("HF_TOKEN", "hf_SECRET-0451")
    res = make(mode).run_code(
        "import os, sys\nprint('hello', sorted(os.environ))\nprint(sys.flags.dont_write_bytecode)"
    )
    assert res.ok, res.stderr
    assert "hello" in res.stdout
    assert "SECRET-0451" not in res.stdout
    assert "OPENAI_API_KEY" not in res.stdout and "HF_TOKEN" not in res.stdout
    assert res.stdout.strip().endswith("1")  # PYTHONDONTWRITEBYTECODE


def test_safe_env_refuses_secret_looking_variables():
    with pytest.raises(SandboxError, match="looks like a secret"):
        safe_env("/tmp/x", sys.executable, {"MY_API_KEY": "x"})
    assert safe_env("/tmp/x", sys.executable, {"FOO": "1"})["FOO"] == "1"


@pytest.mark.parametrize("mode", MODES)
def test_reading_secrets_from_proc_fails(mode, monkeypatch):
    """The parent's environment (API keys) is not reachable through /proc either."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-SECRET-0452")
    code = (
        "import os\n"
        "seen = []\n"
        "for pid in os.listdir('/proc') if os.path.isdir('/proc') else []:\n"
        "    if not pid.isdigit():\n        continue\n"
        "    for name in ('environ', 'cmdline'):\n"
        "        try:\n            seen.append(open(f'/proc/{pid}/{name}', 'rb').read().decode('latin1'))\n"
        "        except OSError as e:\n            pass\n"
        f"for pid in (os.getppid(), 1, {os.getpid()}):\n"
        "    try:\n        seen.append(open(f'/proc/{pid}/environ', 'rb').read().decode('latin1'))\n"
        "    except OSError as e:\n        seen.append('denied')\n"
        "print('\\n'.join(seen))\n"
    )
    res = make(mode).run_code(code)
    assert "SECRET-0452" not in res.stdout + res.stderr
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_is_killed(mode):
    sb = make(mode, SandboxLimits(wall_time_s=2, cpu_time_s=30, memory_mb=512))
    res = sb.run_code("while True:\n    pass\n")
    assert res.killed == "timeout" and res.timed_out
    assert res.duration_s < 30
    assert alive_with_marker(res.sandbox_id) == []


@pytest.mark.parametrize("mode", MODES)
def test_cpu_time_limit(mode):
    sb = make(mode, SandboxLimits(wall_time_s=60, cpu_time_s=1, memory_mb=512))
    res = sb.run_code("x = 0\nwhile True:\n    x += 1\n")
    assert res.killed == "cpu_limit", (res.returncode, res.stderr)


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_contained(mode):
    code = (
        "import os, sys, time\n"
        "n = 0\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            continue\n"  # every child keeps forking: a real fork bomb
        "        n += 1\n"
        "    except OSError as e:\n"
        "        print('fork refused', type(e).__name__, flush=True)\n"
        "        time.sleep(30)\n"
    )
    res = make(mode, SandboxLimits(wall_time_s=3, cpu_time_s=10, max_processes=12, memory_mb=512)).run_code(code)
    assert "fork refused" in res.stdout
    assert res.killed == "timeout"
    time.sleep(0.2)
    assert alive_with_marker(res.sandbox_id) == []


@pytest.mark.parametrize("mode", MODES)
def test_daemonised_process_does_not_survive(mode):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('parent done', flush=True)\n"
    )
    res = make(mode).run_code(code)
    assert "parent done" in res.stdout
    time.sleep(0.2)
    assert alive_with_marker(res.sandbox_id) == []


@pytest.mark.parametrize("mode", MODES)
def test_huge_output_is_capped(mode):
    res = make(mode).run_code("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    assert res.killed == "output_limit"
    assert len(res.stdout) <= FAST.max_output_bytes


@pytest.mark.parametrize("mode", MODES)
def test_memory_bomb_fails(mode):
    res = make(mode).run_code("x = bytearray(4 * 1024 ** 3)\nprint('allocated')\n")
    assert "allocated" not in res.stdout
    assert res.killed == "memory_limit"


@pytest.mark.parametrize("mode", MODES)
def test_disk_bomb_stops_at_file_size_limit(mode):
    lim = SandboxLimits(wall_time_s=10, max_file_mb=1, memory_mb=512)
    res = make(mode, lim).run_code("f = open('big', 'wb')\nfor _ in range(100):\n    f.write(b'x' * (1 << 20))\n")
    assert res.killed == "file_size_limit" or "File too large" in res.stderr


def _net_code(port: int) -> str:
    return (
        "import socket, urllib.request\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "    print('CONNECTED')\n"
        "except OSError as e:\n"
        "    print('refused', type(e).__name__, e)\n"
        "try:\n"
        f"    urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)\n"
        "    print('CONNECTED')\n"
        "except Exception as e:\n"
        "    print('refused', type(e).__name__)\n"
        "try:\n"
        "    socket.getaddrinfo('example.com', 80)\n"
        "    print('RESOLVED')\n"
        "except OSError as e:\n"
        "    print('refused dns', type(e).__name__)\n"
    )


NET_LAYERS = ["auto", "guard"] + (["namespaces_only"] if INFO.namespaces else [])


@pytest.mark.parametrize("layer", NET_LAYERS)
def test_network_to_loopback_server_is_refused(layer, server):
    """A server on 127.0.0.1 started by this test is unreachable from inside the sandbox."""
    if layer == "namespaces_only":  # the kernel alone: no audit hook
        sb = Sandbox(FAST, isolation="namespaces", audit_guard=False)
    else:
        sb = make(layer)
    res = sb.run_code(_net_code(server.port))
    assert "CONNECTED" not in res.stdout and "RESOLVED" not in res.stdout
    assert res.stdout.count("refused") == 3, res.stdout + res.stderr
    # and the server never saw a connection (the test process itself can connect)
    assert server.accepted == 0
    socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    deadline = time.monotonic() + 5
    while server.accepted == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.accepted == 1


def test_guard_blocks_programs_and_native_calls(server):
    """In guard mode a child program would escape the audit hook, so programs and ctypes are refused."""
    code = (
        "import subprocess, sys, ctypes, gc\n"
        "for attempt in (\n"
        "    lambda: subprocess.run(['cat', '/proc/1/environ']),\n"
        "    lambda: subprocess.run([sys.executable, '-c', 'print(1)']),\n"
        "    lambda: ctypes.CDLL(None).connect,\n"
        "    lambda: gc.get_objects(),\n"
        "):\n"
        "    try:\n        attempt()\n        print('ALLOWED')\n"
        "    except (OSError, RuntimeError, AttributeError) as e:\n        print('refused', type(e).__name__)\n"
    )
    res = make("guard").run_code(code)
    assert "ALLOWED" not in res.stdout, res.stdout + res.stderr
    assert res.stdout.count("refused") == 4


@pytest.mark.parametrize("mode", ["namespaces"] if INFO.namespaces else [])
def test_namespace_root_cannot_undo_the_isolation(mode):
    """No capabilities are left to unmount the hidden paths or reconfigure the network."""
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('umount', libc.umount2(os.path.expanduser('~').encode(), 2), ctypes.get_errno())\n"
        "print('caps', open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        "print('procs', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), os.getpid())\n"
    )
    res = Sandbox(FAST, isolation="namespaces").run_code(code)
    assert "umount -1 1" in res.stdout, res.stdout + res.stderr  # EPERM
    assert "caps 0000000000000000" in res.stdout
    # a private PID namespace: only the sandbox's init (the launcher) and this process are visible
    assert "procs [1, 2] 2" in res.stdout


@pytest.mark.parametrize("mode", MODES)
def test_hidden_paths_cannot_be_read(mode, tmp_path):
    secret_dir = tmp_path / "original_repo"
    secret_dir.mkdir()
    (secret_dir / "golden.py").write_text("GOLDEN = 'the deleted implementation'\n")
    code = (
        "import os, glob, pathlib\n"
        f"d = {str(secret_dir)!r}\n"
        "for attempt in (\n"
        "    lambda: open(d + '/golden.py').read(),\n"
        "    lambda: pathlib.Path(d, 'golden.py').read_text(),\n"
        "    lambda: os.listdir(d),\n"
        "    lambda: [e.name for e in os.scandir(d)],\n"
        "    lambda: glob.glob(d + '/*'),\n"
        "    lambda: (os.symlink(d + '/golden.py', 'link.py'), open('link.py').read())[1],\n"
        "    lambda: open('/proc/self/root' + d + '/golden.py').read(),\n"
        "    lambda: open(os.path.join(d, '..', 'original_repo', 'golden.py')).read(),\n"
        "):\n"
        "    try:\n        print('GOT', attempt())\n"
        "    except OSError as e:\n        print('refused', type(e).__name__)\n"
    )
    # tmp_path lives in the system temp dir, which the sandbox hides by default; hide it explicitly too
    res = make(mode, hide=[secret_dir]).run_code(code)
    assert "the deleted implementation" not in res.stdout + res.stderr
    assert "golden.py" not in res.stdout.replace("link.py", "")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("mode", MODES)
def test_home_directory_is_hidden(mode):
    home = Path.home()
    probe = home / f".cp-sandbox-test-{os.getpid()}"
    try:
        probe.write_text("ssh-rsa SECRET-0453")
    except OSError:
        pytest.fail(f"cannot write the probe file in {home}")
    try:
        code = (
            f"p = {str(probe)!r}\n"
            "try:\n    print(open(p).read())\nexcept OSError as e:\n    print('refused', type(e).__name__)\n"
        )
        res = make(mode).run_code(code)
        assert "SECRET-0453" not in res.stdout
        assert "refused" in res.stdout
    finally:
        probe.unlink()


@pytest.mark.parametrize("mode", MODES)
def test_result_channel_cannot_be_forged(mode):
    code = (
        "import os, json\n"
        "fd = int(os.environ['CP_SANDBOX_CHANNEL'])\n"
        "os.write(fd, b'deadbeef\\t' + json.dumps({'kind': 'test', 'i': 0, 'ok': True}).encode() + b'\\n')\n"
        "os.write(fd, json.dumps({'kind': 'done'}).encode() + b'\\n')\n"
        "print('PASSED')\n"
    )
    res = make(mode).run_code(code)
    assert res.records == []
    assert res.forged_records == 2


@pytest.mark.parametrize("mode", MODES)
def test_read_only_tree_cannot_be_modified(mode):
    code = (
        "import os\n"
        "for attempt in (lambda: open('tests/test_x.py', 'w').write('def test_x(): pass'),\n"
        "                lambda: os.remove('tests/test_x.py'),\n"
        "                lambda: open('conftest.py', 'w').write('x = 1')):\n"
        "    try:\n        attempt()\n        print('WROTE')\n"
        "    except OSError as e:\n        print('refused', type(e).__name__)\n"
        "print(open('tests/test_x.py').read())\n"
    )
    files = {"tests/test_x.py": "def test_x():\n    assert False\n"}
    res = make(mode).run(["python", "-B", "-c", code], files=files, readonly=["."])
    assert "WROTE" not in res.stdout, res.stdout + res.stderr
    assert "assert False" in res.stdout


def _dirty_tree(root: Path) -> Path:
    """A source tree with every kind of leftover that can leak deleted code."""
    repo = root / "dirty"
    (repo / "pkg" / "__pycache__").mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "pkg" / "mod.py").write_text("def f():\n    raise NotImplementedError\n")
    (repo / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\x00" * 32)
    (repo / "pkg" / "mod.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (repo / "pkg" / "mod.py~").write_text("def f():\n    return 42\n")
    (repo / "pkg" / "mod.py.orig").write_text("def f():\n    return 42\n")
    (repo / "pkg" / ".mod.py.swp").write_text("swap")
    for d in (
        ".mypy_cache/3.11/pkg",
        ".pytest_cache/v",
        ".ruff_cache/0.1",
        ".git/objects",
        "build/lib/pkg",
        "dist",
        "pkg.egg-info",
        "htmlcov",
        ".venv/lib",
        "docs/_build/html/_modules",
        ".tox",
    ):
        (repo / d).mkdir(parents=True, exist_ok=True)
    (repo / ".mypy_cache/3.11/pkg/mod.data.json").write_text('{"names": {"f": "def () -> int"}}')
    (repo / ".git/HEAD").write_text("ref: refs/heads/main\n")
    (repo / "build/lib/pkg/mod.py").write_text("def f():\n    return 42\n")
    (repo / "dist/pkg-0.1.tar.gz").write_bytes(b"gz")
    (repo / "htmlcov/mod_py.html").write_text("return 42")
    (repo / ".venv/pyvenv.cfg").write_text("home = /usr\n")
    (repo / ".coverage").write_text("x")
    (repo / "tests").mkdir()
    (repo / "tests/test_mod.py").write_text("from pkg.mod import f\n\ndef test_f():\n    assert f() == 42\n")
    return repo


def test_copy_clean_tree_leaves_out_every_leak(tmp_path):
    repo = _dirty_tree(tmp_path)
    out = tmp_path / "clean"
    dropped = copy_clean_tree(repo, out)
    kept = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert kept == ["pkg/__init__.py", "pkg/mod.py", "tests/test_mod.py"], kept
    for leak in (
        "pkg/__pycache__",
        "pkg/mod.py~",
        "pkg/mod.py.orig",
        ".mypy_cache",
        ".git",
        "build",
        "dist",
        "pkg.egg-info",
        "htmlcov",
        ".venv",
        ".pytest_cache",
        "pkg/mod.cpython-311-x86_64-linux-gnu.so",
    ):
        assert leak in dropped, leak
    # scrub_tree removes the same things in place
    shutil.copytree(repo, tmp_path / "inplace")
    scrub_tree(tmp_path / "inplace")
    left = sorted(str(p.relative_to(tmp_path / "inplace")) for p in (tmp_path / "inplace").rglob("*") if p.is_file())
    assert left == kept


@pytest.mark.parametrize("mode", MODES)
def test_sandbox_copy_of_a_dirty_tree_has_no_leftovers(mode, tmp_path):
    repo = _dirty_tree(tmp_path)
    code = (
        "import os\nfor root, dirs, files in os.walk('.'):\n    for f in files:\n        print(os.path.join(root, f))\n"
    )
    res = make(mode).run(["python", "-B", "-c", code], tree=repo)
    listed = sorted(line[2:] for line in res.stdout.split())
    assert listed == ["pkg/__init__.py", "pkg/mod.py", "tests/test_mod.py"], res.stdout + res.stderr


def test_no_bytecode_is_written_in_the_sandbox():
    files = {"pkg/__init__.py": "", "pkg/m.py": "X = 1\n"}
    code = "import pkg.m, os\nprint(sorted(n for r, d, f in os.walk('.') for n in d + f))\n"
    res = make("auto").run(["python", "-c", code], files=files)
    assert "__pycache__" not in res.stdout and ".pyc" not in res.stdout, res.stdout + res.stderr


def test_outside_process_is_unaffected_by_sandbox_limits():
    """rlimits apply to the sandbox only (the test process can still fork)."""
    make("auto", SandboxLimits(wall_time_s=3, max_processes=2)).run_code("print(1)")
    out = subprocess.run([sys.executable, "-c", "print(2)"], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "2"


def test_collect_does_not_follow_planted_symlinks():
    """Files read back after a run must really be inside the sandbox (here: a link to /etc/passwd)."""
    code = "import os\nos.symlink('/etc/passwd', 'result.txt')\nos.makedirs('d')\nopen('d/ok.txt', 'w').write('fine')\n"
    res = make("auto").run(["python", "-c", code], collect=["result.txt", "d/ok.txt"])
    assert res.returncode == 0, res.stderr
    assert res.files == {"d/ok.txt": b"fine"}
