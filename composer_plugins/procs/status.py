"""What this process is waiting for, written where a supervisor that times out can read it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

WAIT_STATUS_ENV = "COMPOSER_WAIT_STATUS_FILE"
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
