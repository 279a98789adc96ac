"""Start a torchft lighthouse and N DiLoCo replica groups, and stop them cleanly (import-light: no torch):
:class:`ReplicaGroup` leaves no replica process behind on exit, Ctrl-C, SIGTERM or its own death
(docs/diloco.md, "Quick start").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_plugins import procs
from composer_plugins.diloco.coordination import Lighthouse, RejoinBoard, StartBarrier
from composer_plugins.diloco.env import (
    ENV_BARRIER,
    ENV_BARRIER_SIZE,
    ENV_INDEX,
    ENV_LIGHTHOUSE,
    ENV_NUM,
    ENV_REJOIN,
    ENV_REPLICA_ID,
    ENV_RESTART,
    ENV_RUN_ID,
    ENV_SEED,
    ENV_STOP_FILE,
    ENV_STORE,
    ENV_SYNC_LOG,
    LOOPBACK,
    REPLICA_VARS,
)
from composer_plugins.diloco.executor import (
    LaunchError,
    LocalProcessExecutor,
    LocalProcessHandle,
    ReplicaExecutor,
    ReplicaHandle,
    ReplicaSpec,
)

#: names of :mod:`.executor`, :mod:`.coordination` and :mod:`.env` are re-exported here for older imports
__all__ = [
    "ENV_BARRIER",
    "ENV_BARRIER_SIZE",
    "ENV_INDEX",
    "ENV_LIGHTHOUSE",
    "ENV_NUM",
    "ENV_REJOIN",
    "ENV_REPLICA_ID",
    "ENV_RESTART",
    "ENV_RUN_ID",
    "ENV_SEED",
    "ENV_STOP_FILE",
    "ENV_STORE",
    "ENV_SYNC_LOG",
    "LOOPBACK",
    "REPLICA_VARS",
    "LaunchError",
    "LaunchResult",
    "Lighthouse",
    "LocalProcessExecutor",
    "LocalProcessHandle",
    "RejoinBoard",
    "ReplicaExecutor",
    "ReplicaGroup",
    "ReplicaHandle",
    "ReplicaSpec",
    "StartBarrier",
    "launch",
    "replica_argv",
    "summary_table",
]


# -- the replica group -----------------------------------------------------------------


@dataclasses.dataclass
class ReplicaState:
    """Book-keeping for one replica slot."""

    index: int
    handle: ReplicaHandle | None = None
    restarts: int = 0
    exit_codes: list[int] = dataclasses.field(default_factory=list)
    done: bool = False


@dataclasses.dataclass
class LaunchResult:
    """What :meth:`ReplicaGroup.wait` returns."""

    exit_codes: dict[int, list[int]]
    restarts: dict[int, int]

    @property
    def ok(self) -> bool:
        """True when every replica's last run exited 0."""
        return all(codes and codes[-1] == 0 for codes in self.exit_codes.values())


ArgvFactory = Callable[[int], Sequence[str]] | Sequence[str]


class ReplicaGroup:
    """N replica groups plus (optionally) a local lighthouse; a context manager that always cleans up.

    The CLI options these mirror are in docs/diloco.md ("Quick start", "On a cluster").

    Args:
        argv: the command each replica runs (a list), or ``index -> list`` for per-replica commands.
        lighthouse: an existing lighthouse address (cluster mode) or ``None`` to start one here.
        executor: where replicas run (default :class:`LocalProcessExecutor`).
        max_restarts: how many times a replica that exits non-zero is started again (``0``: it stays dead).
        log_dir: one ``replica<i>.log`` per replica (stdout+stderr), plus the ``STOP`` file path.
        base_seed: replica ``i`` gets ``COMPOSER_DILOCO_SEED=base_seed + i`` (default: the target's ``seed + i``).
        barrier: meet at a start barrier (default: only when the lighthouse is local).
        grace_s: seconds between SIGTERM and SIGKILL on shutdown.
        threads_per_replica: sets ``OMP_NUM_THREADS`` (default ``cpu_count // N``, at least 1) unless set.
        index_offset, total_replicas: on a cluster, the replicas started here are
            ``index_offset .. index_offset + N - 1`` of ``total_replicas`` (their ids, seeds and data shards).
    """

    def __init__(
        self,
        argv: ArgvFactory,
        num_replicas: int,
        *,
        lighthouse: str | None = None,
        executor: ReplicaExecutor | None = None,
        max_restarts: int = 0,
        log_dir: str | os.PathLike[str] | None = None,
        base_seed: int | None = None,
        barrier: bool | None = None,
        env: Mapping[str, str] | None = None,
        grace_s: float = 10.0,
        heartbeat_timeout_ms: int = 5_000,
        join_timeout_ms: int = 60_000,
        threads_per_replica: int | None = None,
        cwd: str | None = None,
        index_offset: int = 0,
        total_replicas: int | None = None,
        transport: str = "torchft",
        store: str | None = None,
        run_id: str | None = None,
        warm_restarts: bool = False,
    ) -> None:
        if num_replicas < 1:
            raise LaunchError(f"--replicas must be at least 1, got {num_replicas}")
        self.argv = argv
        self.num_replicas = num_replicas
        if warm_restarts and executor is not None:
            raise LaunchError("warm restarts are the local executor's: give warm_restarts or an executor")
        self.executor: ReplicaExecutor = executor or LocalProcessExecutor(warm_restarts=warm_restarts)
        self.max_restarts = max_restarts
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.base_seed = base_seed
        self.extra_env = dict(env or {})
        self.grace_s = grace_s
        self.cwd = cwd
        self._lighthouse_arg = lighthouse
        self._lh_opts = {"heartbeat_timeout_ms": heartbeat_timeout_ms, "join_timeout_ms": join_timeout_ms}
        self._use_barrier = barrier
        self.threads = threads_per_replica or max(1, (os.cpu_count() or 1) // num_replicas)
        self.lighthouse: Lighthouse | None = None
        self.barrier: StartBarrier | None = None
        self.index_offset = index_offset
        self.total_replicas = total_replicas or index_offset + num_replicas
        if index_offset < 0 or self.total_replicas < index_offset + num_replicas:
            raise LaunchError(
                f"replicas {index_offset}..{index_offset + num_replicas - 1} do not fit in total_replicas="
                f"{self.total_replicas}"
            )
        self.replicas = [ReplicaState(i) for i in range(num_replicas)]
        self._started = False
        #: ``object_store``: no lighthouse and no barrier; the replicas meet through ``store`` only
        self.transport = transport
        self.store = store
        self.run_id = run_id or f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"
        from composer_plugins.diloco.transports import get_transport

        self._needs = get_transport(transport, LaunchError).needs
        if self._needs == "store" and not store:
            raise LaunchError(f"diloco.transport={transport} needs diloco.store (s3://bucket/prefix or file:///path)")
        #: every replica (and whatever it starts) carries this tag, so :meth:`stop` finds stragglers too
        self.tag = procs.new_tag("diloco")

    # -- paths -------------------------------------------------------------------------
    @property
    def stop_file(self) -> Path | None:
        """Touch this file to ask every replica to stop after its next committed sync."""
        return self.log_dir / "STOP" if self.log_dir is not None else None

    def global_index(self, index: int) -> int:
        """The job-wide replica index of local slot ``index``."""
        return self.index_offset + index

    def log_path(self, index: int, suffix: str = ".log") -> Path | None:
        """Replica ``index``'s log (``suffix=".sync.jsonl"``: its sync log) in ``log_dir``."""
        return self.log_dir / f"replica{self.global_index(index)}{suffix}" if self.log_dir is not None else None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> ReplicaGroup:
        """Start the lighthouse (unless external), the barrier, and every replica."""
        if self._started:
            return self
        self._started = True
        try:
            if self._needs == "lighthouse":
                self.lighthouse = Lighthouse(self._lighthouse_arg, **self._lh_opts)  # type: ignore[arg-type]
            local = self.lighthouse is not None and self.lighthouse.local
            use_barrier = self._use_barrier if self._use_barrier is not None else local
            if use_barrier and self.num_replicas > 1:
                self.barrier = StartBarrier(self.num_replicas, first=self.index_offset)
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                if self.stop_file is not None and self.stop_file.exists():
                    self.stop_file.unlink()
            for r in self.replicas:
                self._spawn(r)
        except BaseException:
            self.stop()
            raise
        return self

    def spec(self, index: int, restart: int = 0) -> ReplicaSpec:
        """The spec for replica ``index`` (its command and environment)."""
        assert self._started, "start() first"
        gi = self.global_index(index)
        argv = list(self.argv(gi) if callable(self.argv) else self.argv)
        own = {
            ENV_INDEX: str(gi),
            ENV_NUM: str(self.total_replicas),
            ENV_REPLICA_ID: f"replica{gi}",
            ENV_RESTART: str(restart),
            ENV_RUN_ID: self.run_id,
            "PYTHONUNBUFFERED": "1",
        }
        if self.lighthouse is not None:
            own[ENV_LIGHTHOUSE] = self.lighthouse.address
        if self.store is not None:
            own[ENV_STORE] = self.store
        if self.base_seed is not None:
            own[ENV_SEED] = str(self.base_seed + gi)
        env = {k: v for k, v in os.environ.items() if k not in REPLICA_VARS}
        env.update(own)
        env.setdefault("RUST_LOG", "warn")
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        if self.lighthouse is not None and self.lighthouse.local:
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if self.barrier is not None and restart == 0:
            env[ENV_BARRIER] = self.barrier.address
            env[ENV_BARRIER_SIZE] = str(self.barrier.size)
        if self.barrier is not None:
            env[ENV_REJOIN] = self.barrier.address
        if self.log_dir is not None:
            env[ENV_STOP_FILE] = str(self.stop_file)
            env[ENV_SYNC_LOG] = str(self.log_path(index, ".sync.jsonl"))
        env.update(self.extra_env)
        own.update(self.extra_env)
        env = procs.tag_env(self.tag, env)
        return ReplicaSpec(index, argv, env, cwd=self.cwd, log_path=self.log_path(index), restart=restart, job_env=own)

    def _spawn(self, r: ReplicaState) -> None:
        if r.restarts:
            # before it starts, so a survivor about to finish already knows to wait for it
            self._post(r, "pending")
        r.handle = self.executor.start(self.spec(r.index, restart=r.restarts))
        r.done = False

    def _post(self, r: ReplicaState, state: str, detail: object = "") -> None:
        board = self.barrier.board if self.barrier is not None else None
        if board is not None:
            with contextlib.suppress(Exception):
                board.post(self.global_index(r.index), state, r.restarts, detail)

    def _peers_finished(self, r: ReplicaState) -> bool:
        """True when every other replica has already exited 0 (nobody left to heal from)."""
        others = [o for o in self.replicas if o is not r]
        return bool(others) and all(o.done and o.exit_codes and o.exit_codes[-1] == 0 for o in others)

    def restart(self, index: int) -> ReplicaHandle:
        """Start replica ``index`` again (after it died); it rejoins without the start barrier."""
        r = self.replicas[index]
        if r.handle is not None:
            rc = r.handle.poll()
            if rc is None:
                raise LaunchError(f"replica {index} is still running (pid {r.handle.pid}); kill it first")
            if not r.done:
                r.exit_codes.append(rc)
        r.restarts += 1
        self._spawn(r)
        assert r.handle is not None
        return r.handle

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to replica ``index``'s process group (fault injection)."""
        h = self.replicas[index].handle
        if h is not None:
            if sig == signal.SIGKILL:
                h.kill()
            else:
                h.terminate()

    def poll(self) -> dict[int, int | None]:
        """Exit code (or ``None`` while running) of each replica's current run."""
        return {r.index: r.handle.poll() if r.handle is not None else None for r in self.replicas}

    def wait(self, timeout: float | None = None, poll_s: float = 0.2, *, fail_fast: bool = False) -> LaunchResult:
        """Supervise until every replica has exited for good; restart crashed ones up to ``max_restarts``.

        :class:`LaunchError` (naming the replica, with the end of its log) when ``fail_fast`` and a replica exits
        non-zero with no restarts left, or when ``timeout`` seconds pass (naming the replicas still running).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with procs.waiting_for(f"DiLoCo replicas {', '.join(self._describe(r) for r in self.replicas)}"):
            while True:
                for r in self.replicas:
                    if r.done or r.handle is None:
                        continue
                    rc = r.handle.poll()
                    if rc is None:
                        continue
                    r.exit_codes.append(rc)
                    if self.barrier is not None and r.restarts == 0:
                        self.barrier.mark_gone(self.global_index(r.index), procs.exit_description(rc))
                    if r.restarts:
                        self._post(r, "gone", procs.exit_description(rc))
                    if rc != 0 and r.restarts < self.max_restarts and self._peers_finished(r):
                        _log(
                            f"replica {r.index} exited with {rc} after every other replica finished; "
                            "not restarted (no live peer to rejoin)"
                        )
                    elif rc != 0 and r.restarts < self.max_restarts and not self._stop_requested():
                        _log(f"replica {r.index} exited with {rc}; restarting ({r.restarts + 1}/{self.max_restarts})")
                        r.restarts += 1
                        self._spawn(r)
                        continue
                    r.done = True
                    _log(f"replica {r.index} exited with {rc}")
                    if rc != 0 and fail_fast:
                        raise LaunchError(
                            f"replica {self.global_index(r.index)} {procs.exit_description(rc)}"
                            f"{f' after {r.restarts} restart(s)' if r.restarts else ''}; stopping the others."
                            + self._log_tail(r.index)
                        )
                if all(r.done for r in self.replicas):
                    break
                if deadline is not None and time.monotonic() > deadline:
                    running = [r for r in self.replicas if not r.done]
                    raise LaunchError(
                        f"replicas {', '.join(self._describe(r) for r in running)} still running after "
                        f"{timeout:.0f}s" + "".join(self._log_tail(r.index, 15) for r in running)
                    )
                time.sleep(poll_s)
        return self.result()

    def _describe(self, r: ReplicaState) -> str:
        return f"{self.global_index(r.index)} (pid {r.handle.pid if r.handle is not None else None})"

    def _log_tail(self, index: int, lines: int = 30) -> str:
        path = self.log_path(index)
        if path is None:
            return ""
        text = procs.tail(path, lines)
        return f"\n--- last lines of {path} ---\n{text if text else '(empty)'}"

    def result(self) -> LaunchResult:
        return LaunchResult(
            exit_codes={r.index: list(r.exit_codes) for r in self.replicas},
            restarts={r.index: r.restarts for r in self.replicas},
        )

    def _stop_requested(self) -> bool:
        return self.stop_file is not None and self.stop_file.exists()

    def request_stop(self, at_outer_step: int | None = None) -> None:
        """Ask replicas to stop after their next committed sync (or once the outer step reaches ``at_outer_step``)."""
        if self.stop_file is None:
            raise LaunchError("request_stop needs a log_dir (the STOP file lives there)")
        tmp = self.stop_file.with_suffix(".tmp")
        tmp.write_text("" if at_outer_step is None else str(at_outer_step))
        tmp.replace(self.stop_file)

    def stop(self) -> None:
        """Terminate every replica (SIGTERM, then SIGKILL after ``grace_s``), the barrier and the lighthouse."""
        running = [r.handle for r in self.replicas if r.handle is not None and r.handle.poll() is None]
        for h in running:
            h.terminate()
        deadline = time.monotonic() + self.grace_s
        for h in running:
            if h.wait(max(0.0, deadline - time.monotonic())) is None:
                h.kill()
                h.wait(5.0)
        # A replica that already exited may have left children in its group, or in sessions of their own
        # (they still carry this group's tag); kill those too.
        for r in self.replicas:
            if r.handle is not None:
                r.handle.kill()
        close = getattr(self.executor, "close", None)
        if callable(close):  # the local executor's fork server (after the replicas: its children die with it)
            close()
        procs.kill_tree(tag=self.tag)
        if self.barrier is not None:
            self.barrier.close()
            self.barrier = None
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None

    def __enter__(self) -> ReplicaGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def summary_table(log_dir: str | os.PathLike[str], indices: Sequence[int]) -> str:
    """The launcher's closing table (docs/diloco.md, "Quick start"), from each replica's ``replica<i>.result.json``
    (:func:`~composer_plugins.diloco.run.write_replica_summary`), else from its sync log."""
    from composer_plugins.diloco.run import summary_path

    rows, hashes = [], set()
    for i in indices:
        sync = Path(log_dir, f"replica{i}.sync.jsonl")
        res = summary_path(sync)
        got: dict[str, Any] = {}
        if res is not None and res.exists():
            with contextlib.suppress(ValueError, OSError):
                got = json.loads(res.read_text())
        if not got and sync.exists():
            lines = [ln for ln in sync.read_text().splitlines() if ln.strip()]
            with contextlib.suppress(ValueError, IndexError):
                last = json.loads(lines[-1])
                got = {"rounds": last.get("outer_step"), "param_hash": last.get("param_hash")}
        rounds, loss, h = got.get("rounds"), got.get("loss"), got.get("param_hash")
        hashes |= {h} if h else set()
        cells = ["-" if rounds is None else str(rounds), "-" if loss is None else f"{loss:.4f}", h[:12] if h else "-"]
        rows.append([str(i), *cells, got.get("model_path") or "-"])
    names = {
        json.loads(p.read_text()).get("loss_name")
        for p in Path(log_dir).glob("replica*.result.json")
        if p.stat().st_size
    }
    names.discard(None)
    loss_head = f"final loss ({names.pop()})" if len(names) == 1 else "final loss"
    head = ["replica", "rounds", loss_head, "param hash", "model path"]
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [head, *rows]]
    if len(hashes) == 1 and all(r[3] != "-" for r in rows):
        lines.append(f"every replica ended on parameter hash {next(iter(hashes))[:12]}")
    elif len(hashes) > 1:
        lines.append(f"the replicas ended on {len(hashes)} different parameter hashes")
    return "\n".join(lines)


def _log(msg: str) -> None:
    print(f"[diloco-launch] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM (and SIGINT, even where a shell started us with it ignored) into KeyboardInterrupt,
    so ``kill <launcher>`` and Ctrl-C both clean up the replicas."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def replica_argv(
    target: str, config: str | None, overrides: Sequence[str] = (), section: str | None = None
) -> list[str]:
    """The command a local replica runs: ``python -m composer_plugins.diloco.run --target T --config C ...``."""
    argv = [sys.executable, "-m", "composer_plugins.diloco.run", "--target", target]
    if config:
        argv += ["--config", str(config)]
    if section:
        argv += ["--section", section]
    return argv + list(overrides)


def launch(
    num_replicas: int,
    *,
    target: str = "train",
    config: str | None = None,
    overrides: Sequence[str] = (),
    section: str | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> LaunchResult:
    """Run ``num_replicas`` replicas of ``target`` to completion (blocking); children are always cleaned up.

    ``timeout``: as :meth:`ReplicaGroup.wait`; ``kwargs`` go to :class:`ReplicaGroup`.
    """
    group = ReplicaGroup(replica_argv(target, config, overrides, section), num_replicas, **kwargs)
    with _sigterm_as_interrupt(), group:
        if group.store is not None:
            from composer_plugins.diloco.urls import redact_url

            _log(
                f"run {group.run_id} on {redact_url(group.store)}; {num_replicas} replicas (continue it with "
                f"--run-id {group.run_id})"
            )
        else:
            _log(f"lighthouse {group.lighthouse.address if group.lighthouse else '?'}; {num_replicas} replicas")
        return group.wait(timeout)
