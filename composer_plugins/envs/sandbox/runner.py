"""The :class:`Sandbox`: one isolated, resource-limited run of a command (pipes, result channel, kill); the probe."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from composer_plugins import procs
from composer_plugins.envs.sandbox.host import (
    OWNER_FILE,
    SYSTEM_PATHS,
    _disk_usage,
    _find_sandbox_processes,
    _fresh_uid,
    _owner_stamp,
    _procs_of_uid,
    _rmtree,
    _untraversable_ancestors,
    interpreter_paths,
    remove_leftover_sandboxes,
)
from composer_plugins.envs.sandbox.tree import _inside, _real, copy_clean_tree, safe_env, scrub_tree
from composer_plugins.envs.sandbox.types import IsolationInfo, SandboxError, SandboxLimits, SandboxResult

_FILES_DIR = Path(__file__).with_name("_runtime")


@dataclass
class _Pipes:
    chan_r: int
    chan_w: int
    nonce_r: int
    nonce_w: int
    fork_r: int | None = None

    def child_fds(self) -> tuple[int, ...]:
        return tuple(fd for fd in (self.chan_w, self.nonce_r, self.fork_r) if fd is not None)


class Sandbox:
    """Runs commands on untrusted code in a fresh, isolated, resource-limited temp directory.

    The ``isolation`` modes and their defaults (starting programs and ctypes refused in guard mode only:
    ``allow_subprocess``, ``block_ctypes``), ``expose``/``allow`` and what each protection rests on: docs/envs.md,
    "The sandbox".

    Args:
        hide: extra paths the sandboxed code must not see or read (an original repository ...).
        python: interpreter to run ``"python"`` commands with (default: this one).
        audit_guard: install the ``sitecustomize`` audit-hook guard (also in namespace mode).
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
        info = isolation_info(self.python) if isolation != "guard" else None
        if isolation == "namespaces" and info is not None and not info.namespaces:
            raise SandboxError(f"namespace isolation is not available here: {info.reason}")
        if isolation == "auto" and info is not None and not info.namespaces:
            _warn_once(f"sandbox: namespaces unavailable ({info.reason}); using the audit-hook guard only")
        self.isolation = "namespaces" if info is not None and info.namespaces else "guard"
        self._unshare = info.unshare if info is not None else None
        self.block_ctypes = (self.isolation == "guard") if block_ctypes is None else block_ctypes
        self.allow_subprocess = (self.isolation == "namespaces") if allow_subprocess is None else allow_subprocess

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
            scripts: trusted programs from ``_runtime/`` to make importable (``code_harness`` ...).
            collect: relative paths of files to read back after the run (into ``result.files``).
        """
        lim = limits or self.limits
        parent_dir = self.tmp_dir or tempfile.gettempdir()
        if parent_dir not in _swept:
            _swept.add(parent_dir)
            remove_leftover_sandboxes(parent_dir)
        root = _real(tempfile.mkdtemp(prefix="cp-sandbox-", dir=self.tmp_dir))
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
            uid = _fresh_uid() if self._sandbox_uid_needed() else None
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
            child_env = safe_env(root, self.python, env)
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
            for fd in pipes.child_fds():
                with contextlib.suppress(OSError):
                    os.close(fd)
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
        files = {**(kwargs.pop("files", None) or {}), filename: code}
        return self.run(["python", "-B", filename], files=files, **kwargs)

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
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if self.isolation == "namespaces":
                return  # the PID namespace dies with its first process
            stray = _find_sandbox_processes(proc.pid, os.path.basename(root))
            if not stray:
                return
            for pid in stray:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)


_swept: set[str] = set()


def _feed(pipe: Any, data: bytes) -> None:
    with contextlib.suppress(OSError, ValueError):
        pipe.write(data)
        pipe.close()


def _parse_channel(data: bytes, nonce: bytes) -> tuple[list[dict[str, Any]], int]:
    """The authenticated records, and how many lines were not (forged)."""
    parsed = [_record(line, nonce) for line in data.split(b"\n") if line]
    records = [r for r in parsed if r is not None]
    return records, len(parsed) - len(records)


def _record(line: bytes, nonce: bytes) -> dict[str, Any] | None:
    """The JSON object of a ``<nonce>\\t<json>`` line; ``None`` for anything else."""
    prefix, sep, payload = line.partition(b"\t")
    if not sep or not secrets.compare_digest(prefix, nonce):
        return None
    try:
        rec = json.loads(payload)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


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
        # built in guard mode (which does not probe), then switched to namespaces for the probe run
        sb = Sandbox(
            SandboxLimits(wall_time_s=20, memory_mb=None),
            isolation="guard",
            hide=[probe_dir],
            hide_home=False,
            hide_tmp=False,
            python=python,
            allow_subprocess=True,
            audit_guard=False,
            block_ctypes=False,
        )
        sb.isolation, sb._unshare = "namespaces", unshare
        code = (
            "import os, socket\n"
            f"print('hidden-empty', os.listdir({probe_dir!r}) == [])\n"
            "s = socket.socket()\n"
            "try:\n    s.connect(('127.0.0.1', 9)); print('net', 'open')\n"
            "except OSError:\n    print('net', 'closed')\n"
        )
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
