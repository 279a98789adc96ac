"""Process tags and the process table: a tagged process is found (and killed with its tree) even after
``setsid`` or re-parenting."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import time
from collections.abc import Iterable, Mapping

TAG_ENV = "COMPOSER_PROC_TAGS"


def new_tag(prefix: str = "proc") -> str:
    """A fresh tag, unique to this process and call."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"


def tag_env(tag: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) whose ``$COMPOSER_PROC_TAGS`` also holds ``tag``."""
    out = dict(os.environ if env is None else env)
    tags = [t for t in out.get(TAG_ENV, "").split(":") if t]
    if tag not in tags:
        tags.append(tag)
    out[TAG_ENV] = ":".join(tags)
    return out


def all_pids() -> list[int]:
    """Every pid in /proc (empty without procfs)."""
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:  # pragma: no cover - no procfs
        return []


def tagged_pids(tag: str, among: Iterable[int] | None = None) -> list[int]:
    """Live processes (not zombies, not this one) whose environment carries ``tag``.

    ``among``: look only at these pids (e.g. those that did not exist before the tag was handed out).
    """
    needle = TAG_ENV.encode() + b"="
    me = os.getpid()
    found = []
    for pid in all_pids() if among is None else among:
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        for e in entries:
            if e.startswith(needle) and tag.encode() in e[len(needle) :].split(b":"):
                info = proc_info(pid)
                if info is not None and info.state != "Z":
                    found.append(pid)
                break
    return found


@dataclasses.dataclass
class ProcInfo:
    """One line of the process table (from ``/proc/<pid>/stat`` and ``cmdline``)."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    cpu_s: float
    cmdline: str

    def line(self, width: int = 160) -> str:
        cmd = " ".join(self.cmdline.split())  # a ``python -c`` script spans lines
        cmd = cmd if len(cmd) <= width else cmd[: width - 3] + "..."
        return f"pid {self.pid} (state {self.state}, {self.cpu_s:.1f}s CPU): {cmd}"


def proc_info(pid: int) -> ProcInfo | None:
    """``None`` when ``pid`` does not exist (or is not readable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return ProcInfo(
        pid=pid,
        ppid=int(rest[1]),
        pgid=int(rest[2]),
        sid=int(rest[3]),
        state=rest[0],
        cpu_s=(int(rest[11]) + int(rest[12])) / ticks,
        cmdline=cmd or stat[stat.index("(") + 1 : stat.rindex(")")],
    )


def _alive(pid: int) -> bool:
    info = proc_info(pid)
    return info is not None and info.state not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` in the parent tree (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for p in all_pids():
        info = proc_info(p)
        if info is not None:
            children.setdefault(info.ppid, []).append(p)
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def describe(pids: Iterable[int]) -> list[str]:
    """One line per live pid: state, CPU time and command line."""
    infos = (proc_info(p) for p in sorted(set(pids)))
    return [info.line() for info in infos if info is not None and info.state != "Z"]


def kill_tree(
    root: int | None = None,
    tag: str | None = None,
    sig: int = signal.SIGKILL,
    rounds: int = 10,
    spare: Iterable[int] = (),
) -> list[int]:
    """Send ``sig`` to ``root``'s process group, everything below ``root`` and everything tagged ``tag``.

    Process groups of the processes found are signalled too (never this process's own group), and the
    sweep repeats until nothing is found (a process may fork while it is being killed). ``spare``: pids
    (and their process groups) left alone. Returns the pids that were signalled.
    """
    own_group = os.getpgrp()
    me = os.getpid()
    kept = set(spare)
    hit: set[int] = set()
    for _ in range(rounds):
        found: set[int] = set()
        if root is not None:
            found.update(descendants(root))
            if _alive(root):
                found.add(root)
        if tag is not None:
            found.update(tagged_pids(tag))
        found.discard(me)
        found = {p for p in found if p not in kept and _alive(p)}
        if not found:
            break
        infos = [info for info in map(proc_info, found) if info is not None]
        groups = {i.pgid for i in infos if i.pgid not in (own_group, 0, *kept) and (i.pgid in found or i.pgid == root)}
        for g in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, sig)
        for p in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, sig)
        hit |= found
        if sig != signal.SIGKILL:
            break
        time.sleep(0.02)
    return sorted(hit)
