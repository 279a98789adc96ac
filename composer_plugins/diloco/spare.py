"""A warm spare replica process: ``python -m composer_plugins.diloco.spare --target T``.

The local executor (:class:`~composer_plugins.diloco.executor.LocalProcessExecutor` with ``spares``) starts one
ahead of need. It imports what a replica of target ``T`` imports (torch, Lightning, the target, the plugin registry,
the transport's callback) and then blocks on its stdin for one assignment: a JSON line with the replica's
``argv`` (``python -m composer_plugins.diloco.run ...``), ``env``, ``cwd`` and ``log_path``. It takes that
environment and directory, sends its output to the replica's log, and runs the replica's entry point
(:func:`composer_plugins.diloco.run.main`) in this process. A relaunched replica so skips the interpreter start and
the imports (seconds of CPU) and is left with what it must do anyway: load the run's newest state and train.

A spare whose stdin closes without an assignment exits 0. It is started with the group's environment (its process
tag included), so the group's clean-up finds it like any replica.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Sequence

#: the entry point a spare can stand in for: ``python -m composer_plugins.diloco.run ...``
RUN_MODULE = "composer_plugins.diloco.run"


def runs_replica_entry(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is a replica command a spare can take over (this interpreter, ``-m`` :data:`RUN_MODULE`)."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] == RUN_MODULE


def spare_argv(template: Sequence[str]) -> list[str]:
    """The spare's command for replicas started with ``template`` (it preloads the same ``--target``)."""
    target = template[template.index("--target") + 1] if "--target" in template[:-1] else "toy"
    return [sys.executable, "-m", "composer_plugins.diloco.spare", "--target", target]


def preload(target: str, env: dict[str, str] | os._Environ[str]) -> None:
    """Import what a replica of ``target`` imports before its first step (best effort: a failure here is left to
    the replica itself, which imports again and reports it in its log)."""
    from composer_plugins.diloco import env as _env

    mods = ["torch", "lightning.pytorch", RUN_MODULE, "composer_plugins.diloco.replica"]
    mods.append("composer_plugins.diloco.objstore" if env.get(_env.ENV_STORE) else "composer_plugins.diloco.strategy")
    if target == "toy":
        mods.append("composer_plugins.diloco.toy")
    elif target == "train":
        mods.append("composer_plugins.training.run")
    elif ":" in target:
        mods.append(target.partition(":")[0])
    for m in mods:
        try:
            importlib.import_module(m)
        except Exception as e:  # the replica imports it again and fails with a located error
            print(f"[diloco-spare] preloading {m} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    try:
        from composer_plugins.core.plugins import get_registry

        get_registry()
    except Exception as e:
        print(f"[diloco-spare] loading the plugins failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def take_assignment(line: str) -> list[str]:
    """Become the replica ``line`` describes (environment, directory, log); its entry point's arguments."""
    job = json.loads(line)
    os.environ.clear()
    os.environ.update(job["env"])
    if job.get("cwd"):
        os.chdir(job["cwd"])
        if job["cwd"] not in sys.path:
            sys.path.insert(0, job["cwd"])
    if job.get("log_path"):
        fd = os.open(job["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    argv = list(job["argv"])
    sys.argv = [argv[0], *argv[3:]]
    return argv[3:]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    target = args[args.index("--target") + 1] if "--target" in args[:-1] else "toy"
    preload(target, os.environ)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    run_args = take_assignment(line)
    from composer_plugins.diloco.run import main as run_main

    return run_main(run_args)


if __name__ == "__main__":  # pragma: no cover
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the replica entry point: torchft's threads must not hold the exit
