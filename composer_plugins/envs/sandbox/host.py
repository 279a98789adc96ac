"""What a sandbox sees of the host and leaves on it: interpreter paths, uids, owner records, leftovers, stragglers."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from composer_plugins.envs.sandbox.tree import _real
from composer_plugins.envs.sandbox.types import SandboxError


def probe_interpreter(python: str, code: str) -> Any:
    """What ``code`` prints (one JSON value) when ``python`` runs it isolated (``-I``), from ``/``."""
    out = subprocess.run(
        [python, "-I", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    if out.returncode != 0:
        raise SandboxError(f"cannot inspect interpreter {python}: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def _procs_of_uid(uid: int) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            # threads count towards RLIMIT_NPROC too
                            n += max(1, len(os.listdir(f"/proc/{entry.name}/task")))
                        break
        except (OSError, ValueError, IndexError):
            continue
    return n


_uid_counter = itertools.count()


_UID_BASE = 1_400_000_000


def _fresh_uid() -> int:
    """A uid no account uses, for one sandbox run started by root."""
    return _UID_BASE + (os.getpid() % 100_000) * 1000 + next(_uid_counter) % 1000


@functools.lru_cache(maxsize=16)
def interpreter_paths(python: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(prefixes, import paths)`` of an interpreter: what a sandbox must keep visible to run it."""
    python = os.path.abspath(python)
    if python == os.path.abspath(sys.executable):
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
        paths: set[str] = set()
        with contextlib.suppress(Exception):
            paths.update(site.getsitepackages())
        for key in ("stdlib", "platstdlib", "purelib", "platlib"):
            with contextlib.suppress(Exception):
                paths.add(sysconfig.get_path(key))
    else:
        code = (
            "import json, sys\n"
            "print(json.dumps([[sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix],"
            " [p for p in sys.path if p]]))"
        )
        pre, pp = probe_interpreter(python, code)
        prefixes, paths = set(pre), set(pp)
    prefixes.add(os.path.dirname(os.path.dirname(python)))
    prefixes.add(os.path.dirname(os.path.dirname(_real(python))))
    norm_pre = tuple(sorted({_real(p) for p in prefixes if p and os.path.exists(p)}))
    norm_paths = tuple(sorted({_real(p) for p in paths if p and os.path.isdir(p)}))
    return norm_pre, norm_paths


def _untraversable_ancestors(paths: Iterable[str]) -> list[str]:
    """Ancestors of ``paths`` that other users cannot enter (no ``o+x``)."""
    out = []
    for p in paths:
        parts = Path(p).parts
        for i in range(2, len(parts)):
            anc = os.path.join(*parts[:i])
            try:
                if not os.stat(anc).st_mode & 0o001:
                    out.append(anc)
                    break
            except OSError:
                break
    return out


#: Host paths visible in ``expose="allowlist"`` mode besides the interpreter and the sandbox itself.
SYSTEM_PATHS: tuple[str, ...] = (
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/bin",
    "/sbin",
    "/etc",
    "/dev",
    "/proc",
    "/sys",
)


OWNER_FILE = "owner"


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()[19].decode()


def _owner_stamp(pid: int) -> str:
    return f"{pid} {_start_time(pid) or '?'}\n"


def remove_leftover_sandboxes(directory: str | os.PathLike[str]) -> list[str]:
    """Remove ``cp-sandbox-*`` directories in ``directory`` whose owner process is gone; return them.

    A directory without an owner record (pid and start time) is left alone unless it is older than an hour.
    """
    removed = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for e in entries:
            if not e.name.startswith("cp-sandbox-") or not e.is_dir(follow_symlinks=False):
                continue
            try:
                with open(os.path.join(e.path, OWNER_FILE)) as f:
                    pid_s, _, started = f.read().strip().partition(" ")
                alive = pid_s.isdigit() and _start_time(int(pid_s)) == started
            except OSError:
                alive = time.time() - e.stat(follow_symlinks=False).st_mtime < 3600
            if not alive:
                _rmtree(e.path)
                removed.append(e.path)
    return removed


def _disk_usage(root: str) -> int:
    """Bytes allocated under ``root`` (not following symlinks)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for n in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
    return total


def _find_sandbox_processes(pgid: int, sandbox_id: str) -> list[int]:
    found = []
    marker = f"CP_SANDBOX_ID={sandbox_id}".encode()
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rfind(b")") + 2 :].split()
            state, pgrp, sid = fields[0], int(fields[2]), int(fields[3])
            if state == b"Z":
                continue
            if pgrp == pgid or sid == pgid:
                found.append(pid)
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    return found


def _rmtree(path: str) -> None:
    def onerror(func: Any, p: str, exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)

    shutil.rmtree(path, onerror=onerror)
