"""Named children whose wait is bounded and fails at once on the first failure, naming it with its log, and
:func:`run` (``subprocess.run`` whose timeout and interruption kill the whole tree)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from .lifetime import die_with_parent
from .status import waiting_for
from .table import descendants, describe, kill_tree, new_tag, tag_env


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
    return "\n".join(text.rstrip().splitlines()[-lines:])[-max_chars:]


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
