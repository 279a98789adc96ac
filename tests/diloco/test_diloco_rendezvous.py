"""The DiLoCo replicas' rendezvous over a store: it names who is missing, and does not wait for one that exited."""

from __future__ import annotations

import time

import pytest

from composer_plugins.diloco.rendezvous import RendezvousError, StoreRendezvous


class FakeStore:
    """The part of a torch.distributed store the rendezvous uses."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, k: str, v: str) -> None:
        self.data[k] = v.encode()

    def get(self, k: str) -> bytes:
        return self.data[k]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


def test_rendezvous_fails_at_once_naming_a_member_that_exited():
    store = FakeStore()
    rdv = StoreRendezvous(store, 3, name="demo", what="worker")
    rdv.arrive(2)
    rdv.mark_gone(0, "was killed by SIGKILL")
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"demo: worker 0 was killed by SIGKILL before arriving"):
        rdv.wait(1, timeout_s=60)
    assert time.monotonic() - t0 < 5
    # allow_gone: the others go on, and learn who is missing
    assert rdv.wait(1, timeout_s=60, allow_gone=True) == {0: "was killed by SIGKILL"}


def test_rendezvous_timeout_names_the_members_that_never_arrived():
    rdv = StoreRendezvous(FakeStore(), [4, 5, 6], name="demo", what="replica")
    rdv.arrive(6)
    with pytest.raises(RendezvousError, match=r"replica\(s\) \[5\] did not arrive within 0s"):
        rdv.wait(4, timeout_s=0.3)


def test_rendezvous_reads_published_members():
    store = FakeStore()
    StoreRendezvous(store, [2, 3], name="x").publish()
    other = StoreRendezvous(store, None, name="x")
    assert other.members == [2, 3]
