"""Child processes that cannot hang their parent and do not outlive it (Linux-first, stdlib only).

A package of its own below every package that starts children (the code sandbox of ``envs``, the DiLoCo
launcher), beside the plugin kernel and importing nothing but the stdlib; the benchmarks and the tests use it
too. The pieces, each documented where it is defined: :func:`die_with_parent` / :func:`set_pdeathsig`
(``PR_SET_PDEATHSIG``: a child dies with the thread that started it, even after a SIGKILL), process tags
(:func:`tag_env`, :func:`tagged_pids`, :func:`kill_tree`: found and killed even after ``setsid`` or
re-parenting), :class:`Children` (named children whose wait fails at once on the first failure, naming it,
bounds every wait and asks a stuck child for its stacks), :class:`StoreRendezvous` (a member seen to exit is
marked *gone*, so the others do not wait for a timeout), :func:`run` (``subprocess.run`` whose timeout and
interruption kill the whole tree) and :func:`waiting_for` (what this process is blocked on, for a supervisor
that times out).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "TAG_ENV",
    "WAIT_STATUS_ENV",
    "Child",
    "ChildFailed",
    "Children",
    "ProcInfo",
    "RendezvousError",
    "StoreRendezvous",
    "all_pids",
    "descendants",
    "describe",
    "die_with_parent",
    "exit_description",
    "kill_tree",
    "new_tag",
    "proc_info",
    "run",
    "set_pdeathsig",
    "tag_env",
    "tagged_pids",
    "tail",
    "waiting_for",
]

TAG_ENV = "COMPOSER_PROC_TAGS"
WAIT_STATUS_ENV = "COMPOSER_WAIT_STATUS_FILE"
PR_SET_PDEATHSIG = 1
_LINUX = sys.platform.startswith("linux")
_libc: Any = None


def _prctl() -> Any:
    """libc's ``prctl`` (resolved in the parent, so a ``preexec_fn`` never loads anything), or ``None``."""
    global _libc
    if not _LINUX:
        return None
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.prctl  # noqa: B018 - resolve the symbol now, not after fork
        except (OSError, AttributeError):
            _libc = False
    return _libc.prctl if _libc else None


def set_pdeathsig(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Linux: deliver ``sig`` to this process when its parent (the thread that forked it) exits.

    With ``expected_parent``, a parent that already died before the call is noticed too (the process
    then signals itself). Returns ``False`` where this is not supported.
    """
    prctl = _prctl()
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that makes the child die with this thread.

    ``None`` where ``PR_SET_PDEATHSIG`` is not available. Note the kernel's rule: the signal is sent
    when the *thread* that started the child exits, so start long-lived children from a thread that
    lives as long as they should (the main thread, usually).
    """
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
        if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0 and os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


# -- tags and the process table -----------------------------------------------------------


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
    lines = []
    for p in sorted(set(pids)):
        info = proc_info(p)
        if info is not None and info.state != "Z":
            lines.append(info.line())
    return lines


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
        groups = set()
        for p in found:
            info = proc_info(p)
            if (
                info is not None
                and info.pgid not in (own_group, 0)
                and info.pgid not in kept
                and (info.pgid in found or info.pgid == root)
            ):
                groups.add(info.pgid)
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


# -- what this process is waiting for -------------------------------------------------------

_wait_stack: list[str] = []


@contextlib.contextmanager
def waiting_for(what: str) -> Iterator[None]:
    """While inside, ``$COMPOSER_WAIT_STATUS_FILE`` (when set) says what this process is waiting for."""
    path = os.environ.get(WAIT_STATUS_ENV)
    _wait_stack.append(f"{what} (since {time.strftime('%H:%M:%S')})")
    _write_status(path)
    try:
        yield
    finally:
        _wait_stack.pop()
        _write_status(path)


def _write_status(path: str | None) -> None:
    if not path:
        return
    with contextlib.suppress(OSError):
        Path(path).write_text(" <- ".join(reversed(_wait_stack)) + ("\n" if _wait_stack else ""))


# -- named children -------------------------------------------------------------------------


def exit_description(rc: int) -> str:
    """``exited with code 1`` / ``was killed by SIGKILL``."""
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def tail(path: str | os.PathLike[str] | None, lines: int = 30, max_chars: int = 4000) -> str:
    """The last ``lines`` lines of a text file (empty when it does not exist)."""
    if path is None:
        return ""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    out = "\n".join(text.rstrip().splitlines()[-lines:])
    return out[-max_chars:]


class ChildFailed(RuntimeError):
    """A child exited non-zero, or did not finish in time; the message names it and shows its output."""

    def __init__(self, message: str, child: Child | None = None) -> None:
        super().__init__(message)
        self.child = child


@dataclasses.dataclass
class Child:
    """One started child: its name, process and log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path | None
    started: float
    ended: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)


class Children:
    """Start named children (own sessions, output to logs) and wait for them with bounds; see the module doc.

    Args:
        tag_prefix: prefix of this group's tag (it also marks grandchildren, for the final sweep).
        dump_signal: sent to a child that is stuck before it is killed; a child that called
            ``faulthandler.register(dump_signal, all_threads=True)`` then writes its Python stacks to its
            log, which the error shows. ``None``: do not ask.
        tail_lines: how much of a failed child's log the error message shows.
    """

    def __init__(
        self, tag_prefix: str = "children", *, dump_signal: int | None = signal.SIGUSR1, tail_lines: int = 40
    ) -> None:
        self.tag = new_tag(tag_prefix)
        self.dump_signal = dump_signal
        self.tail_lines = tail_lines
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        pdeathsig: int = signal.SIGKILL,
    ) -> Child:
        """Start ``argv`` as a session leader that dies with this thread; stdout+stderr go to ``log_path``."""
        log: IO[bytes] | int = subprocess.DEVNULL
        if log_path is not None:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            log = open(log_path, "ab")  # the child holds it; closed here right after the start
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=tag_env(self.tag, env),
                cwd=cwd,
                start_new_session=True,
                preexec_fn=die_with_parent(pdeathsig),
            )
        finally:
            if not isinstance(log, int):
                log.close()
        child = Child(name, proc, Path(log_path) if log_path is not None else None, time.monotonic())
        self.children.append(child)
        return child

    def wait(
        self,
        timeout: float,
        *,
        straggler_s: float | None = None,
        poll_s: float = 0.05,
        on_exit: Callable[[Child, int], None] | None = None,
    ) -> dict[str, int]:
        """Wait until every child has exited 0; returns ``{name: 0}``.

        Raises :class:`ChildFailed` (after killing the others) as soon as one exits non-zero, when
        ``timeout`` seconds pass, or when some are still running ``straggler_s`` seconds after the first
        one finished cleanly (a peer that hangs on the way out).
        """
        deadline = time.monotonic() + timeout
        first_ok: Child | None = None
        names = ", ".join(f"{c.name} (pid {c.pid})" for c in self.children)
        with waiting_for(names):
            while True:
                running = []
                for c in self.children:
                    rc = c.proc.poll()
                    if rc is None:
                        running.append(c)
                        continue
                    if c.ended is None:
                        c.ended = time.monotonic()
                        if on_exit is not None:
                            on_exit(c, rc)
                    if rc != 0:
                        raise self._failed(c, rc)
                    if first_ok is None:
                        first_ok = c
                if not running:
                    return {c.name: 0 for c in self.children}
                now = time.monotonic()
                if now > deadline:
                    raise self._stuck(running, f"still running after {timeout:.0f}s")
                if (
                    straggler_s is not None
                    and first_ok is not None
                    and first_ok.ended is not None
                    and now - first_ok.ended > straggler_s
                ):
                    raise self._stuck(running, f"still running {straggler_s:.0f}s after {first_ok.name} exited 0")
                time.sleep(poll_s)

    def _failed(self, c: Child, rc: int) -> ChildFailed:
        others = [o for o in self.children if o is not c]
        running = [o for o in others if o.proc.poll() is None]
        done = [o for o in others if o not in running and o.proc.returncode != 0]
        self.kill_all()
        took = (c.ended or time.monotonic()) - c.started
        msg = f"{c.name} (pid {c.pid}) {exit_description(rc)} after {took:.1f}s"
        if running:
            msg += f"; stopped {', '.join(o.name for o in running)}"
        for o in done:  # exited too, in the same poll interval (e.g. of the closed connection to it)
            msg += f"; {o.name} {exit_description(o.proc.returncode or 0)} too"
        msg += "." + self._tails([c], self.tail_lines) + self._tails(running + done, 10)
        return ChildFailed(msg, c)

    def _stuck(self, running: list[Child], why: str) -> ChildFailed:
        if self.dump_signal is not None:
            for c in running:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(c.pid, self.dump_signal)
            time.sleep(1.0)  # let faulthandler write the stacks
        procs = describe(p for c in running for p in [c.pid, *descendants(c.pid)])
        self.kill_all()
        msg = f"{', '.join(f'{c.name} (pid {c.pid})' for c in running)} {why}; killed."
        if procs:
            msg += "\nThey were:\n  " + "\n  ".join(procs)
        msg += self._tails(running, self.tail_lines)
        return ChildFailed(msg, running[0])

    @staticmethod
    def _tails(children: Iterable[Child], lines: int) -> str:
        out = ""
        for c in children:
            t = c.tail(lines)
            where = f" ({c.log_path})" if c.log_path is not None else ""
            out += f"\n--- last lines of {c.name}'s output{where} ---\n{t if t else '(empty)'}"
        return out

    def kill_all(self) -> None:
        """SIGKILL every child's process group, its descendants and anything else carrying this tag."""
        for c in self.children:
            if c.proc.returncode is None:  # not reaped yet, so the pid is still this child's
                kill_tree(c.pid)
        kill_tree(tag=self.tag)
        for c in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=10)
            if c.ended is None and c.proc.returncode is not None:
                c.ended = time.monotonic()

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    input: str | bytes | None = None,
    capture_output: bool = False,
    check: bool = False,
    env: Mapping[str, str] | None = None,
    **popen_kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """Like :func:`subprocess.run`, but the timeout (required) and any exception kill the whole tree.

    The command runs as its own session that dies with this thread; on timeout, on an exception while
    waiting (Ctrl-C, pytest-timeout) and after it exits, everything it started (its group, descendants,
    anything carrying its tag) is SIGKILLed. ``subprocess.run`` kills only the direct child.
    """
    tag = new_tag("run")
    if capture_output:
        popen_kwargs["stdout"] = popen_kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        popen_kwargs["stdin"] = subprocess.PIPE
    with subprocess.Popen(
        list(argv),
        env=tag_env(tag, env),
        start_new_session=True,
        preexec_fn=die_with_parent(signal.SIGKILL),
        **popen_kwargs,
    ) as proc:
        deadline = time.monotonic() + timeout
        exited: float | None = None
        try:
            while True:
                try:
                    out, err = proc.communicate(input, timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    input = None  # sent with the first call; a retry must not pass it again
                now = time.monotonic()
                if exited is None and proc.poll() is not None:
                    exited = now
                if exited is not None and now - exited > 1.0:
                    # it is done, but something it left in the background holds its output pipes open
                    kill_tree(tag=tag)
                    out, err = proc.communicate()
                    break
                if now > deadline:
                    kill_tree(proc.pid, tag=tag)
                    out, err = proc.communicate()
                    raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        except subprocess.TimeoutExpired:
            raise
        except BaseException:
            kill_tree(proc.pid, tag=tag)
            proc.wait()
            raise
        finally:
            kill_tree(tag=tag)  # what it left running in the background
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        res.check_returncode()
    return res


# -- rendezvous -----------------------------------------------------------------------------


class RendezvousError(RuntimeError):
    """A member of a rendezvous exited before arriving, or did not arrive in time."""


class StoreRendezvous:
    """Members ``0..size-1`` (or the ids in ``members``) meet over a store with ``set``/``check``/``get``.

    A member calls :meth:`wait` (arrive, then wait for the others); whoever watches the member processes
    (the parent, which usually also runs the store) calls :meth:`mark_gone` when one exits, so the others
    learn it at once instead of at a timeout. ``members=None`` reads the member ids the creator published
    with :meth:`publish`.
    """

    def __init__(
        self, store: Any, members: int | Sequence[int] | None = None, *, name: str = "rendezvous", what: str = "member"
    ) -> None:
        self.store = store
        self.name = name
        self.what = what
        self._members: list[int] | None = (
            list(range(members)) if isinstance(members, int) else (list(members) if members is not None else None)
        )

    def _key(self, kind: str, member: int | str) -> str:
        return f"{self.name}/{kind}/{member}"

    @property
    def members(self) -> list[int]:
        if self._members is None:
            raw = self.store.get(self._key("members", "all")).decode()
            self._members = [int(x) for x in raw.split(",") if x]
        return self._members

    def publish(self) -> None:
        """Store the member ids, for members that construct with ``members=None``."""
        self.store.set(self._key("members", "all"), ",".join(str(m) for m in self.members))

    def arrive(self, member: int) -> None:
        self.store.set(self._key("arrived", member), str(os.getpid()))

    def mark_gone(self, member: int, reason: str) -> None:
        """Record that ``member`` exited (``reason``, e.g. ``exited with code 1``)."""
        self.store.set(self._key("gone", member), reason)

    def state(self) -> tuple[list[int], dict[int, str], list[int]]:
        """``(arrived, gone {member: reason}, missing)``; a member that arrived is never gone here."""
        arrived, gone, missing = [], {}, []
        for m in self.members:
            if self.store.check([self._key("arrived", m)]):
                arrived.append(m)
            elif self.store.check([self._key("gone", m)]):
                gone[m] = self.store.get(self._key("gone", m)).decode()
            else:
                missing.append(m)
        return arrived, gone, missing

    def wait(self, member: int, timeout_s: float, *, allow_gone: bool = False, poll_s: float = 0.05) -> dict[int, str]:
        """Arrive as ``member`` and wait for every other member.

        Raises :class:`RendezvousError` naming the members that exited before arriving (unless
        ``allow_gone``: then returns them, ``{member: reason}``) or that did not arrive in ``timeout_s``.
        """
        self.arrive(member)
        deadline = time.monotonic() + timeout_s
        while True:
            arrived, gone, missing = self.state()
            if gone and not allow_gone:
                who = "; ".join(f"{self.what} {m} {r}" for m, r in sorted(gone.items()))
                raise RendezvousError(f"{self.name}: {who} before arriving (this is {self.what} {member})")
            if not missing:
                return gone
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"{self.name}: {self.what}(s) {missing} did not arrive within {timeout_s:.0f}s "
                    f"(arrived: {arrived}; this is {self.what} {member})"
                )
            time.sleep(poll_s)
