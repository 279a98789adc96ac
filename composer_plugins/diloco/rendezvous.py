"""Replicas meet over a store: :class:`StoreRendezvous` (a member seen to exit is marked *gone*, so the others
do not wait for a timeout), used by the DiLoCo launcher and replicas and the DiLoCo benchmark."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any


class RendezvousError(RuntimeError):
    """A member of a rendezvous exited before arriving, or did not arrive in time."""


class StoreRendezvous:
    """Members ``0..size-1`` (or the ids in ``members``) meet over a store with ``set``/``check``/``get``.

    A member calls :meth:`wait`; whoever watches the member processes calls :meth:`mark_gone` when one exits.
    ``members=None`` reads the member ids the creator published with :meth:`publish`.
    """

    def __init__(
        self, store: Any, members: int | Sequence[int] | None = None, *, name: str = "rendezvous", what: str = "member"
    ) -> None:
        self.store = store
        self.name = name
        self.what = what
        self._members: list[int] | None = (
            list(range(members)) if isinstance(members, int) else (list(members) if members is not None else None)
        )

    def _key(self, kind: str, member: int | str) -> str:
        return f"{self.name}/{kind}/{member}"

    @property
    def members(self) -> list[int]:
        if self._members is None:
            raw = self.store.get(self._key("members", "all")).decode()
            self._members = [int(x) for x in raw.split(",") if x]
        return self._members

    def publish(self) -> None:
        """Store the member ids, for members that construct with ``members=None``."""
        self.store.set(self._key("members", "all"), ",".join(str(m) for m in self.members))

    def arrive(self, member: int) -> None:
        self.store.set(self._key("arrived", member), str(os.getpid()))

    def mark_gone(self, member: int, reason: str) -> None:
        """Record that ``member`` exited (``reason``, e.g. ``exited with code 1``)."""
        self.store.set(self._key("gone", member), reason)

    def state(self) -> tuple[list[int], dict[int, str], list[int]]:
        """``(arrived, gone {member: reason}, missing)``; a member that arrived is never gone here."""
        arrived, gone, missing = [], {}, []
        for m in self.members:
            if self.store.check([self._key("arrived", m)]):
                arrived.append(m)
            elif self.store.check([self._key("gone", m)]):
                gone[m] = self.store.get(self._key("gone", m)).decode()
            else:
                missing.append(m)
        return arrived, gone, missing

    def wait(self, member: int, timeout_s: float, *, allow_gone: bool = False, poll_s: float = 0.05) -> dict[int, str]:
        """Arrive as ``member`` and wait for every other member; :class:`RendezvousError` names the members that
        exited before arriving (unless ``allow_gone``: returned, ``{member: reason}``) or did not arrive in time."""
        self.arrive(member)
        deadline = time.monotonic() + timeout_s
        while True:
            arrived, gone, missing = self.state()
            if gone and not allow_gone:
                who = "; ".join(f"{self.what} {m} {r}" for m, r in sorted(gone.items()))
                raise RendezvousError(f"{self.name}: {who} before arriving (this is {self.what} {member})")
            if not missing:
                return gone
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"{self.name}: {self.what}(s) {missing} did not arrive within {timeout_s:.0f}s "
                    f"(arrived: {arrived}; this is {self.what} {member})"
                )
            time.sleep(poll_s)
