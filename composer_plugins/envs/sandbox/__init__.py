"""A sandbox for running untrusted (model-written) code, built so that rewards cannot be hacked.

Every run gets a fresh temp directory and a subprocess that:

* runs in new network, mount, PID, IPC and UTS namespaces when ``unshare`` works on this
  machine (``isolation="namespaces"``): no network at all (not even loopback), a private
  ``/proc`` (no other process's environment or memory), hidden paths overmounted by a tmpfs,
  every process killed with the namespace. Real root is switched to a fresh unprivileged uid
  (so ``RLIMIT_NPROC`` applies); a user namespace's root drops all capabilities;
* otherwise (``isolation="guard"``) is protected by an audit hook installed through
  ``sitecustomize`` (see :mod:`composer_plugins.envs.sandbox._runtime.sitecustomize`): sockets, hidden
  paths, other processes' ``/proc``, ctypes and object-graph walks are refused, and a token pipe
  caps the number of processes;
* sees every host path read-only (namespace mode remounts every mount read-only; the guard refuses
  writes) or hidden, except its own directory, whose total size is bounded (``max_disk_mb``); its
  ``/dev/shm`` is a private tmpfs of ``max_shm_mb``;
* has wall-clock and CPU timeouts, an address-space limit, a process limit, a file-size limit
  and an output-size limit, and is killed as a whole process group (``start_new_session`` +
  ``killpg``);
* dies with the process that started it (``PR_SET_PDEATHSIG`` on the outermost sandbox process, and
  on the namespace's init inside), and enforces its wall-clock limit inside as well, so killing the
  scorer with ``kill -9`` leaves nothing running; the next sandbox started on the machine removes
  ``cp-sandbox-*`` directories whose owner process is gone;
* with ``expose="allowlist"`` sees only an allow-list of host paths (the interpreter, its
  site-packages, system libraries) instead of everything but the hidden paths;
* sees a scrubbed environment (no API keys, ``HOME`` inside the sandbox,
  ``PYTHONDONTWRITEBYTECODE=1``);
* only gets copies of source trees with everything that leaks deleted code removed:
  ``__pycache__``/``.pyc``, type-checker and linter caches, ``.git`` history, build artifacts,
  editor backups, compiled copies of ``.py`` modules (see :func:`copy_clean_tree`).

Results come back on a nonce-authenticated pipe, so printing "PASSED" or exiting 0 early
scores nothing. ``composer-plugins env sandbox-check`` prints what works on this machine.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import itertools
import json
import os
import secrets
import selectors
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from composer_plugins import procs
from composer_plugins.core.errors import ComposerPluginsError

__all__ = [
    "LEAKY_DIRS",
    "LEAKY_FILES",
    "IsolationInfo",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "copy_clean_tree",
    "isolation_info",
    "safe_env",
    "scrub_tree",
]

_FILES_DIR = Path(__file__).with_name("_runtime")

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
        text = self.stderr or self.stdout
        return text[-n:]


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


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _real(p: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.fspath(p))


def _leaky(name: str, is_dir: bool, top: bool) -> bool:
    if is_dir:
        return (
            name in LEAKY_DIRS
            or (top and name in LEAKY_TOP_DIRS)
            or any(fnmatch.fnmatch(name, g) for g in _LEAKY_DIR_GLOBS)
        )
    return any(fnmatch.fnmatch(name, g) for g in LEAKY_FILES)


def _compiled_twin(name: str, siblings: set[str]) -> bool:
    """``mod.cpython-311-x86_64-linux-gnu.so`` next to ``mod.py``: a compiled copy of the source."""
    if not (name.endswith(".so") or name.endswith(".pyd")):
        return False
    return f"{name.split('.', 1)[0]}.py" in siblings


def copy_clean_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> list[str]:
    """Copy ``src`` to ``dst`` without anything that could leak deleted code; return what was left out.

    Left out: :data:`LEAKY_DIRS` anywhere (``__pycache__``, ``.mypy_cache``, ``.git`` ...),
    :data:`LEAKY_TOP_DIRS` at the top (``build``, ``dist``, virtualenvs), any directory holding a
    ``pyvenv.cfg``, :data:`LEAKY_FILES` (``*.pyc``, backups, wheels ...), compiled twins of
    ``.py`` files, and symlinks that point outside ``src``.
    """
    src_r, dst_p = _real(src), Path(dst)
    dropped: list[str] = []
    for dirpath, dirnames, filenames in os.walk(src_r):
        rel = os.path.relpath(dirpath, src_r)
        top = rel == "."
        keep_dirs = []
        for d in sorted(dirnames):
            full = os.path.join(dirpath, d)
            if _leaky(d, True, top) or os.path.exists(os.path.join(full, "pyvenv.cfg")):
                dropped.append(os.path.normpath(os.path.join(rel, d)))
            elif os.path.islink(full) and not _inside(_real(full), src_r):
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
            if _leaky(f, False, top) or _compiled_twin(f, names):
                dropped.append(relf)
                continue
            if os.path.islink(full) and not _inside(_real(full), src_r):
                dropped.append(relf)
                continue
            if not os.path.isfile(full):
                continue
            shutil.copyfile(full, out_dir / f)
    return dropped


def scrub_tree(root: str | os.PathLike[str]) -> list[str]:
    """Delete, in place, everything under ``root`` that :func:`copy_clean_tree` would leave out."""
    root_r = _real(root)
    removed: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root_r, topdown=True):
        rel = os.path.relpath(dirpath, root_r)
        top = rel == "."
        for d in list(dirnames):
            full = os.path.join(dirpath, d)
            if _leaky(d, True, top) or os.path.exists(os.path.join(full, "pyvenv.cfg")):
                shutil.rmtree(full, ignore_errors=True)
                dirnames.remove(d)
                removed.append(os.path.normpath(os.path.join(rel, d)))
        names = set(filenames)
        for f in filenames:
            if _leaky(f, False, top) or _compiled_twin(f, names):
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


def _procs_of_uid(uid: int) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            # threads count towards RLIMIT_NPROC too
                            n += max(1, len(os.listdir(f"/proc/{entry.name}/task")))
                        break
        except (OSError, ValueError, IndexError):
            continue
    return n


_uid_counter = itertools.count()
_UID_BASE = 1_400_000_000


def _fresh_uid() -> int:
    """A uid no account uses, for one sandbox run started by root."""
    return _UID_BASE + (os.getpid() % 100_000) * 1000 + next(_uid_counter) % 1000


@functools.lru_cache(maxsize=16)
def interpreter_paths(python: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(prefixes, import paths)`` of an interpreter: what a sandbox must keep visible to run it."""
    python = os.path.abspath(python)
    if python == os.path.abspath(sys.executable):
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
        paths: set[str] = set()
        with contextlib.suppress(Exception):
            paths.update(site.getsitepackages())
        for key in ("stdlib", "platstdlib", "purelib", "platlib"):
            with contextlib.suppress(Exception):
                paths.add(sysconfig.get_path(key))
    else:
        code = (
            "import json, sys\n"
            "print(json.dumps([[sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix],"
            " [p for p in sys.path if p]]))"
        )
        out = subprocess.run(
            [python, "-I", "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )
        if out.returncode != 0:
            raise SandboxError(f"cannot run the interpreter {python}: {out.stderr.strip()[-300:]}")
        pre, pp = json.loads(out.stdout)
        prefixes, paths = set(pre), set(pp)
    prefixes.add(os.path.dirname(os.path.dirname(python)))
    prefixes.add(os.path.dirname(os.path.dirname(_real(python))))
    norm_pre = tuple(sorted({_real(p) for p in prefixes if p and os.path.exists(p)}))
    norm_paths = tuple(sorted({_real(p) for p in paths if p and os.path.isdir(p)}))
    return norm_pre, norm_paths


def _untraversable_ancestors(paths: Iterable[str]) -> list[str]:
    """Ancestors of ``paths`` that other users cannot enter (no ``o+x``)."""
    out = []
    for p in paths:
        parts = Path(p).parts
        for i in range(2, len(parts)):
            anc = os.path.join(*parts[:i])
            try:
                if not os.stat(anc).st_mode & 0o001:
                    out.append(anc)
                    break
            except OSError:
                break
    return out


@dataclass
class _Pipes:
    chan_r: int
    chan_w: int
    nonce_r: int
    nonce_w: int
    fork_r: int | None = None

    def child_fds(self) -> tuple[int, ...]:
        return tuple(fd for fd in (self.chan_w, self.nonce_r, self.fork_r) if fd is not None)

    def close_child_ends(self) -> None:
        for fd in self.child_fds():
            with contextlib.suppress(OSError):
                os.close(fd)


class Sandbox:
    """Runs commands on untrusted code in a fresh, isolated, resource-limited temp directory.

    Args:
        limits: resource limits (:class:`SandboxLimits`).
        isolation: ``"auto"`` (namespaces when they work here, else guard), ``"namespaces"``
            (raise if unavailable) or ``"guard"`` (audit hook only).
        network: allow network access (off by default; loopback is refused too).
        hide: extra paths the sandboxed code must not see or read (an original repository ...).
        hide_home: hide the invoking user's home directory (API keys, ``~/.ssh`` ...).
        hide_tmp: hide the system temp directory except the sandbox's own.
        python: interpreter to run ``"python"`` commands with (default: this one).
        allow_subprocess: let the sandboxed code start programs. Default: yes with namespaces; no in
            guard mode, where a program started from Python would escape the audit hook.
        audit_guard: install the ``sitecustomize`` audit-hook guard (also in namespace mode).
        block_ctypes: refuse native calls through ctypes (default: only in guard mode).
        tmp_dir: where sandbox directories are created (default: the system temp dir).
        expose: ``"all"`` (every host path except the hidden ones, read-only) or ``"allowlist"``: only
            :data:`SYSTEM_PATHS`, the interpreter's prefixes and import paths, ``allow`` and the sandbox's
            own directory are visible; every other top-level directory is hidden (other checkouts of a
            repository, DVC caches, data disks ...).
        allow: extra host paths visible in ``allowlist`` mode (read-only).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolation: Literal["auto", "namespaces", "guard"] = "auto",
        network: bool = False,
        hide: Iterable[str | os.PathLike[str]] = (),
        hide_home: bool = True,
        hide_tmp: bool = True,
        python: str | None = None,
        allow_subprocess: bool | None = None,
        audit_guard: bool = True,
        block_ctypes: bool | None = None,
        tmp_dir: str | None = None,
        expose: Literal["all", "allowlist"] = "all",
        allow: Iterable[str | os.PathLike[str]] = (),
    ) -> None:
        if isolation not in ("auto", "namespaces", "guard"):
            raise ValueError(f"isolation must be 'auto', 'namespaces' or 'guard', got {isolation!r}")
        if expose not in ("all", "allowlist"):
            raise ValueError(f"expose must be 'all' or 'allowlist', got {expose!r}")
        self.expose = expose
        self.allow = [_real(p) for p in allow]
        self.limits = limits or SandboxLimits()
        self.python = os.path.abspath(python or sys.executable)
        self.network = network
        self.hide = [_real(p) for p in hide]
        self.hide_home = hide_home
        self.hide_tmp = hide_tmp
        self.audit_guard = audit_guard
        self.tmp_dir = tmp_dir
        self._requested = isolation
        info = isolation_info(self.python) if isolation != "guard" else None
        if isolation == "namespaces" and info is not None and not info.namespaces:
            raise SandboxError(f"namespace isolation is not available here: {info.reason}")
        if isolation == "auto" and info is not None and not info.namespaces:
            _warn_once(f"sandbox: namespaces unavailable ({info.reason}); using the audit-hook guard only")
        self.isolation = "namespaces" if info is not None and info.namespaces else "guard"
        self._unshare = info.unshare if info is not None else None
        self.block_ctypes = (self.isolation == "guard") if block_ctypes is None else block_ctypes
        self.allow_subprocess = (self.isolation == "namespaces") if allow_subprocess is None else allow_subprocess

    # ------------------------------------------------------------------------------------
    def run(
        self,
        argv: Sequence[str],
        *,
        files: Mapping[str, str | bytes] | None = None,
        tree: str | os.PathLike[str] | None = None,
        tree_overrides: Mapping[str, str | bytes] | None = None,
        cwd: str = ".",
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        pythonpath: Sequence[str] = (),
        hide: Iterable[str | os.PathLike[str]] = (),
        readonly: Sequence[str] = (),
        protected_packages: Sequence[str] = (),
        scripts: Sequence[str] = (),
        collect: Sequence[str] = (),
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Run ``argv`` (``"python"`` as ``argv[0]`` means the sandbox interpreter) in a fresh sandbox.

        Args:
            files: ``relative path -> content`` written into the working directory.
            tree: a source tree copied (cleaned, see :func:`copy_clean_tree`) into the working directory.
            tree_overrides: ``relative path -> content`` written over the copied tree.
            cwd: working directory, relative to the sandbox's working directory.
            pythonpath: extra import paths, relative to the working directory.
            hide: more paths to hide for this run only.
            readonly: paths, relative to the working directory, the code may not modify.
            protected_packages: top-level packages importable only from the working directory.
            scripts: trusted programs from ``_sandbox/`` to make importable (``code_harness`` ...).
            collect: relative paths of files to read back after the run (into ``result.files``).
        """
        lim = limits or self.limits
        parent_dir = self.tmp_dir or tempfile.gettempdir()
        if parent_dir not in _swept:
            _swept.add(parent_dir)
            remove_leftover_sandboxes(parent_dir)
        base = tempfile.mkdtemp(prefix="cp-sandbox-", dir=self.tmp_dir)
        root = _real(base)
        with open(os.path.join(root, OWNER_FILE), "w") as f:
            f.write(_owner_stamp(os.getpid()))
        work, harness = os.path.join(root, "work"), os.path.join(root, "harness")
        for d in (work, harness, os.path.join(root, "tmp"), os.path.join(root, "home")):
            os.makedirs(d)
        pipes: _Pipes | None = None
        proc: subprocess.Popen[bytes] | None = None
        try:
            if tree is not None:
                copy_clean_tree(tree, work)
            for rel, content in {**(files or {}), **(tree_overrides or {})}.items():
                self._write(work, rel, content)
            scrub_tree(work)
            for name in ("sitecustomize", "_cp_channel", "launcher", *scripts):
                shutil.copyfile(_FILES_DIR / f"{name}.py", os.path.join(harness, f"{name}.py"))
            uid = self._sandbox_uid()
            if uid is not None:
                for dirpath, _dirnames, filenames in os.walk(root):
                    if _inside(dirpath, harness):
                        continue
                    os.chown(dirpath, uid, uid)
                    for n in filenames:
                        os.chown(os.path.join(dirpath, n), uid, uid, follow_symlinks=False)
            run_cwd = _real(os.path.join(work, cwd))
            ro = [_real(os.path.join(work, r)) for r in readonly]
            hidden, keep = self._hidden_and_kept(root, [*self.hide, *(_real(h) for h in hide)])
            pipes = self._pipes(lim)
            target = [self.python if a == "python" else a for a in argv]
            guard = {
                "root": root,
                "hidden": hidden,
                "keep": keep,
                "readonly": ro,
                "block_network": not self.network,
                "block_ctypes": self.block_ctypes,
                "allow_subprocess": self.allow_subprocess,
                "private_proc": True,
                "fork_fd": pipes.fork_r,
                "protected_packages": list(protected_packages),
                "writable": root,
            }
            extra_env = dict(env or {})
            child_env = safe_env(root, self.python, extra_env)
            pp = [harness] + [_real(os.path.join(work, p)) for p in pythonpath]
            child_env["PYTHONPATH"] = os.pathsep.join(pp)
            child_env["CP_SANDBOX_CHANNEL"] = str(pipes.chan_w)
            child_env["CP_SANDBOX_NONCE_FD"] = str(pipes.nonce_r)
            child_env["CP_SANDBOX_ID"] = os.path.basename(root)
            if self.audit_guard:
                child_env["CP_SANDBOX_GUARD"] = json.dumps(guard)
            cmd = self._command(root, harness, run_cwd, target, hidden, keep, ro, uid, lim)
            nonce = secrets.token_hex(16).encode()
            start = time.monotonic()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=pipes.child_fds(),
                start_new_session=True,
                env=child_env,
                cwd=root,
                close_fds=True,
                # dies with this thread, even when the scorer is SIGKILLed; inside, the launcher (the
                # namespace's init) dies with it, and with it every process of the sandbox
                preexec_fn=procs.die_with_parent(),
            )
            pipes.close_child_ends()
            with contextlib.suppress(OSError):
                os.write(pipes.nonce_w, nonce + b"\n")
            os.close(pipes.nonce_w)
            pipes.nonce_w = -1
            if stdin is not None and proc.stdin is not None:
                data = stdin.encode() if isinstance(stdin, str) else stdin
                threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True).start()
            out, err, chan, killed = self._pump(proc, pipes.chan_r, lim, start, root)
            if killed:
                self._kill(proc, root)
            try:
                rc = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill(proc, root)
                rc = proc.wait()
            self._kill(proc, root)  # stragglers (daemonised children) in guard mode
            duration = time.monotonic() - start
            records, forged = _parse_channel(chan, nonce)
            stderr = err.decode("utf-8", "replace")
            if rc is not None and rc > 128:
                rc = 128 - rc  # the launcher reports "killed by signal N" as 128 + N, like a shell
            if rc == 125 and "sandbox launcher:" in stderr:
                raise SandboxError(f"the sandbox could not start: {stderr.strip()[-500:]}")
            if killed is None:
                killed = _killed_by(rc, stderr)
            collected = {}
            for rel in collect:
                p = os.path.join(work, rel)
                with contextlib.suppress(OSError):
                    # the sandboxed code may have planted symlinks: read only what really is inside
                    if _inside(_real(p), _real(work)) and os.path.isfile(p):
                        with open(p, "rb") as f:
                            collected[rel] = f.read(lim.max_output_bytes)
            return SandboxResult(
                returncode=rc,
                stdout=out.decode("utf-8", "replace"),
                stderr=stderr,
                duration_s=duration,
                isolation=self.isolation,
                killed=killed,
                records=records,
                forged_records=forged,
                files=collected,
                sandbox_id=os.path.basename(root),
            )
        finally:
            if proc is not None and proc.poll() is None:
                self._kill(proc, root)
                with contextlib.suppress(Exception):
                    proc.wait(timeout=5)
            if pipes is not None:
                for fd in (pipes.chan_r, pipes.nonce_w, pipes.fork_r):
                    if fd is not None and fd >= 0:
                        with contextlib.suppress(OSError):
                            os.close(fd)
            _rmtree(root)

    def run_code(self, code: str, *, filename: str = "main.py", **kwargs: Any) -> SandboxResult:
        """Write ``code`` to ``filename`` and run it with the sandbox interpreter."""
        files = dict(kwargs.pop("files", None) or {})
        files[filename] = code
        return self.run(["python", "-B", filename], files=files, **kwargs)

    # ------------------------------------------------------------------------------------
    @staticmethod
    def _write(work: str, rel: str, content: str | bytes) -> None:
        p = os.path.normpath(os.path.join(work, rel))
        if not _inside(p, work):
            raise SandboxError(f"file {rel!r} would be written outside the sandbox")
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)

    def _sandbox_uid_needed(self) -> bool:
        return self.isolation == "namespaces" and os.geteuid() == 0

    def _sandbox_uid(self) -> int | None:
        return _fresh_uid() if self._sandbox_uid_needed() else None

    def _hidden_and_kept(self, root: str, extra: list[str]) -> tuple[list[str], list[str]]:
        hidden = list(extra)
        if self.hide_home:
            home = os.path.expanduser("~")
            if home not in ("", "/") and os.path.isdir(home):
                hidden.append(_real(home))
        if getattr(sys, "pycache_prefix", None):
            hidden.append(_real(sys.pycache_prefix))  # type: ignore[arg-type]
        if self.hide_tmp:
            hidden.append(_real(tempfile.gettempdir()))
            if self.tmp_dir:
                hidden.append(_real(self.tmp_dir))
        prefixes, paths = interpreter_paths(self.python)
        # Import paths inside an explicitly hidden path (an editable install pointing at the original
        # repository) are not kept; interpreter prefixes always are (a venv inside the repository).
        keep = sorted({root, *prefixes, *(p for p in paths if not any(_inside(p, h) for h in extra))})
        if self.expose == "allowlist":
            keep = sorted({*keep, *self.allow})
            allowed = {_real(p) for p in SYSTEM_PATHS}
            with os.scandir("/") as entries:
                for e in entries:
                    full = os.path.join("/", e.name)
                    if e.is_symlink() or full in allowed or _real(full) in allowed:
                        continue
                    hidden.append(_real(full))
        if self._sandbox_uid_needed():
            # The unprivileged uid must reach the interpreter: overmount ancestors it cannot traverse
            # (e.g. a 0700 /root holding pyenv); the kept paths are bound back into the tmpfs.
            hidden.extend(_untraversable_ancestors(keep))
        # Never hide "/" or a kept path itself; a hidden path may contain kept ones (bound back in)
        # or lie inside one (a site-packages copy of a repo inside the interpreter's prefix).
        hidden = sorted({h for h in hidden if h not in ("", "/") and h not in keep})
        return hidden, keep

    def _pipes(self, lim: SandboxLimits) -> _Pipes:
        chan_r, chan_w = os.pipe()
        nonce_r, nonce_w = os.pipe()
        fork_r = None
        if self.isolation == "guard":
            fork_r, fork_w = os.pipe()
            os.set_blocking(fork_r, False)
            os.write(fork_w, b"t" * max(1, lim.max_processes))
            os.close(fork_w)
        return _Pipes(chan_r, chan_w, nonce_r, nonce_w, fork_r)

    def _rlimits(self, lim: SandboxLimits, uid: int | None) -> dict[str, tuple[int, int]]:
        cpu = int(max(1, round(lim.cpu_time_s if lim.cpu_time_s is not None else lim.wall_time_s)))
        rl: dict[str, tuple[int, int]] = {
            "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_FSIZE": (lim.max_file_mb << 20, lim.max_file_mb << 20),
            "RLIMIT_CORE": (0, 0),
            "RLIMIT_NOFILE": (lim.max_open_files, lim.max_open_files),
        }
        if lim.memory_mb:
            rl["RLIMIT_AS"] = (lim.memory_mb << 20, lim.memory_mb << 20)
        if uid is not None:
            rl["RLIMIT_NPROC"] = (lim.max_processes, lim.max_processes)
        elif os.geteuid() != 0:
            # RLIMIT_NPROC counts every process of the uid, so leave room for the existing ones.
            n = _procs_of_uid(os.getuid()) + lim.max_processes
            rl["RLIMIT_NPROC"] = (n, n)
        return rl

    def _command(
        self,
        root: str,
        harness: str,
        cwd: str,
        target: list[str],
        hidden: list[str],
        keep: list[str],
        readonly: list[str],
        uid: int | None,
        lim: SandboxLimits,
    ) -> list[str]:
        cfg: dict[str, Any] = {
            "argv": target,
            "cwd": cwd,
            "rlimits": self._rlimits(lim, uid),
            "wall_s": lim.wall_time_s + 2.0,
        }
        launcher = os.path.join(harness, "launcher.py")
        if self.isolation == "namespaces":
            cfg.update(hidden=hidden, keep=keep, readonly=readonly, writable=root, shm_mb=lim.max_shm_mb)
            flags = ["--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts"]
            if not self.network:
                flags.insert(0, "--net")
            if uid is not None:
                cfg["uid"] = uid
            else:
                flags.insert(0, "--map-root-user")
                cfg["drop_caps"] = True
            return [str(self._unshare), *flags, self.python, "-I", "-S", "-B", launcher, json.dumps(cfg)]
        cfg["parent_pid"] = os.getpid()
        return [self.python, "-I", "-S", "-B", launcher, json.dumps(cfg)]

    def _pump(
        self, proc: subprocess.Popen[bytes], chan_r: int, lim: SandboxLimits, start: float, root: str | None = None
    ) -> tuple[bytes, bytes, bytes, str | None]:
        assert proc.stdout is not None and proc.stderr is not None
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), chan_r: bytearray()}
        caps = {proc.stdout.fileno(): lim.max_output_bytes, proc.stderr.fileno(): lim.max_output_bytes}
        caps[chan_r] = max(4 * lim.max_output_bytes, 8 << 20)
        sel = selectors.DefaultSelector()
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        killed: str | None = None
        exited_at: float | None = None
        deadline = start + lim.wall_time_s
        next_disk_check = start + 0.5
        try:
            while sel.get_map():
                now = time.monotonic()
                if now >= deadline:
                    killed = "timeout"
                    break
                if root is not None and lim.max_disk_mb and now >= next_disk_check:
                    next_disk_check = now + 0.5
                    if _disk_usage(root) > lim.max_disk_mb << 20:
                        killed = "disk_limit"
                        break
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > 1.0:
                    break  # the main process is gone; do not wait on orphans holding the pipes
                for key, _ in sel.select(timeout=min(0.2, deadline - now)):
                    fd = int(key.fd)  # type: ignore[call-overload]
                    try:
                        data = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(fd)
                        continue
                    room = caps[fd] - len(bufs[fd])
                    bufs[fd] += data[: max(room, 0)]
                    if len(data) > room:
                        killed = "output_limit"
                if killed:
                    break
        finally:
            sel.close()
        return (bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), bytes(bufs[chan_r]), killed)

    def _kill(self, proc: subprocess.Popen[bytes], root: str) -> None:
        """Kill the run's whole process group (and, in guard mode, any process that left it)."""
        for _ in range(5):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self.isolation == "namespaces":
                return  # the PID namespace dies with its first process
            stray = _find_sandbox_processes(proc.pid, os.path.basename(root))
            if not stray:
                return
            for pid in stray:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)


#: Host paths visible in ``expose="allowlist"`` mode besides the interpreter and the sandbox itself.
SYSTEM_PATHS: tuple[str, ...] = (
    "/usr",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/bin",
    "/sbin",
    "/etc",
    "/dev",
    "/proc",
    "/sys",
)
OWNER_FILE = "owner"
_swept: set[str] = set()


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()[19].decode()


def _owner_stamp(pid: int) -> str:
    return f"{pid} {_start_time(pid) or '?'}\n"


def remove_leftover_sandboxes(directory: str | os.PathLike[str]) -> list[str]:
    """Remove ``cp-sandbox-*`` directories in ``directory`` whose owner process is gone; return them.

    Each sandbox directory records its owner (pid and start time); one whose owner died without
    cleaning up (``kill -9`` of the scorer) is removed by the next sandbox run on the machine. A
    directory without the record is left alone unless it is older than an hour.
    """
    removed = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for e in entries:
            if not e.name.startswith("cp-sandbox-") or not e.is_dir(follow_symlinks=False):
                continue
            try:
                with open(os.path.join(e.path, OWNER_FILE)) as f:
                    pid_s, _, started = f.read().strip().partition(" ")
                alive = pid_s.isdigit() and _start_time(int(pid_s)) == started
            except OSError:
                alive = time.time() - e.stat(follow_symlinks=False).st_mtime < 3600
            if not alive:
                _rmtree(e.path)
                removed.append(e.path)
    return removed


def _disk_usage(root: str) -> int:
    """Bytes allocated under ``root`` (not following symlinks)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for n in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
    return total


def _feed(pipe: Any, data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):
        pipe.write(data)
        pipe.close()


def _find_sandbox_processes(pgid: int, sandbox_id: str) -> list[int]:
    found = []
    marker = f"CP_SANDBOX_ID={sandbox_id}".encode()
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rfind(b")") + 2 :].split()
            state, pgrp, sid = fields[0], int(fields[2]), int(fields[3])
            if state == b"Z":
                continue
            if pgrp == pgid or sid == pgid:
                found.append(pid)
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    return found


def _parse_channel(data: bytes, nonce: bytes) -> tuple[list[dict[str, Any]], int]:
    records: list[dict[str, Any]] = []
    forged = 0
    for line in data.split(b"\n"):
        if not line:
            continue
        prefix, sep, payload = line.partition(b"\t")
        if not sep or not secrets.compare_digest(prefix, nonce):
            forged += 1
            continue
        try:
            rec = json.loads(payload)
        except ValueError:
            forged += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            forged += 1
    return records, forged


def _killed_by(rc: int | None, stderr: str) -> str | None:
    if rc is None:
        return None
    if rc == -signal.SIGXCPU:
        return "cpu_limit"
    if rc == -signal.SIGXFSZ:
        return "file_size_limit"
    if "MemoryError" in stderr[-2000:]:
        return "memory_limit"
    return None


def _rmtree(path: str) -> None:
    def onerror(func: Any, p: str, exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)

    shutil.rmtree(path, onerror=onerror)


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=8)
def isolation_info(python: str | None = None) -> IsolationInfo:
    """Find out (once per interpreter) whether namespace isolation works on this machine.

    Runs a real sandbox with namespaces, a hidden directory and the privilege drop, and checks
    that the hidden directory is empty and that the network is gone.
    """
    python = os.path.abspath(python or sys.executable)
    root = os.geteuid() == 0
    unshare = shutil.which("unshare")
    if not sys.platform.startswith("linux"):
        return IsolationInfo(False, f"namespaces need Linux (this is {sys.platform})", root, unshare)
    if unshare is None:
        return IsolationInfo(False, "the unshare program (util-linux) is not installed", root, None)
    probe_dir = tempfile.mkdtemp(prefix="cp-sandbox-probe-")
    try:
        Path(probe_dir, "secret.txt").write_text("probe")
        sb = Sandbox.__new__(Sandbox)
        sb.limits = SandboxLimits(wall_time_s=20, memory_mb=None)
        sb.python, sb.network, sb.hide, sb.hide_home, sb.hide_tmp = python, False, [_real(probe_dir)], False, False
        sb.allow_subprocess, sb.audit_guard, sb.tmp_dir, sb._requested = True, False, None, "namespaces"
        sb.expose, sb.allow = "all", []
        sb.isolation, sb.block_ctypes = "namespaces", False
        code = (
            "import os, socket\n"
            f"print('hidden-empty', os.listdir({probe_dir!r}) == [])\n"
            "s = socket.socket()\n"
            "try:\n    s.connect(('127.0.0.1', 9)); print('net', 'open')\n"
            "except OSError:\n    print('net', 'closed')\n"
        )
        sb._unshare = unshare
        try:
            res = sb.run_code(code)
        except SandboxError as e:
            return IsolationInfo(False, str(e), root, unshare)
        if res.returncode != 0:
            return IsolationInfo(False, f"unshare failed: {res.tail(300).strip()}", root, unshare)
        if "hidden-empty True" not in res.stdout or "net closed" not in res.stdout:
            return IsolationInfo(False, f"namespaces did not isolate: {res.stdout.strip()}", root, unshare)
        how = "as root, dropping to a fresh uid" if root else "with a user namespace"
        return IsolationInfo(True, f"unshare works ({how})", root, unshare)
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
