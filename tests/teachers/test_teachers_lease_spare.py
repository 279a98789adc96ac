"""The spend lease's spare grows when its writes are slower than the calls it covers.

Every commit of the cache here waits 30 ms (a slow disk's fsync, or a writer starved of CPU). The
lease is still committed before any call it does not cover is sent; what changes is how many calls
had to wait for it with their concurrency slot held (``ReplayStats.lease_waits``, a count, not a time).
"""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import pytest

from composer_plugins.teachers import engine as engine_mod
from composer_plugins.teachers.cache import ReplayCache
from composer_plugins.teachers.engine import ReplayEngine

COMMIT_DELAY_S = 0.03


class SlowCommitCache(ReplayCache):
    """A cache whose every awaited commit lands ``COMMIT_DELAY_S`` late (the write itself is unchanged)."""

    async def acommit(self, stmts: list[tuple[str, tuple[Any, ...]]]) -> None:
        await asyncio.sleep(COMMIT_DELAY_S)
        await super().acommit(stmts)


def _run(make_teacher: Any, states: Any, path: Any, run_id: str) -> Any:
    teacher = make_teacher("teacher-a", max_concurrency=8)
    with SlowCommitCache(path) as cache:
        res = ReplayEngine([teacher], cache=cache, max_usd=1e3, progress=False, run_id=run_id).run(states)
        totals = cache.run_totals(run_id)
    return res, totals


def test_slow_lease_writes_grow_the_spare_instead_of_stalling_calls(srv, make_teacher, states_factory, tmp_path):
    srv.configure(latency_s=0.005)
    states = states_factory(240)
    res, totals = _run(make_teacher, states, tmp_path / "c.sqlite", "slow")
    assert res.stats.completed == 240 and not res.failures
    # 8 calls wait for the first lease write; after that, at most one round of 8 waits per doubling of
    # the spare (8 -> 128 worst cases: 4 doublings). A fixed spare of 8 stalls again every few calls.
    assert res.stats.lease_waits <= 8 + 4 * 8, res.stats.lease_waits
    # nothing is counted twice: every call has its paid row, the clean exit dropped the lease
    assert totals.paid_calls == 240 and totals.uncertain_calls == 0
    con = sqlite3.connect(f"file:{tmp_path / 'c.sqlite'}?mode=ro", uri=True)
    try:
        assert con.execute("SELECT COUNT(*) FROM ledger WHERE status = 'lease'").fetchone()[0] == 0
    finally:
        con.close()


def test_without_growth_the_same_run_stalls(srv, make_teacher, states_factory, tmp_path, monkeypatch):
    """The counter measures what the growth removes: pinned to its starting size, the spare runs out often."""
    srv.configure(latency_s=0.005)
    monkeypatch.setattr(engine_mod, "HEADROOM_GROWTH", 1)
    res, _ = _run(make_teacher, states_factory(240), tmp_path / "c.sqlite", "fixed")
    assert res.stats.completed == 240
    assert res.stats.lease_waits > 8 + 4 * 8, res.stats.lease_waits


@pytest.mark.parametrize("growth", [1, 16])
def test_the_spare_stays_under_a_tenth_of_the_room_whatever_its_growth(
    srv, make_teacher, states_factory, tmp_path, monkeypatch, growth
):
    """Under a tight ceiling the grown spare is still capped at a tenth of what is left (phantom spend bounded)."""
    srv.configure(latency_s=0.005)
    monkeypatch.setattr(engine_mod, "HEADROOM_GROWTH", growth)
    states = states_factory(60)
    teacher = make_teacher("teacher-a", max_concurrency=8)
    wc = max(teacher.max_cost(s.messages) for s in states)
    ceiling = 5 * wc  # answers cost well under their worst case: 5 of them still leave most states unpaid
    seen: list[float] = []
    real_raise = ReplayEngine._raise_lease

    async def spy(self: ReplayEngine, delta: float) -> None:
        await real_raise(self, delta)
        seen.append(self._lease_pool - self._lease_assigned)  # the spare right after a raise landed

    monkeypatch.setattr(ReplayEngine, "_raise_lease", spy)
    with SlowCommitCache(tmp_path / "c.sqlite") as cache:
        res = ReplayEngine([teacher], cache=cache, max_usd=ceiling, progress=False, run_id="tight").run(states)
    assert res.stats.skipped_budget > 0 and seen
    # the spare beyond the calls in flight: the share of the call that asked plus a tenth of the room
    assert max(seen) <= wc + 0.1 * ceiling + 1e-12, (max(seen), wc, ceiling)
