"""The executor seam: what one replica is (:class:`ReplicaSpec`), the handle and executor protocols every executor
implements (:class:`ReplicaHandle`, :class:`ReplicaExecutor`), and the local one (:class:`LocalProcessExecutor`:
one OS process group per replica on this host). The cloud executors (Hugging Face Jobs, Modal) are in
:mod:`.executors`; the launcher that supervises the replicas in :mod:`.launch`.

Import-light (no torch): the ``composer-plugins diloco`` command imports it on every CLI invocation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
from pathlib import Path
from typing import IO, Protocol, runtime_checkable

from composer_plugins import procs
from composer_plugins.core.errors import ComposerPluginsError


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


class LocalProcessExecutor:
    """Runs each replica as a local subprocess in a new session; output goes to ``spec.log_path``.

    The replica is a session (and process group) leader, so stopping it reaches its own children too; on
    Linux it is SIGKILLed as soon as the thread that started it ends (the launcher died or was killed
    without cleaning up: ``PR_SET_PDEATHSIG``), so a replica blocked in a collective is not left behind.
    """

    def __init__(self, pdeathsig: int = signal.SIGKILL) -> None:
        self.pdeathsig = pdeathsig

    def start(self, spec: ReplicaSpec) -> LocalProcessHandle:
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
        return LocalProcessHandle(spec, proc, log)
