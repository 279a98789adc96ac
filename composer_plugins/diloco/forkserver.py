"""A warm start for relaunched replicas: a fork server, ``python -m composer_plugins.diloco.forkserver --target T``.

The local executor starts it beside the first replica (``warm_restarts``; docs/diloco.md, "Goodput under
failures"). It imports what a replica of target ``T`` imports once, then serves assignments on its stdin, one JSON
line each (the replica's ``argv``, ``env``, ``cwd`` and ``log_path``): it forks a child that becomes that replica
and runs :func:`composer_plugins.diloco.run.main`, answering ``started <pid>`` and later ``exit <pid> <code>`` (as
``Popen.returncode`` gives it); it exits 0 when its stdin closes.

The server is single-threaded: it forks with no other thread alive, so nothing is held by a thread the child
lacks. It carries the group's environment (its process tag included), so the group's clean-up finds it.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import sys
import traceback
from collections.abc import Sequence

#: the entry point a forked replica runs: ``python -m composer_plugins.diloco.run ...``
RUN_MODULE = "composer_plugins.diloco.run"


def runs_replica_entry(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a replica command the server can fork (this interpreter, ``-m`` :data:`RUN_MODULE`)."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] == RUN_MODULE


def _target(argv: Sequence[str]) -> str:
    return argv[argv.index("--target") + 1] if "--target" in argv[:-1] else "toy"


def server_argv(template: Sequence[str]) -> list[str]:
    """The server's command for replicas started with ``template`` (it preloads the same ``--target``)."""
    return [sys.executable, "-m", "composer_plugins.diloco.forkserver", "--target", _target(template)]


def preload(target: str, store: bool) -> None:
    """Import what a replica of ``target`` imports before its first step (best effort: a failure here is left to
    the replica itself, which imports again and reports it in its log)."""
    mods = ["torch", "lightning.pytorch", RUN_MODULE, "composer_plugins.diloco.replica"]
    mods.append("composer_plugins.diloco.objstore" if store else "composer_plugins.diloco.strategy")
    if target == "toy":
        mods.append("composer_plugins.diloco.toy")
    elif target == "train":
        mods.append("composer_plugins.training.runs.run")
    elif ":" in target:
        mods.append(target.partition(":")[0])
    for m in mods:
        try:
            importlib.import_module(m)
        except Exception as e:  # the replica imports it again and fails with a located error
            print(f"[diloco-forkserver] preloading {m} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    try:
        from composer_plugins.core.plugins import get_registry

        get_registry()
    except Exception as e:
        print(f"[diloco-forkserver] loading the plugins failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def become(job: dict[str, object]) -> int:
    """In the forked child: become the replica ``job`` describes, run it, and return its exit code."""
    from composer_plugins import procs

    os.setsid()
    procs.set_pdeathsig()
    os.environ.clear()
    os.environ.update(job["env"])  # type: ignore[arg-type]
    cwd = job.get("cwd")
    if isinstance(cwd, str) and cwd:
        os.chdir(cwd)
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = job.get("log_path")
    if isinstance(log, str):
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    else:
        out = os.open(os.devnull, os.O_WRONLY)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    argv = [str(a) for a in job["argv"]]  # type: ignore[attr-defined]
    sys.argv = [argv[0], *argv[3:]]
    from composer_plugins.diloco.run import main as run_main

    return run_main(argv[3:])


def serve(target: str) -> int:
    """Preload, then fork one replica per assignment line until stdin closes (see the module docstring)."""
    from composer_plugins.diloco import env as _env

    preload(target, bool(os.environ.get(_env.ENV_STORE)))
    children: set[int] = set()
    buf = b""
    stdin = sys.stdin.fileno()

    def say(msg: str) -> None:
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()

    def reap() -> None:
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                children.discard(pid)
                continue
            if done:
                children.discard(pid)
                say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")

    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        reap()
        if not ready:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            return 0
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if not line.strip():
                continue
            job = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = become(job)
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)  # as the replica entry point: torchft's threads must not hold the exit
            children.add(pid)
            say(f"started {pid}")


def main(argv: Sequence[str] | None = None) -> int:
    return serve(_target(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":  # pragma: no cover
    code = main()
    sys.stdout.flush()
    os._exit(code)
