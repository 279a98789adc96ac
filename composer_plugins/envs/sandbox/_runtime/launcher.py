"""Sandbox launcher: the first (trusted) program that runs inside a sandbox.

Run as ``python -I -S -B launcher.py '<json config>'``, either directly (guard mode) or
under ``unshare`` (namespace mode, where it is PID 1 of a fresh PID namespace). In order: hide paths (a
read-only tmpfs over each, ``/dev/null`` over a file, the kept paths bound back in); make the read-only paths
and every other host mount read-only, ``/dev/shm`` a private tmpfs; drop privileges (after the mounts, so that
nothing can unmount them); apply rlimits; fork the target and stay as a minimal init that reaps orphans, exits
with the target's status (``128 + N`` for signal N, like a shell) and SIGKILLs the whole sandbox when its
parent dies or ``wall_s`` passes. What each step guarantees: docs/envs.md, "The sandbox".

Standard library only; it must not import anything from the sandboxed tree.
"""

import ctypes
import json
import os
import resource
import signal
import sys

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
#: mount options that must be kept when remounting (a user namespace may not clear locked ones): their MS_* flags
_KEEP_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": 8,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
    "strictatime": 1 << 24,
}

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# SECBIT_NOROOT | _LOCKED | SECBIT_NO_SETUID_FIXUP | _LOCKED | SECBIT_KEEP_CAPS_LOCKED
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20
LINUX_CAPABILITY_VERSION_3 = 0x20080522

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def fail(msg):
    os.write(2, ("sandbox launcher: " + msg + "\n").encode())
    os._exit(125)


def _b(s):
    return None if s is None else os.fsencode(s)


def mount(src, target, fstype, flags, data=None):
    if libc.mount(_b(src), _b(target), _b(fstype), flags, _b(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def prctl(option, arg2=0, arg3=0, arg4=0, arg5=0):
    if libc.prctl(option, arg2, arg3, arg4, arg5) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def inside(path, parent):
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def hide_paths(hidden, keep):
    """Overmount every hidden path; bind the kept paths inside it back in."""
    hidden = sorted({h for h in hidden if os.path.lexists(h)}, key=lambda p: (p.count("/"), p))
    keep = [k for k in keep if os.path.exists(k)]
    for h in hidden:
        if h in keep or not os.path.lexists(h):
            continue  # kept, or already gone under an overmounted ancestor
        inner = [k for k in keep if inside(k, h) and k != h]
        # Open the kept paths before they disappear under the overmount.
        fds = [(k, os.open(k, os.O_PATH | os.O_CLOEXEC), os.path.isdir(k)) for k in inner]
        is_dir = os.path.isdir(h) and not os.path.islink(h)
        if is_dir:
            mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "size=256k,mode=0755")
        else:
            mount("/dev/null", h, None, MS_BIND)
        for k, fd, k_is_dir in fds:
            if k_is_dir:
                os.makedirs(k, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(k), exist_ok=True)
                open(k, "a").close()
            mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)
            os.close(fd)
        if is_dir:
            try:
                mount(None, h, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
            except OSError:
                pass


def bind_readonly(paths):
    for p in paths:
        if not os.path.exists(p):
            continue
        mount(p, p, None, MS_BIND | MS_REC)
        mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _unescape(path):
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, ch)
    return path


def readonly_host(writable, shm_mb):
    """Remount every mount read-only except ``writable`` (made a mount of its own first) and ``/proc``.

    ``/dev/shm`` becomes a private tmpfs of ``shm_mb`` MiB (POSIX semaphores keep working; nothing
    reaches the host's). Paths that were world-writable on the host (``/var/tmp`` ...) are read-only now.
    """
    mount(writable, writable, None, MS_BIND | MS_REC)
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in sorted(rows, key=lambda r: _unescape(r[4]).count("/")):
        target, opts = _unescape(row[4]), row[5].split(",")
        if inside(target, writable) or inside(target, "/proc"):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for o in opts:
            flags |= _KEEP_FLAGS.get(o, 0)
        try:
            mount(None, target, None, flags)
        except OSError as e:
            if e.errno == 2 or not os.path.isdir(target):  # gone under an overmount
                continue
            # cannot be made read-only (a locked mount): hide it under an empty read-only tmpfs instead
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=0755")
    if shm_mb and os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(shm_mb)}m,mode=1777")


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities():
    """Leave a user namespace's root with no capabilities, now or after exec."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            fail(f"cannot drop capability {cap} from the bounding set")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    prctl(PR_SET_SECUREBITS, SECUREBITS)
    header = CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        fail("capset failed: " + os.strerror(ctypes.get_errno()))


def kill_everything(code):
    """SIGKILL every process of this sandbox (by its ``CP_SANDBOX_ID`` marker and process group), then exit."""
    if os.getpid() == 1:
        os.kill(-1, signal.SIGKILL)
        os._exit(code)
    marker = ("CP_SANDBOX_ID=" + os.environ.get("CP_SANDBOX_ID", "")).encode()
    me = os.getpid()
    for _ in range(3):
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        os.kill(int(name), signal.SIGKILL)
            except OSError:
                continue
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(code)


def main():
    cfg = json.loads(sys.argv[1])
    try:
        if cfg.get("hidden"):
            hide_paths(cfg["hidden"], cfg.get("keep", []))
        if cfg.get("readonly"):
            bind_readonly(cfg["readonly"])
        if cfg.get("writable"):
            readonly_host(cfg["writable"], cfg.get("shm_mb", 0))
    except OSError as e:
        fail(f"cannot set up the filesystem view: {e}")
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    uid = cfg.get("uid")
    if uid is not None and os.getuid() == 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # real root -> unprivileged: every capability is gone
        if os.getuid() != uid or os.geteuid() != uid:
            fail(f"could not switch to uid {uid}")
    elif cfg.get("drop_caps"):
        drop_capabilities()
    for name, (soft, hard) in cfg.get("rlimits", {}).items():
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError) as e:
            fail(f"cannot set {name}={soft}: {e}")
    if os.getpid() == 1:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # init of the PID namespace: the kernel kills the rest
    else:
        # guard mode: no namespace takes the processes down with us, so on the parent's death we sweep
        # every process that carries this sandbox's marker (also those that left the process group)
        signal.signal(signal.SIGTERM, lambda signum, frame: kill_everything(125))
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if cfg.get("parent_pid") and os.getppid() not in (cfg["parent_pid"], 0):
        kill_everything(124)  # our parent is already gone
    argv = cfg["argv"]
    child = os.fork()
    if child == 0:
        try:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            os.chdir(cfg["cwd"])
            os.execv(argv[0], argv)
        except OSError as e:
            os.write(2, (f"sandbox launcher: cannot execute {argv[0]}: {e}\n").encode())
        os._exit(125)
    wall = float(cfg.get("wall_s") or 0)
    if wall > 0:
        # The wall-clock limit holds even when nobody outside is left to enforce it.
        def out_of_time(signum, frame):
            os.write(2, b"sandbox launcher: wall-clock limit reached; killing every sandboxed process\n")
            kill_everything(128 + signal.SIGKILL)

        signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, wall)
    # Stay as a minimal init: reap every child; exit with the target's status (128+N for signal N).
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(125)
        except InterruptedError:
            continue
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(128 - code if code < 0 else code)


main()
