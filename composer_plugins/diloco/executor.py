"""The executor seam: what one replica is (:class:`ReplicaSpec`), the handle and executor protocols every executor
implements (:class:`ReplicaHandle`, :class:`ReplicaExecutor`), and the local one (:class:`LocalProcessExecutor`:
one OS process group per replica on this host). The cloud executors (Hugging Face Jobs, Modal) are in
:mod:`.executors`; the launcher that supervises the replicas in :mod:`.launch`.

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
from composer_plugins.diloco.spare import runs_replica_entry, spare_argv


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


class LocalProcessHandle:
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

    def _signal_group(self, sig: int) -> None:
        # The child is a session leader, so its pgid is its pid; this also reaches its own children.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def terminate(self) -> None:
        """SIGTERM to the replica's whole process group."""
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the replica's whole process group."""
        self._signal_group(signal.SIGKILL)

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


#: what only one replica's environment holds (a spare starts without them and takes them with its assignment)
_OWN_VARS = frozenset({ENV_INDEX, ENV_REPLICA_ID, ENV_RESTART, ENV_SEED, ENV_SYNC_LOG, ENV_BARRIER, ENV_BARRIER_SIZE})


class LocalProcessExecutor:
    """Runs each replica as a local subprocess in a new session; output goes to ``spec.log_path``.

    The replica is a session (and process group) leader, so stopping it reaches its own children too; on
    Linux it is SIGKILLed as soon as the thread that started it ends (the launcher died or was killed
    without cleaning up: ``PR_SET_PDEATHSIG``), so a replica blocked in a collective is not left behind.

    ``spares``: keep this many warm spare processes (:mod:`composer_plugins.diloco.spare`, started after the first
    replica, from its command and environment) that have already imported what a replica imports; a replica started
    again (``spec.restart > 0``) is handed to one of them instead of a fresh interpreter, and a new spare is started
    in its place. Only replicas run as ``python -m composer_plugins.diloco.run`` can be taken over.
    """

    def __init__(self, pdeathsig: int = signal.SIGKILL, spares: int = 0) -> None:
        self.pdeathsig = pdeathsig
        self.spares = spares
        self._spares: list[subprocess.Popen[bytes]] = []
        self._template: ReplicaSpec | None = None
        #: how many restarts a warm spare took over (the rest started a fresh interpreter)
        self.taken_over = 0

    def start(self, spec: ReplicaSpec) -> LocalProcessHandle:
        proc = self._take_spare(spec) if spec.restart > 0 else None
        if proc is not None:
            self._fill_spares()
            return LocalProcessHandle(spec, proc, None)
        log: IO[bytes] | None = None
        if spec.log_path is not None:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(spec.log_path, "ab")
            log.write(f"\n=== replica {spec.index} start (restart {spec.restart}): {shlex.join(spec.argv)}\n".encode())
            log.flush()
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
        if self.spares and self._template is None and runs_replica_entry(spec.argv):
            self._template = spec
            self._fill_spares()
        return LocalProcessHandle(spec, proc, log)

    # -- warm spares -------------------------------------------------------------------
    def _fill_spares(self) -> None:
        """Start spares until ``spares`` are alive (from the first replica's command and environment)."""
        t = self._template
        if t is None:
            return
        self._spares = [p for p in self._spares if p.poll() is None]
        env = {k: v for k, v in t.env.items() if k not in _OWN_VARS}
        while len(self._spares) < self.spares:
            out: IO[bytes] | int = subprocess.DEVNULL
            if t.log_path is not None:
                out = open(t.log_path.parent / "spares.log", "ab")
            try:
                self._spares.append(
                    subprocess.Popen(
                        spare_argv(t.argv),
                        env=env,
                        cwd=t.cwd,
                        stdin=subprocess.PIPE,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=procs.die_with_parent(self.pdeathsig),
                    )
                )
            except OSError:
                return  # no spare: restarts start a fresh interpreter as without one
            finally:
                if not isinstance(out, int):
                    out.close()

    def _take_spare(self, spec: ReplicaSpec) -> subprocess.Popen[bytes] | None:
        """Hand ``spec`` to a live spare (its stdin gets the assignment); ``None`` when there is none to take it."""
        if not runs_replica_entry(spec.argv):
            return None
        while self._spares:
            proc = self._spares.pop(0)
            if proc.poll() is not None or proc.stdin is None:
                continue
            job = {"argv": spec.argv, "env": spec.env, "cwd": spec.cwd, "log_path": None}
            if spec.log_path is not None:
                spec.log_path.parent.mkdir(parents=True, exist_ok=True)
                job["log_path"] = str(spec.log_path)
                with open(spec.log_path, "ab") as log:
                    log.write(
                        f"\n=== replica {spec.index} start (restart {spec.restart}, warm spare pid {proc.pid}): "
                        f"{shlex.join(spec.argv)}\n".encode()
                    )
            try:
                proc.stdin.write((json.dumps(job) + "\n").encode())
                proc.stdin.close()
            except OSError:  # it died between the poll and the write
                continue
            self.taken_over += 1
            return proc
        return None

    def close(self) -> None:
        """Stop the spares nobody took (their stdin closes: they exit 0; SIGKILL after a moment)."""
        for proc in self._spares:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
        for proc in self._spares:
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5.0)
        self._spares = []
