"""The sandbox's value types: the limits of a run, what a run produced, the isolation a machine offers, its error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from composer_plugins.core.errors import ComposerPluginsError


class SandboxError(ComposerPluginsError, RuntimeError):
    """The sandbox itself could not run (not the code inside it failing)."""


@dataclass
class SandboxLimits:
    """Resource limits of one sandbox run."""

    wall_time_s: float = 10.0
    #: CPU seconds per process (``RLIMIT_CPU``); defaults to the wall-clock limit.
    cpu_time_s: float | None = None
    #: Address-space limit (``RLIMIT_AS``) in MiB; None for none.
    memory_mb: int | None = 1024
    #: Processes (and threads) the sandbox may have at once (``RLIMIT_NPROC``).
    max_processes: int = 32
    #: Bytes kept from each of stdout and stderr; more kills the run.
    max_output_bytes: int = 256_000
    #: Largest file the sandbox may write (``RLIMIT_FSIZE``), MiB.
    max_file_mb: int = 32
    max_open_files: int = 256
    #: Total size of what the run may write into its own directory, MiB (checked twice a second).
    max_disk_mb: int = 256
    #: Size of the private ``/dev/shm`` (namespace mode), MiB.
    max_shm_mb: int = 64


@dataclass
class SandboxResult:
    """What one sandbox run produced."""

    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolation: str
    #: Why the sandbox killed the run: timeout, output_limit, cpu_limit, memory_limit, file_size_limit,
    #: disk_limit.
    killed: str | None = None
    #: Authenticated records from the result channel.
    records: list[dict[str, Any]] = field(default_factory=list)
    #: Lines written to the result channel without the nonce (tampering).
    forged_records: int = 0
    #: Files the caller asked to collect from the working directory after the run.
    files: dict[str, bytes] = field(default_factory=dict)
    #: Marker in every sandboxed process's environment (``CP_SANDBOX_ID``), to find stragglers.
    sandbox_id: str = ""

    @property
    def timed_out(self) -> bool:
        """True when the wall-clock or CPU limit ended the run."""
        return self.killed in ("timeout", "cpu_limit")

    @property
    def ok(self) -> bool:
        """Exited 0 without being killed."""
        return self.returncode == 0 and self.killed is None

    def tail(self, n: int = 2000) -> str:
        """The last ``n`` characters of stderr (or stdout when stderr is empty)."""
        return (self.stderr or self.stdout)[-n:]


@dataclass(frozen=True)
class IsolationInfo:
    """What isolation this machine supports (see :func:`isolation_info`)."""

    namespaces: bool
    reason: str
    root: bool
    unshare: str | None

    @property
    def mode(self) -> str:
        """``namespaces`` when available, else ``guard``."""
        return "namespaces" if self.namespaces else "guard"
