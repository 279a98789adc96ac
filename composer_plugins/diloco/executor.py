"""The executor seam: what one replica is (:class:`ReplicaSpec`), the handle and executor protocols every executor
implements (:class:`ReplicaHandle`, :class:`ReplicaExecutor`), and the local one (:class:`LocalProcessExecutor`).
Import-light (no torch): the ``composer-plugins diloco`` command imports it on every CLI invocation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol, runtime_checkable

from composer_plugins import procs
from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.diloco.env import (
    ENV_BARRIER,
    ENV_BARRIER_SIZE,
    ENV_INDEX,
    ENV_REPLICA_ID,
    ENV_RESTART,
    ENV_SEED,
    ENV_SYNC_LOG,
)
from composer_plugins.diloco.forkserver import runs_replica_entry, server_argv


class LaunchError(ComposerPluginsError, RuntimeError):
    """The launcher could not start or keep the replicas running."""


@dataclasses.dataclass
class ReplicaSpec:
    """Everything needed to start one replica group (one process here; a job elsewhere)."""

    index: int
    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    log_path: Path | None = None
    restart: int = 0
    #: only what the launcher set for this replica (no inherited environment): what a cloud executor sends
    job_env: dict[str, str] = dataclasses.field(default_factory=dict)


@runtime_checkable
class ReplicaHandle(Protocol):
    """A running replica. ``poll`` returns the exit code once it has ended, else ``None``."""

    spec: ReplicaSpec

    @property
    def pid(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


@runtime_checkable
class ReplicaExecutor(Protocol):
    """Starts replicas somewhere. Implement this for another backend (jobs meeting through object storage)."""

    def start(self, spec: ReplicaSpec) -> ReplicaHandle: ...


def wait_polling(poll: Callable[[], int | None], timeout: float | None, interval: float) -> int | None:
    """The exit code once ``poll()`` has one (asked every ``interval`` seconds); ``None`` after ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while (rc := poll()) is None:
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(interval)
    return rc


class _SessionHandle:
    """A replica in a session of its own: its signals go to its whole process group (its children too)."""

    pid: int | None

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)  # type: ignore[arg-type]  # the session leader's pid is its group's

    def terminate(self) -> None:
        """SIGTERM to the replica's whole process group."""
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the replica's whole process group."""
        self._signal_group(signal.SIGKILL)


class LocalProcessHandle(_SessionHandle):
    """A replica running as its own process group (``start_new_session``) on this host."""

    def __init__(self, spec: ReplicaSpec, proc: subprocess.Popen[bytes], log: IO[bytes] | None) -> None:
        self.spec = spec
        self.proc = proc
        self._log = log

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None:
            self._close_log()
        return rc

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._close_log()
        return rc

    def _close_log(self) -> None:
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None


#: what only one replica's environment holds (the fork server starts without them; each child takes its own)
_OWN_VARS = frozenset({ENV_INDEX, ENV_REPLICA_ID, ENV_RESTART, ENV_SEED, ENV_SYNC_LOG, ENV_BARRIER, ENV_BARRIER_SIZE})


class ForkedReplicaHandle(_SessionHandle):
    """A replica forked by the fork server (:mod:`.forkserver`), which reports its exit code; its pid is ``None``
    until the fork (a signal sent meanwhile is delivered then)."""

    def __init__(self, spec: ReplicaSpec, server: _ForkServer) -> None:
        self.spec = spec
        self._pid: int | None = None
        self._server = server
        self._deferred: int | None = None  # a signal sent before the fork

    @property
    def pid(self) -> int | None:
        return self._pid

    def _started(self, pid: int) -> None:
        self._pid = pid
        if self._deferred is not None:
            self._signal_group(self._deferred)

    def poll(self) -> int | None:
        return self._server.exit_code(self)

    def _signal_group(self, sig: int) -> None:
        if self._pid is None:
            self._deferred = sig if self._deferred != signal.SIGKILL else self._deferred
            return
        super()._signal_group(sig)

    def wait(self, timeout: float | None = None) -> int | None:
        return wait_polling(self.poll, timeout, 0.02)


class _ForkServer:
    """The launcher's side of the fork server: its process, the replicas it was asked to fork (in order; it answers
    ``started <pid>`` in the same order) and their exit codes."""

    def __init__(self, template: ReplicaSpec, pdeathsig: int) -> None:
        env = {k: v for k, v in template.env.items() if k not in _OWN_VARS}
        out: IO[bytes] | int = subprocess.DEVNULL
        if template.log_path is not None:
            out = open(template.log_path.parent / "fork-server.log", "ab")
        try:
            self.proc = subprocess.Popen(
                server_argv(template.argv),
                env=env,
                cwd=template.cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
                start_new_session=True,
                preexec_fn=procs.die_with_parent(pdeathsig),
            )
        finally:
            if not isinstance(out, int):
                out.close()
        self._lock = threading.Lock()
        self._waiting: list[ForkedReplicaHandle] = []
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="diloco-fork-server", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            what, _, rest = raw.decode(errors="replace").strip().partition(" ")
            with self._lock:
                if what == "started" and self._waiting:
                    self._waiting.pop(0)._started(int(rest))
                elif what == "exit":
                    pid, _, rc = rest.partition(" ")
                    self._exits[int(pid)] = int(rc)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, spec: ReplicaSpec) -> ForkedReplicaHandle | None:
        """Ask the server to fork ``spec``'s replica (it does once its imports are done); ``None`` when it is gone."""
        if not self.alive() or self.proc.stdin is None:
            return None
        log_path = str(spec.log_path) if spec.log_path is not None else None
        job = {"argv": spec.argv, "env": spec.env, "cwd": spec.cwd, "log_path": log_path}
        handle = ForkedReplicaHandle(spec, self)
        with self._lock:
            try:
                self.proc.stdin.write((json.dumps(job) + "\n").encode())
                self.proc.stdin.flush()
            except OSError:
                return None
            self._waiting.append(handle)
        return handle

    def exit_code(self, handle: ForkedReplicaHandle) -> int | None:
        with self._lock:
            pid = handle.pid
            if pid is not None and pid in self._exits:
                return self._exits[pid]
        if self.alive():
            return None
        # the server is gone: its children were SIGKILLed with it (PR_SET_PDEATHSIG)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 0)
                return None
        return -signal.SIGKILL

    def close(self) -> None:
        """Close the server's stdin (it exits 0); SIGKILL it after a moment."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5.0)


class LocalProcessExecutor:
    """Runs each replica as a local subprocess in a session of its own (its signals reach its children),
    SIGKILLed when the thread that started it ends (``PR_SET_PDEATHSIG``); output goes to ``spec.log_path``.

    ``warm_restarts``: a replica started again is forked from the fork server (:mod:`.forkserver`); only
    ``python -m composer_plugins.diloco.run`` replicas can be.
    """

    def __init__(self, pdeathsig: int = signal.SIGKILL, warm_restarts: bool = False) -> None:
        self.pdeathsig = pdeathsig
        self.warm_restarts = warm_restarts
        self._server: _ForkServer | None = None
        #: how many restarts the fork server took (the rest started a fresh interpreter)
        self.forked = 0

    def start(self, spec: ReplicaSpec) -> LocalProcessHandle | ForkedReplicaHandle:
        if spec.restart > 0 and self._server is not None and runs_replica_entry(spec.argv):
            if (warm_log := _open_log(spec, ", forked warm")) is not None:
                warm_log.close()
            handle = self._server.fork(spec)
            if handle is not None:
                self.forked += 1
                return handle
        log = _open_log(spec)
        try:
            proc = subprocess.Popen(
                spec.argv,
                env=spec.env,
                cwd=spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log if log is not None else None,
                stderr=subprocess.STDOUT if log is not None else None,
                start_new_session=True,
                preexec_fn=procs.die_with_parent(self.pdeathsig),
            )
        except OSError as e:
            if log is not None:
                log.close()
            raise LaunchError(f"cannot start replica {spec.index}: {e}. Command: {shlex.join(spec.argv)}") from e
        if self.warm_restarts and self._server is None and runs_replica_entry(spec.argv):
            with contextlib.suppress(OSError):  # no server: restarts start a fresh interpreter as without one
                self._server = _ForkServer(spec, self.pdeathsig)
        return LocalProcessHandle(spec, proc, log)

    def close(self) -> None:
        """Stop the fork server (after the replicas: its children die with it)."""
        if self._server is not None:
            self._server.close()
            self._server = None


def _open_log(spec: ReplicaSpec, how: str = "") -> IO[bytes] | None:
    """``spec``'s log (``None``: it has none), opened for appending, with a line saying this start began."""
    if spec.log_path is None:
        return None
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(spec.log_path, "ab")
    log.write(f"\n=== replica {spec.index} start (restart {spec.restart}{how}): {shlex.join(spec.argv)}\n".encode())
    log.flush()
    return log
