"""File IO in one place: the one JSONL reader and the atomic writers.

Reading: every JSONL file of the project (tasks, pairs, traces, replay output) goes through
:func:`iter_jsonl` / :func:`read_jsonl`. A malformed line raises an error located at ``file:line`` with
the column and the JSON parser's reason; blank lines are skipped and still counted (an editor's numbers).

Writing: every result file (``metrics.json``, predictions, replay output, checkpoints) is written
through :func:`atomic_file` — a temporary file in the same directory, flushed and fsynced, then
renamed over the target (``os.replace``) and the directory fsynced — so a kill leaves the previous
file or none, never half of one; :func:`atomic_write_text` / ``_json`` / ``_jsonl`` are its forms.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from composer_plugins.core.errors import ComposerPluginsError, ConfigError

#: ``error(file, line, message)`` builds the exception a bad line raises (default :class:`ConfigError`).
ErrorFactory = Callable[[str, "int | None", str], Exception]


def _config_error(file: str, line: int | None, message: str) -> Exception:
    return ConfigError(message, file=file, line=line)


def iter_jsonl(
    source: str | os.PathLike[str] | Iterable[str],
    name: str | os.PathLike[str] | None = None,
    *,
    objects: bool = True,
    error: ErrorFactory = _config_error,
) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of ``source`` (a path, or lines already read).

    ``name`` is the file named in errors (default: ``source`` when it is a path). With ``objects``
    (the default) every line must hold a JSON object. A path that cannot be opened raises
    ``error(file, None, "cannot read ...")``.
    """
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        where = str(name if name is not None else path)
        try:
            fh = path.open(encoding="utf-8")
        except OSError as e:
            raise error(where, None, f"cannot read JSONL file: {e.strerror or e}") from e
        with fh:
            yield from _parse(fh, where, objects, error)
    else:
        yield from _parse(source, str(name if name is not None else "<lines>"), objects, error)


def _parse(lines: Iterable[str], where: str, objects: bool, error: ErrorFactory) -> Iterator[tuple[int, Any]]:
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise error(where, lineno, f"invalid JSON at column {e.colno}: {e.msg}") from None
        if objects and not isinstance(value, dict):
            raise error(where, lineno, f"each line must be a JSON object, got {type(value).__name__}")
        yield lineno, value


def read_jsonl(
    source: str | os.PathLike[str] | Iterable[str],
    name: str | os.PathLike[str] | None = None,
    *,
    objects: bool = True,
    error: ErrorFactory = _config_error,
) -> list[Any]:
    """All values of :func:`iter_jsonl` as a list."""
    return [value for _, value in iter_jsonl(source, name, objects=objects, error=error)]


# -- atomic writers ---------------------------------------------------------------------------------
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


def _cannot_write(p: Path, e: OSError) -> ComposerPluginsError:
    return ComposerPluginsError(f"cannot write {p}: {path_problem(p) or f'{type(e).__name__}: {e.strerror or e}'}")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "w", *, tmp_name: str | None = None) -> Iterator[IO[Any]]:
    """A file to write ``path`` through: it appears at ``path`` whole when the block ends, or not at all.

    ``mode`` is ``"w"`` (UTF-8 text) or ``"wb"``. ``tmp_name``: the temporary file's name in the same
    directory (default: a unique hidden name). An ``OSError`` becomes a :class:`ComposerPluginsError`
    that says why the path cannot be written.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if tmp_name is None:
            fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        else:
            tmp = str(p.parent / tmp_name)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        raise _cannot_write(p, e) from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _cannot_write(p, e) from None
        raise
    fsync_dir(p.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`atomic_file`)."""
    with atomic_file(path) as fh:
        fh.write(text)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, **dumps: Any) -> None:
    """Write ``obj`` as JSON (``indent=2`` unless given, a final newline) atomically."""
    dumps.setdefault("indent", 2)
    atomic_write_text(path, json.dumps(obj, **dumps) + "\n")


def atomic_write_jsonl(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]], **dumps: Any) -> int:
    """Write ``records`` as JSON lines atomically (``ensure_ascii=False`` unless given); returns how many."""
    dumps.setdefault("ensure_ascii", False)
    lines = [json.dumps(r, **dumps) for r in records]
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return len(lines)


def is_wall_clock(key: str) -> bool:
    """A statistic read off the clock (``.../seconds``, ``..._s``): two runs of the same computation differ in it,
    so the files DVC pins (``history.csv``, ``metrics.json``, stage stats) leave it out; MLflow still logs it."""
    last = key.rsplit("/", 1)[-1]
    return last == "seconds" or last.endswith("_s")
