"""Small durable-file helpers: atomic JSONL writes and located JSONL reads."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from composer_plugins.core.errors import ComposerPluginsError


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a file cannot be created at ``path`` (with the fix), or ``None`` when it can.

    Catches what would otherwise surface as a ``FileExistsError``/``NotADirectoryError``
    traceback: a parent that is a regular file, the path itself being a directory, or a
    parent directory this process cannot write to.
    """
    p = Path(path)
    if p.is_dir():
        return f"{p} is a directory, not a file. HINT: give a file path inside it, e.g. {p / 'out.jsonl'}"
    for parent in p.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                return (
                    f"{parent} is a regular file, so {p} cannot be created under it. "
                    f"HINT: move or delete {parent}, or choose another path"
                )
            if not os.access(parent, os.W_OK | os.X_OK):
                return f"cannot create {p}: the directory {parent} is not writable. HINT: choose a writable path"
            return None
    return None


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically: temp file in the same dir, fsync, ``os.replace``, fsync dir."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as e:
        raise ComposerPluginsError(
            f"cannot write {p}: {path_problem(p) or f'{type(e).__name__}: {e.strerror or e}'}"
        ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise ComposerPluginsError(
                f"cannot write {p}: {path_problem(p) or f'{type(e).__name__}: {e.strerror or e}'}"
            ) from None
        raise
    fsync_dir(p.parent)


def atomic_write_jsonl(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]]) -> int:
    """Write ``records`` as JSON lines atomically; returns the number written."""
    lines = [json.dumps(r, ensure_ascii=False, sort_keys=False) for r in records]
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return len(lines)
