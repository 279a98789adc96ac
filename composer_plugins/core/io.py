"""The one JSONL reader: every JSONL file of the project (tasks, pairs, traces, replay output) goes through it.

A malformed line raises an error located at ``file:line`` with the column and the JSON parser's
reason; with ``objects=True`` a line that is valid JSON but not an object is refused the same way.
Blank lines are skipped (and still counted, so line numbers match an editor's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from composer_plugins.core.errors import ConfigError

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
