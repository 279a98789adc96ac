"""The persistent replay cache and spend ledger (one sqlite file, WAL mode).

``responses``: one row per answered call; ``ledger``: per run, a ``paid`` row per answer (in its response's
transaction), a ``maybe`` row per call sent without one, a ``lease`` row per process. One writer thread
group-commits. See docs/replay.md, "Cache and ledger".
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.teachers.base import json_bytes

#: Bump when the key recipe changes (old entries then simply stop matching).
KEY_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    teacher TEXT NOT NULL,
    model TEXT NOT NULL,
    response TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger (
    attempt TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    key TEXT NOT NULL,
    teacher TEXT NOT NULL,
    status TEXT NOT NULL,
    amount REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_run ON ledger (run_id, status);
"""
#: The statements the writer thread runs (each method below returns them with their values).
_PUT = "INSERT OR REPLACE INTO responses (key, teacher, model, response, created) VALUES (?, ?, ?, ?, ?)"
_SET_LEDGER = (
    "INSERT OR REPLACE INTO ledger (attempt, run_id, key, teacher, status, amount, updated) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_RAISE_LEASE = (
    "INSERT INTO ledger (attempt, run_id, key, teacher, status, amount, updated) VALUES (?, ?, '', '*', 'lease', ?, ?) "
    "ON CONFLICT(attempt) DO UPDATE SET amount = amount + excluded.amount, updated = excluded.updated"
)
_LOWER_LEASE = "UPDATE ledger SET amount = MAX(0.0, amount - ?), updated = ? WHERE attempt = ?"


class CacheError(ComposerPluginsError):
    """The cache file cannot be opened or is locked by another run."""


def cache_key(teacher: str, kind: str, model: str, params: Mapping[str, Any], messages: Sequence[Any]) -> str:
    """The cache key of one teacher call: sha256 over a canonical JSON of everything that shapes the answer."""
    blob = json.dumps(
        {"v": KEY_VERSION, "teacher": teacher, "kind": kind, "model": model, "params": params, "messages": messages},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        default=str,
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@dataclass
class RunTotals:
    """What a run has spent according to the ledger."""

    paid_usd: float = 0.0
    uncertain_usd: float = 0.0
    paid_calls: int = 0
    uncertain_calls: int = 0

    @property
    def total_usd(self) -> float:
        return self.paid_usd + self.uncertain_usd


#: A queued write: statements, and either a concurrent future or ``(loop, asyncio future)``.
_Op = tuple[list[tuple[str, tuple[Any, ...]]], Any]


def _resolve(items: list[Any], err: BaseException | None) -> None:
    """Settle the futures (concurrent or asyncio) of one batch: done, or failed with ``err``."""
    for fut in items:
        if not fut.done():
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)


class ReplayCache:
    """Responses and the spend ledger in one sqlite file (created with its directory).

    ``synchronous="NORMAL"`` survives a killed process but not an OS crash (faster on slow disks than ``FULL``).
    """

    def __init__(self, path: str | os.PathLike[str], synchronous: Literal["FULL", "NORMAL"] = "FULL") -> None:
        self.path = Path(path)
        self.synchronous = synchronous.upper()
        if self.synchronous not in ("FULL", "NORMAL"):
            raise CacheError(f"cache synchronous must be FULL or NORMAL, got {synchronous!r}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            from composer_plugins.core.io import path_problem

            raise CacheError(
                f"cannot create the replay cache {self.path}: "
                f"{path_problem(self.path) or f'{type(e).__name__}: {e.strerror or e}'}"
            ) from None
        try:
            self._read = self._connect()
            self._read.executescript(_SCHEMA)
            self._read.commit()
        except sqlite3.Error as e:
            raise CacheError(f"{self.path}: cannot open the replay cache: {e}") from e
        self._q: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        con = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute(f"PRAGMA synchronous={self.synchronous}")
        con.execute("PRAGMA busy_timeout=30000")
        return con

    # -- reads -----------------------------------------------------------------------------
    def get(self, key: str) -> dict[str, Any] | None:
        """The stored response dict for ``key``, or ``None``."""
        row = self._read.execute("SELECT response FROM responses WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else None

    def get_many(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Stored responses for those of ``keys`` that are present."""
        out: dict[str, dict[str, Any]] = {}
        ks = list(dict.fromkeys(keys))
        for i in range(0, len(ks), 500):
            chunk = ks[i : i + 500]
            marks = ",".join("?" * len(chunk))
            for k, r in self._read.execute(f"SELECT key, response FROM responses WHERE key IN ({marks})", chunk):
                out[k] = json.loads(r)
        return out

    def __contains__(self, key: str) -> bool:
        return self._read.execute("SELECT 1 FROM responses WHERE key = ?", (key,)).fetchone() is not None

    def __len__(self) -> int:
        return int(self._read.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def run_totals(self, run_id: str) -> RunTotals:
        """Ledger totals of ``run_id`` (``pending`` rows count as uncertain)."""
        t = RunTotals()
        for status, n, s in self._read.execute(
            "SELECT status, COUNT(*), COALESCE(SUM(amount), 0) FROM ledger WHERE run_id = ? GROUP BY status", (run_id,)
        ):
            if status == "paid":
                t.paid_usd, t.paid_calls = float(s), int(n)
            else:
                t.uncertain_usd += float(s)
                t.uncertain_calls += int(n)
        return t

    # -- writes (group commit on the writer thread) -------------------------------------------
    def _ensure_writer(self) -> None:
        if self._writer is not None and self._writer.is_alive():
            return
        with self._writer_lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name="replay-cache-writer", daemon=True)
                self._writer.start()

    def _write_loop(self) -> None:
        con = self._connect()
        stop = False
        while not stop:
            first = self._q.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < 1024:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            try:
                con.execute("BEGIN IMMEDIATE")
                for stmts, _ in batch:
                    for sql, params in stmts:
                        con.execute(sql, params)
                con.execute("COMMIT")
                err: BaseException | None = None
            except BaseException as e:  # report to every waiter; keep serving later batches
                with contextlib.suppress(sqlite3.Error):
                    con.execute("ROLLBACK")
                err = CacheError(f"{self.path}: cache write failed: {type(e).__name__}: {e}")
            by_loop: dict[Any, list[asyncio.Future]] = {}
            for _, fut in batch:
                if isinstance(fut, tuple):  # (loop, asyncio future): resolved on its loop, once per batch
                    by_loop.setdefault(fut[0], []).append(fut[1])
            _resolve([fut for _, fut in batch if not isinstance(fut, tuple)], err)
            for loop, items in by_loop.items():
                with contextlib.suppress(RuntimeError):  # loop already closed
                    loop.call_soon_threadsafe(_resolve, items, err)
        con.close()

    def submit(self, stmts: list[tuple[str, tuple[Any, ...]]]) -> cf.Future:
        """Queue statements to run in one transaction; the future resolves once committed."""
        self._ensure_writer()
        fut: cf.Future = cf.Future()
        self._q.put((stmts, fut))
        return fut

    @staticmethod
    def put_stmts(key: str, teacher: str, model: str, response: Mapping[str, Any]) -> list[tuple[str, tuple[Any, ...]]]:
        """Statements that store one response."""
        return [(_PUT, (key, teacher, model, json_bytes(response).decode("utf-8"), time.time()))]

    @staticmethod
    def ledger_stmts(
        attempt: str, run_id: str, key: str, teacher: str, status: str, amount: float
    ) -> list[tuple[str, tuple[Any, ...]]]:
        """Statements that set a ledger row (``status='released'`` deletes it)."""
        if status == "released":
            return [("DELETE FROM ledger WHERE attempt = ?", (attempt,))]
        return [(_SET_LEDGER, (attempt, run_id, key, teacher, status, float(amount), time.time()))]

    @staticmethod
    def lease_add_stmts(lease: str, run_id: str, delta: float) -> list[tuple[str, tuple[Any, ...]]]:
        """Statements that add ``delta`` (negative: lower) to the lease row ``lease`` (created at 0).

        Relative updates commute, so a raise and a lowering queued in either order end at the same total.
        """
        if delta >= 0:
            return [(_RAISE_LEASE, (lease, run_id, float(delta), time.time()))]
        return [(_LOWER_LEASE, (float(-delta), time.time(), lease))]

    def put(self, key: str, teacher: str, model: str, response: Mapping[str, Any]) -> None:
        """Store a response and wait until it is committed."""
        self.submit(self.put_stmts(key, teacher, model, response)).result()

    async def acommit(self, stmts: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Await the commit of ``stmts`` (many waiters are woken with one loop callback per batch)."""
        self._ensure_writer()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((stmts, (loop, fut)))
        await fut

    def mark_orphans(self, run_id: str) -> int:
        """Turn ``pending``/``lease`` rows of ``run_id`` (left by a dead process) into ``maybe``; returns how many.

        A dead process's lease covers exactly its calls sent and never recorded (and its spare), so nothing
        is counted twice. Empty (0) leases are dropped.
        """
        self._read.execute("DELETE FROM ledger WHERE run_id = ? AND status = 'lease' AND amount <= 0", (run_id,))
        cur = self._read.execute(
            "UPDATE ledger SET status = 'maybe', updated = ? WHERE run_id = ? AND status IN ('pending', 'lease')",
            (time.time(), run_id),
        )
        return cur.rowcount

    def reset_run(self, run_id: str) -> None:
        """Forget the ledger of ``run_id`` (its cached responses stay)."""
        self._read.execute("DELETE FROM ledger WHERE run_id = ?", (run_id,))

    # -- run lock ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def run_lock(self, run_id: str) -> Iterator[None]:
        """Hold an exclusive lock for ``run_id`` (two live processes must not share a ledger)."""
        import fcntl

        digest = hashlib.sha256(run_id.encode()).hexdigest()[:12]
        lock_path = self.path.with_name(f"{self.path.name}.{digest}.lock")
        with open(lock_path, "w") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise CacheError(
                    f"another replay process is running with run_id {run_id!r} on {self.path}. "
                    "HINT: wait for it, or give this run a different run_id"
                ) from None
            yield

    def close(self) -> None:
        """Flush pending writes and close."""
        if self._writer is not None and self._writer.is_alive():
            self._q.put(None)
            self._writer.join()
        self._writer = None
        with contextlib.suppress(sqlite3.Error):
            self._read.close()

    def __enter__(self) -> ReplayCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReplayCache({str(self.path)!r})"
