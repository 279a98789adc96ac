"""Sandbox guard, imported by the sandboxed interpreter at start-up as ``sitecustomize``.

Installs an audit hook (``sys.addaudithook``; it cannot be removed from Python code) configured by the JSON in
``CP_SANDBOX_GUARD``. What it refuses (network, hidden paths and other processes' ``/proc``, writes to read-only
paths or outside the sandbox, spawns beyond a token-pipe budget that holds for root too, ctypes, ``gc`` walks that
dig secrets out of the harness's memory, the repo's packages from anywhere but the sandbox copy): docs/envs.md,
"The sandbox".

In namespace mode the kernel enforces the same rules; this hook is a second layer. In guard
mode (no namespaces available) it is the only layer: a determined attacker with native code
could get around it, which is why ctypes is refused there.
"""

import json as _json
import os as _os
import sys as _sys


def _install():
    raw = _os.environ.get("CP_SANDBOX_GUARD")
    if not raw:
        return
    cfg = _json.loads(raw)
    realpath, fsdecode, fspath = _os.path.realpath, _os.fsdecode, _os.fspath
    getpid, read = _os.getpid, _os.read
    root = cfg.get("root") or "/nonexistent"
    hidden = tuple(cfg.get("hidden") or ())
    keep = tuple(cfg.get("keep") or ())
    readonly = tuple(cfg.get("readonly") or ())
    writable = cfg.get("writable")
    devices = ("/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty", "/dev/zero", "/dev/full")
    block_net = bool(cfg.get("block_network", True))
    block_ctypes = bool(cfg.get("block_ctypes", False))
    allow_spawn = bool(cfg.get("allow_subprocess", True))
    private_proc = bool(cfg.get("private_proc", True))
    fork_fd = cfg.get("fork_fd")
    net_families = frozenset((2, 10, 17))  # AF_INET, AF_INET6, AF_PACKET
    write_flags = _os.O_WRONLY | _os.O_RDWR | _os.O_APPEND | _os.O_CREAT | _os.O_TRUNC

    def inside(path, parent):
        return path == parent or path.startswith(parent.rstrip("/") + "/")

    def resolve(path):
        if isinstance(path, int):
            return None
        try:
            return realpath(fsdecode(fspath(path)))
        except (TypeError, ValueError):
            return None

    def is_hidden(rp):
        for h in hidden:
            if inside(rp, h) and not any(inside(rp, k) and inside(k, h) and len(k) > len(h) for k in keep):
                return True
        if private_proc and rp.startswith("/proc/"):
            part = rp[6:].split("/", 1)[0]
            if part.isdigit() and int(part) != getpid():
                return True
        return False

    def deny(what):
        raise PermissionError(13, "sandbox: " + what + " is not allowed")

    def take_token():
        if fork_fd is None:
            return
        try:
            got = read(fork_fd, 1)
        except OSError:
            got = b""
        if not got:
            raise BlockingIOError(11, "sandbox: process budget exhausted (fork refused)")

    def hook(event, args):
        if event == "open":
            rp = resolve(args[0])
            if rp is None:
                return
            if is_hidden(rp):
                deny(f"access to {args[0]!r}")
            mode, flags = args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writing and any(inside(rp, r) for r in readonly):
                deny(f"writing {args[0]!r} (read-only)")
            if (
                writing
                and writable
                and not inside(rp, writable)
                and rp not in devices
                and not rp.startswith("/proc/self/fd/")
            ):
                deny(f"writing {args[0]!r} (only the sandbox directory is writable)")
        elif event in ("os.listdir", "os.scandir", "os.chdir"):
            rp = resolve(args[0] if args and args[0] is not None else ".")
            if rp is not None and is_hidden(rp):
                deny(f"listing {args[0]!r}")
        elif event in (
            "os.rename",
            "os.remove",
            "os.rmdir",
            "os.link",
            "os.symlink",
            "os.truncate",
            "os.chmod",
            "os.chown",
            "os.mkdir",
            "os.utime",
            "shutil.rmtree",
        ):
            for a in args[:2]:
                rp = resolve(a) if isinstance(a, str | bytes | _os.PathLike) else None
                if rp is not None and (is_hidden(rp) or any(inside(rp, r) for r in readonly)):
                    deny(f"{event} on {a!r}")
            # what the call changes: the new name of a link, both names of a rename, else the first argument
            changed = args[1:2] if event in ("os.symlink", "os.link") else args[:1]
            if event == "os.rename":
                changed = args[:2]
            for a in changed:
                rp = resolve(a) if isinstance(a, str | bytes | _os.PathLike) else None
                if rp is not None and writable and not inside(rp, writable):
                    deny(f"{event} on {a!r} (only the sandbox directory is writable)")
        elif event.startswith("socket."):
            if not block_net:
                return
            if event == "socket.__new__":
                if args[1] in net_families:
                    deny("network access")
            elif event in (
                "socket.getaddrinfo",
                "socket.gethostbyname",
                "socket.gethostbyname_ex",
                "socket.gethostbyaddr",
                "socket.getnameinfo",
            ):
                deny("network access (DNS)")
            elif event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
                sock, addr = args[0], args[1] if len(args) > 1 else None
                family = getattr(sock, "family", None)
                if family in net_families:
                    deny("network access")
                if family == 1 and isinstance(addr, str | bytes) and addr:  # AF_UNIX
                    p = fsdecode(addr)
                    if not p.startswith("\0") and not inside(realpath(p), root):
                        deny(f"connecting to unix socket {p!r}")
        elif event in ("os.fork", "os.forkpty"):
            take_token()
        elif event in ("subprocess.Popen", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "pty.spawn"):
            if not allow_spawn:
                deny(f"starting programs ({event})")
            if event != "os.exec":
                take_token()
        elif event in ("gc.get_objects", "gc.get_referrers", "gc.get_referents"):
            deny(f"walking the object graph ({event})")
        elif block_ctypes and event.startswith("ctypes."):
            if event == "ctypes.dlopen" and args and args[0] is None:
                return  # `import ctypes` opens the interpreter itself; calling into it is refused below
            if event in (
                "ctypes.dlopen",
                "ctypes.dlsym",
                "ctypes.dlsym/handle",
                "ctypes.cdata",
                "ctypes.cdata/buffer",
                "ctypes.addressof",
                "ctypes.string_at",
                "ctypes.wstring_at",
                "ctypes.call_function",
                "ctypes.set_errno",
                "ctypes.get_errno",
            ):
                deny(f"native code through ctypes ({event})")

    _sys.addaudithook(hook)

    protected = frozenset(cfg.get("protected_packages") or ())
    if protected:
        from importlib.machinery import PathFinder

        class _SandboxCopyOnly:
            """Import the repo's own packages only from the sandbox copy."""

            @staticmethod
            def find_spec(fullname, path=None, target=None):
                if fullname not in protected:
                    return None
                paths = [p for p in _sys.path if inside(realpath(p or "."), root)]
                spec = PathFinder.find_spec(fullname, paths)
                if spec is None:
                    raise ModuleNotFoundError(f"No module named {fullname!r} in the sandbox", name=fullname)
                return spec

            @staticmethod
            def invalidate_caches():
                return None

        _sys.meta_path.insert(0, _SandboxCopyOnly)


_install()
del _install
