"""Where the replicas of a torchft run meet: the :class:`Lighthouse`, the :class:`StartBarrier` and the
:class:`RejoinBoard`. torch and torchft are imported when one is built, never at import time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from composer_plugins.diloco.env import LOOPBACK
from composer_plugins.diloco.executor import LaunchError
from composer_plugins.diloco.rendezvous import StoreRendezvous


class Lighthouse:
    """The torchft lighthouse: a ``LighthouseServer`` in this process on ``bind`` (default a free loopback port)
    until :meth:`shutdown`, or, given ``address``, an external one that is only recorded."""

    def __init__(
        self,
        address: str | None = None,
        *,
        bind: str = f"{LOOPBACK}:0",
        min_replicas: int = 1,
        join_timeout_ms: int = 60_000,
        heartbeat_timeout_ms: int = 5_000,
        quorum_tick_ms: int = 100,
    ) -> None:
        self._server: Any = None
        if address is not None:
            self.address = address if "://" in address else f"http://{address}"
            return
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO
        try:
            from torchft.coordination import LighthouseServer
        except ImportError as e:  # pragma: no cover - torchft is an optional extra
            raise LaunchError("the DiLoCo launcher needs torchft. HINT: pip install 'composer-plugins[diloco]'") from e
        self._server = LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        addr = self._server.address()
        host = bind.rsplit(":", 1)[0].strip("[]")
        if host in (LOOPBACK, "localhost"):
            # torchft advertises socket.gethostname(); on a loopback-only run use the address we bound.
            addr = f"http://{LOOPBACK}:{addr.rsplit(':', 1)[1]}"
        self.address = addr

    @property
    def local(self) -> bool:
        """True when this process runs the lighthouse."""
        return self._server is not None

    def shutdown(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown()
            self._server = None

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class StartBarrier:
    """A ``TCPStore`` on ``127.0.0.1:<free port>`` where the first generation of replicas (job-wide indices
    ``first .. first + size - 1``) meets; see docs/diloco.md, "Fault tolerance", "Start-up"."""

    NAME = "diloco/start"

    def __init__(self, size: int, host: str = LOOPBACK, first: int = 0) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        self.size = size
        self._store: Any = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        self.address = f"{host}:{self._store.port}"
        self.rendezvous = StoreRendezvous(self._store, range(first, first + size), name=self.NAME, what="replica")
        self.rendezvous.publish()

    @property
    def board(self) -> RejoinBoard | None:
        """The :class:`RejoinBoard` on this store (``None`` once closed)."""
        return RejoinBoard(self._store) if self._store is not None else None

    def mark_gone(self, index: int, reason: str) -> None:
        """Tell the waiting replicas that replica ``index`` (job-wide) exited before arriving."""
        if self._store is not None:
            with contextlib.suppress(Exception):
                self.rendezvous.mark_gone(index, reason)

    def close(self) -> None:
        self._store = None


class RejoinBoard:
    """Where a restarted replica's way back into the job is posted (a ``TCPStore``, the start barrier's): key
    ``diloco/rejoin/<index>`` holds ``<state> <restart> [detail]`` (docs/diloco.md, "Fault tolerance")."""

    PREFIX = "diloco/rejoin"

    def __init__(self, store: Any) -> None:
        self.store = store

    @classmethod
    def connect(cls, address: str, timeout_s: float = 30.0) -> RejoinBoard:
        """A client of the board at ``host:port`` (the replica side)."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        host, _, port = address.rpartition(":")
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        return cls(store)

    def _key(self, index: int) -> str:
        return f"{self.PREFIX}/{index}"

    def post(self, index: int, state: str, restart: int, detail: object = "") -> None:
        """Record ``state`` (pending, ready, joined, gone) of replica ``index``'s ``restart``-th start."""
        self.store.set(self._key(index), f"{state} {restart} {detail}".rstrip())

    def state(self, index: int) -> tuple[str, int, str] | None:
        """``(state, restart, detail)`` of replica ``index``, or ``None`` if it was never restarted."""
        key = self._key(index)
        if not self.store.check([key]):
            return None
        state, restart, *rest = self.store.get(key).decode().split(" ", 2)
        return state, int(restart), rest[0] if rest else ""

    def outstanding(self, indices: Sequence[int]) -> dict[int, str]:
        """``{index: state}`` of the replicas among ``indices`` on their way back (``pending`` or ``ready``)."""
        states = {i: self.state(i) for i in indices}
        return {i: st[0] for i, st in states.items() if st is not None and st[0] in ("pending", "ready")}
