"""Conformance of DiLoCo replica executors (the ``register_executors`` hook), for their authors' tests.

:func:`check_executor` builds the registered entry as :func:`~composer_plugins.diloco.executors.make_executor`
does and checks its side of the contract, running three real replicas through it unless ``run=False``; what
is checked and how to pass a stand-in service (``build_kwargs``, e.g. ``api=`` with
:class:`~composer_plugins.testing.hf_jobs_hub.FakeJobsHub`): docs/plugins.md (``register_executors``).
Failures raise :class:`~composer_plugins.testing.base.ConformanceError` naming the entry and its provider.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from composer_plugins.testing.base import _entry, _fail

__all__ = ["check_executor"]


def check_executor(
    name: str,
    registry: Any = None,
    *,
    config: Any = None,
    run: bool = True,
    timeout_s: float = 120.0,
    **build_kwargs: Any,
) -> Any:
    """Executor conformance (see the module docstring) of the entry ``name`` of ``registry`` (default: the
    process-wide one), built from ``config`` (a ``DiLoCoConfig``; default: the default one); returns it."""
    from composer_plugins.core.errors import ComposerPluginsError
    from composer_plugins.diloco.common import DiLoCoConfig
    from composer_plugins.diloco.executor import ReplicaExecutor

    entry = _entry("executors", name, registry)
    dcfg = config if config is not None else DiLoCoConfig()
    with tempfile.TemporaryDirectory(prefix="cp-executor-") as tmp:
        log_dir = Path(tmp)

        def build(warm: bool) -> Any:
            return entry.build(dcfg, log_dir=log_dir, warm_restarts=warm, name=entry.name, **build_kwargs)

        try:
            ex = build(False)
        except Exception as e:
            raise _fail(entry, f"does not build with name={entry.name!r}: {type(e).__name__}: {e}") from e
        if not isinstance(ex, ReplicaExecutor):
            raise _fail(entry, f"built a {type(ex).__name__}, not a ReplicaExecutor (no start(spec) -> handle)")
        try:
            warm = build(True)
        except ComposerPluginsError:
            pass  # refused, with the reason: its replicas are not forked here
        except Exception as e:
            raise _fail(entry, f"--warm-restarts fails with {type(e).__name__}: {e}, not a refusal") from e
        else:
            if getattr(warm, "warm_restarts", False) is not True:
                raise _fail(entry, "accepts --warm-restarts and drops it (refuse it, or set warm_restarts=True)")
            _close(warm)
        if run:
            try:
                _run_replicas(entry, ex, log_dir, timeout_s)
            finally:
                _close(ex)
        return ex


def _close(ex: Any) -> None:
    close = getattr(ex, "close", None)
    if callable(close):
        close()


def _run_replicas(entry: Any, ex: Any, log_dir: Path, timeout_s: float) -> None:
    from composer_plugins.diloco.executor import ReplicaHandle, ReplicaSpec

    def spec(index: int, code: str) -> ReplicaSpec:
        return ReplicaSpec(
            index,
            [sys.executable, "-c", code],
            dict(os.environ),
            log_path=log_dir / f"replica{index}.log",
            job_env={"COMPOSER_CONFORMANCE_REPLICA": str(index)},
        )

    failed = spec(0, "import sys; print('conformance replica failed', flush=True); sys.exit(3)")
    h = ex.start(failed)
    if not isinstance(h, ReplicaHandle):
        raise _fail(entry, f"start() gave a {type(h).__name__}, not a ReplicaHandle (poll/terminate/kill/wait)")
    if h.spec is not failed:
        raise _fail(entry, "the handle's spec is not the spec it was started from")
    rc = h.wait(timeout_s)
    if rc in (None, 0) or h.poll() in (None, 0):
        raise _fail(entry, f"a replica that exits 3 gives wait() -> {rc!r}, poll() -> {h.poll()!r}: want non-zero")
    log = failed.log_path.read_text() if failed.log_path is not None and failed.log_path.exists() else ""
    if "conformance replica failed" not in log:
        raise _fail(entry, f"the replica's output is not in its log file {failed.log_path}")
    rc = ex.start(spec(1, "print('ok')")).wait(timeout_s)
    if rc != 0:
        raise _fail(entry, f"a replica that exits 0 gives wait() -> {rc!r}, not 0")
    long = spec(2, "import time; time.sleep(600)")
    h = ex.start(long)
    h.terminate()
    rc = h.wait(timeout_s)
    if rc is None or rc == 0:
        raise _fail(entry, f"terminate() does not stop a running replica (wait() -> {rc!r} after it)")
    try:
        h.kill()  # after its end: nothing left to stop, and no error
    except Exception as e:
        raise _fail(entry, f"kill() after the replica ended raises {type(e).__name__}: {e}") from e
