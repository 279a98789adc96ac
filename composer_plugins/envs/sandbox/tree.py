"""What goes into a sandbox: source trees copied without what leaks deleted code, and a scrubbed environment."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from composer_plugins.envs.sandbox.types import SandboxError

#: Directory names dropped anywhere in a copied tree (caches, VCS history, build output).
LEAKY_DIRS: frozenset[str] = frozenset(
    {
        "__pycache__",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".dmypy",
        ".pyre",
        ".pytype",
        ".git",
        ".hg",
        ".svn",
        ".jj",
        ".tox",
        ".nox",
        ".eggs",
        "htmlcov",
        ".hypothesis",
        ".ipynb_checkpoints",
        ".idea",
        ".vscode",
        "_build",
        "site-packages",
        "__pypackages__",
        ".benchmarks",
    }
)

#: Directory names dropped only at the top of a copied tree (build output, virtualenvs).
LEAKY_TOP_DIRS: frozenset[str] = frozenset({"build", "dist", ".venv", "venv", "env", "wheelhouse"})

#: File name patterns dropped anywhere (bytecode, backups, coverage data, packaged copies, secrets).
LEAKY_FILES: tuple[str, ...] = (
    "*.pyc",
    "*.pyo",
    "*.orig",
    "*.rej",
    "*.bak",
    "*~",
    "*.swp",
    "*.swo",
    ".#*",
    "#*#",
    ".coverage",
    ".coverage.*",
    "coverage.xml",
    ".dmypy.json",
    "*.whl",
    "*.egg",
    "*.tar.gz",
    "*.zip",
    ".env",
    ".netrc",
    ".pypirc",
    ".git-credentials",
)

_LEAKY_DIR_GLOBS = ("*.egg-info", "*.dist-info")
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "COOKIE", "SESSION")


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _real(p: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.fspath(p))


def _leaky_dir(path: str, name: str, top: bool) -> bool:
    return (
        name in LEAKY_DIRS
        or (top and name in LEAKY_TOP_DIRS)
        or any(fnmatch.fnmatch(name, g) for g in _LEAKY_DIR_GLOBS)
        or os.path.exists(os.path.join(path, "pyvenv.cfg"))
    )


def _leaky_file(name: str, siblings: set[str]) -> bool:
    """A :data:`LEAKY_FILES` name, or a compiled twin (``mod.cpython-311-x86_64-linux-gnu.so`` next to ``mod.py``)."""
    return any(fnmatch.fnmatch(name, g) for g in LEAKY_FILES) or (
        name.endswith((".so", ".pyd")) and f"{name.split('.', 1)[0]}.py" in siblings
    )


def copy_clean_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[str]:
    """Copy ``src`` to ``dst`` without anything that could leak deleted code; return what was left out.

    Left out: :data:`LEAKY_DIRS` anywhere, :data:`LEAKY_TOP_DIRS` at the top, any directory holding a
    ``pyvenv.cfg``, :data:`LEAKY_FILES`, compiled twins of ``.py`` files and symlinks pointing outside ``src``.
    """
    src_r, dst_p = _real(src), Path(dst)
    dropped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(src_r):
        rel = os.path.relpath(dirpath, src_r)
        top = rel == "."
        keep_dirs = []
        for d in sorted(dirnames):
            full = os.path.join(dirpath, d)
            if _leaky_dir(full, d, top) or (os.path.islink(full) and not _inside(_real(full), src_r)):
                dropped.append(os.path.normpath(os.path.join(rel, d)))
            else:
                keep_dirs.append(d)
        dirnames[:] = keep_dirs
        out_dir = dst_p / rel
        out_dir.mkdir(parents=True, exist_ok=True)
        names = set(filenames)
        for f in sorted(filenames):
            full = os.path.join(dirpath, f)
            relf = os.path.normpath(os.path.join(rel, f))
            if _leaky_file(f, names) or (os.path.islink(full) and not _inside(_real(full), src_r)):
                dropped.append(relf)
            elif os.path.isfile(full):
                shutil.copyfile(full, out_dir / f)
    return dropped


def scrub_tree(root: str | os.PathLike[str]) -> list[str]:
    """Delete, in place, everything under ``root`` that :func:`copy_clean_tree` would leave out."""
    root_r = _real(root)
    removed: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root_r, topdown=True):
        rel = os.path.relpath(dirpath, root_r)
        for d in list(dirnames):
            full = os.path.join(dirpath, d)
            if _leaky_dir(full, d, rel == "."):
                shutil.rmtree(full, ignore_errors=True)
                dirnames.remove(d)
                removed.append(os.path.normpath(os.path.join(rel, d)))
        names = set(filenames)
        for f in filenames:
            if _leaky_file(f, names):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(dirpath, f))
                removed.append(os.path.normpath(os.path.join(rel, f)))
    return removed


def safe_env(root: str, python: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment a sandboxed process gets: nothing inherited, no secrets.

    ``extra`` entries whose names look like credentials (``*KEY*``, ``*TOKEN*`` ...) are refused.
    """
    bindir = os.path.dirname(python)
    env = {
        "PATH": os.pathsep.join(dict.fromkeys([bindir, "/usr/local/bin", "/usr/bin", "/bin"])),
        "HOME": os.path.join(root, "home"),
        "TMPDIR": os.path.join(root, "tmp"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONUNBUFFERED": "1",
        "PYTHONIOENCODING": "utf-8",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "NO_COLOR": "1",
    }
    for k, v in (extra or {}).items():
        if any(w in k.upper() for w in _SECRET_WORDS):
            raise SandboxError(f"refusing to pass environment variable {k!r} into the sandbox: it looks like a secret")
        env[k] = str(v)
    return env
