"""A child that dies with the thread that started it: ``PR_SET_PDEATHSIG`` (Linux), even after a SIGKILL."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

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
