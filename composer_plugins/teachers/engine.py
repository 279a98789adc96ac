"""The replay engine: every state through every teacher, async, cached, budgeted, resumable.

Concurrency, retries, the budget, the cache and the durable spend lease: docs/replay.md, "The replay engine".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from composer_plugins.teachers.base import CallCounts, Teacher, TeacherCallError, TeacherError, TeacherResponse
from composer_plugins.teachers.budget import Budget
from composer_plugins.teachers.cache import CacheError, ReplayCache, cache_key
from composer_plugins.teachers.traces import TraceState

log = logging.getLogger(__name__)

#: How many times its starting size (the teachers' total concurrency) the lease's spare may grow to.
HEADROOM_GROWTH = 16


@dataclass
class RetryPolicy:
    """How failed calls are retried (docs/replay.md, "Retries").

    The n-th retry waits ``uniform(d/2, d)`` with ``d = min(backoff_max_s, backoff_base_s * 2**n)``
    ("equal jitter"), and never less than the server's ``Retry-After`` (capped at ``retry_after_max_s``).
    """

    max_retries: int = 6
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    retry_after_max_s: float = 300.0

    def delay(self, retry: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        d = min(self.backoff_max_s, self.backoff_base_s * (2**retry))
        wait = rng.uniform(d / 2, d)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.retry_after_max_s))
        return wait


@dataclass
class CallFailure:
    """A ``(state, teacher)`` pair that got no answer in this run."""

    state_id: str
    teacher: str
    kind: str
    message: str
    attempts: int


@dataclass
class TeacherStats(CallCounts):
    """Per-teacher counters: ``calls`` counts attempts actually sent (HTTP requests for ``openai``, retries
    included), ``completed`` the calls that returned an answer, ``cache_hits`` answers served from the cache."""

    completed: int = 0
    retries: int = 0


@dataclass
class ReplayStats(TeacherStats):
    """Counters of a run: the per-teacher ones summed (:meth:`count` adds to both), and the run's own.

    ``lease_waits`` counts calls that had to wait for a spend-lease write before they could be sent.
    """

    jobs: int = 0
    deduplicated: int = 0
    skipped_budget: int = 0
    lease_waits: int = 0
    uncertain_usd: float = 0.0
    prior_spent_usd: float = 0.0
    prior_uncertain_usd: float = 0.0
    max_usd: float | None = None
    elapsed_s: float = 0.0
    by_teacher: dict[str, TeacherStats] = field(default_factory=dict)

    @property
    def total_spent_usd(self) -> float:
        """Spend of the run including earlier (resumed) processes and uncertain calls."""
        return self.spent_usd + self.uncertain_usd + self.prior_spent_usd + self.prior_uncertain_usd

    def count(self, teacher: str, field: str, n: int = 1) -> None:
        """Add ``n`` to counter ``field`` of the run and of ``teacher``."""
        for counters in (self, self.by_teacher[teacher]):
            setattr(counters, field, getattr(counters, field) + n)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_spent_usd": self.total_spent_usd}


@dataclass
class ReplayResult:
    """Answers per state and teacher, failures and counters."""

    responses: dict[str, dict[str, TeacherResponse]]
    failures: list[CallFailure]
    stats: ReplayStats
    teachers: list[str]


@dataclass
class _Job:
    key: str | None
    state: TraceState
    followers: list[TraceState] = field(default_factory=list)


@dataclass
class _Answer:
    """A successful call whose response still has to be committed before use."""

    resp: TeacherResponse
    reserve: float
    attempt: str
    leased: bool = False


class ReplayEngine:
    """Replays states through teachers.

    ``cache=None`` persists nothing (no resume), ``max_usd=None`` sets no ceiling; a rerun with the same ``run_id``
    resumes its budget unless ``fresh_budget``; ``durable_reservations`` keeps the spend lease (with a cache and a
    ceiling); ``seed`` seeds the backoff jitter. See docs/replay.md, "The replay engine".
    """

    def __init__(
        self,
        teachers: Sequence[Teacher],
        *,
        cache: ReplayCache | None = None,
        max_usd: float | None = None,
        retry: RetryPolicy | None = None,
        run_id: str = "default",
        fresh_budget: bool = False,
        durable_reservations: bool = True,
        progress: bool = True,
        seed: int = 0,
    ) -> None:
        if not teachers:
            raise TeacherError("a replay needs at least one teacher")
        ids = [t.id for t in teachers]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise TeacherError(f"teacher ids must be unique; duplicated: {dupes}. HINT: give each teacher an `id:`")
        if max_usd is not None and max_usd < 0:
            raise TeacherError(f"max_usd must be >= 0, got {max_usd}")
        self.teachers = list(teachers)
        self.cache = cache
        self.max_usd = max_usd
        self.retry = retry or RetryPolicy()
        self.run_id = run_id
        self.fresh_budget = fresh_budget
        self.durable_reservations = durable_reservations
        self.progress = progress
        self._rng = random.Random(seed)

    # -- public -------------------------------------------------------------------------------
    def run(self, states: Sequence[TraceState]) -> ReplayResult:
        """Synchronous :meth:`arun`."""
        return asyncio.run(self.arun(states))

    async def arun(self, states: Sequence[TraceState]) -> ReplayResult:
        """Replay ``states`` through every teacher."""
        with self.cache.run_lock(self.run_id) if self.cache is not None else contextlib.nullcontext():
            return await self._arun(states)

    # -- internals ------------------------------------------------------------------------------
    def _setup(self, stats: ReplayStats) -> None:
        budget = Budget(self.max_usd)
        if self.cache is not None:
            if self.fresh_budget:
                self.cache.reset_run(self.run_id)
            orphans = self.cache.mark_orphans(self.run_id)
            if orphans:
                log.warning(
                    "run %r: a previous process died with calls in flight; counting them at their worst-case cost",
                    self.run_id,
                )
            prior = self.cache.run_totals(self.run_id)
            stats.prior_spent_usd, stats.prior_uncertain_usd = prior.paid_usd, prior.uncertain_usd
            budget.spent_usd, budget.uncertain_usd = prior.paid_usd, prior.uncertain_usd
        self._budget = budget
        self._budget_cond = asyncio.Condition()
        self._budget_waiters = 0
        self._pause_until: dict[str, float] = defaultdict(float)
        self._stats = stats
        self._nonce = uuid.uuid4().hex[:12]
        self._attempts = itertools.count()
        self._use_lease = self.cache is not None and self.durable_reservations and self.max_usd is not None
        self._lease_id = f"lease:{self._nonce}"
        # The durable lease is a pool: raised (committed) before a call needs it, lowered by each
        # call's share in the same transaction as that call's ledger row. In memory:
        self._lease_pool = 0.0  # committed raises minus submitted lowerings (<= the durable value)
        self._lease_assigned = 0.0  # shares of calls sent (or about to be) whose row is not yet submitted
        self._lease_calls = 0  # how many calls hold a share (exact zero when none: no float residue)
        self._lease_raising = 0.0  # raises submitted, not yet committed
        self._lease_written = False
        self._lease_lost = 0.0  # shares of answers that were billed but whose commit failed
        self._last_share = 0.0
        self._lease_task: asyncio.Task[None] | None = None
        self._pending_rows_usd = 0.0  # reservations of calls whose row is submitted, budget not yet settled
        slots = sum(t.max_concurrency for t in self.teachers)
        #: spare worst cases the lease holds beyond what is in flight, so calls start without waiting for a write;
        #: doubled (up to HEADROOM_GROWTH times) each time the spare runs out before its top-up is committed
        self._headroom_calls = max(2, slots)
        self._headroom_max = HEADROOM_GROWTH * self._headroom_calls
        self._grown_for: asyncio.Task[None] | None = None

    def _lookup(
        self, states: Sequence[TraceState], responses: dict[str, dict[str, TeacherResponse]]
    ) -> dict[str, list[_Job]]:
        """Serve cache hits; return the remaining jobs per teacher (identical requests merged)."""
        stats, cache = self._stats, self.cache
        queues: dict[str, list[_Job]] = {}
        for t in self.teachers:
            stats.jobs += len(states)
            if cache is None or not t.cacheable:
                queues[t.id] = [_Job(None, s) for s in states]
                continue
            jobs: dict[str, _Job] = {}
            for s in states:
                k = cache_key(t.id, t.kind, t.model, t.cache_params(), s.messages)
                if k in jobs:
                    jobs[k].followers.append(s)
                    stats.deduplicated += 1
                else:
                    jobs[k] = _Job(k, s)
            for k, data in cache.get_many(jobs).items():
                job = jobs.pop(k)
                resp = TeacherResponse.from_dict(data, cached=True)
                for s in (job.state, *job.followers):
                    responses[s.state_id][t.id] = resp
                    stats.count(t.id, "cache_hits")
            queues[t.id] = list(jobs.values())
        return queues

    async def _arun(self, states: Sequence[TraceState]) -> ReplayResult:
        t0 = time.perf_counter()
        stats = ReplayStats(max_usd=self.max_usd, by_teacher={t.id: TeacherStats() for t in self.teachers})
        self._setup(stats)
        responses: dict[str, dict[str, TeacherResponse]] = {s.state_id: {} for s in states}
        failures: list[CallFailure] = []
        queues = self._lookup(states, responses)
        for t in self.teachers:  # fail fast (missing key variable ...) for teachers that will be called
            if queues[t.id] and not (self.max_usd == 0 and t.max_cost(queues[t.id][0].state.messages) > 0):
                t.check()
        bar: Any = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=stats.jobs, initial=stats.cache_hits, desc="replay", unit="call", dynamic_ncols=True)
        self._last_postfix = 0.0
        finishing: set[asyncio.Task[None]] = set()

        def record(t: Teacher, job: _Job, result: TeacherResponse | CallFailure) -> None:
            group = (job.state, *job.followers)
            if isinstance(result, TeacherResponse):
                for s in group:
                    responses[s.state_id][t.id] = result
            else:
                failures.extend(
                    CallFailure(s.state_id, t.id, result.kind, result.message, result.attempts) for s in group
                )
                stats.count(t.id, "failures", len(group))
                if result.kind == "budget":
                    stats.skipped_budget += len(group)
            if bar is not None:
                bar.update(len(group))
                self._postfix(bar, stats)

        # answers received but not yet committed, per teacher: at most max_concurrency, so a kill
        # loses at most 2 x max_concurrency answers per teacher (in flight + awaiting their commit)
        committing = {t.id: asyncio.Semaphore(t.max_concurrency) for t in self.teachers}

        async def finish(t: Teacher, job: _Job, ans: _Answer) -> None:
            # commit (response + ledger, one transaction), then account and use it
            try:
                record(t, job, await self._commit_answer(t, job, ans))
            finally:
                committing[t.id].release()

        async def worker(t: Teacher, jobs: Iterator[_Job]) -> None:
            for job in jobs:  # shared by the teacher's workers: each takes the next job when it is free
                result = await self._call(t, job)
                if isinstance(result, _Answer):
                    # the commit runs off this worker's slot: the teacher's concurrency is spent on requests
                    await committing[t.id].acquire()
                    task = asyncio.create_task(finish(t, job, result))
                    finishing.add(task)
                    task.add_done_callback(finishing.discard)
                else:
                    record(t, job, result)

        tasks: list[asyncio.Task[None]] = []
        try:
            for t in self.teachers:
                jobs = iter(queues[t.id])
                n = min(t.max_concurrency, max(1, len(queues[t.id])))
                tasks += [asyncio.create_task(worker(t, jobs), name=f"replay-{t.id}-{i}") for i in range(n)]
            await asyncio.gather(*tasks)
            while finishing:
                await asyncio.gather(*list(finishing))
        finally:
            for task in [*tasks, *finishing]:
                task.cancel()
            await asyncio.gather(*tasks, *finishing, return_exceptions=True)
            # the lease shrinks to the calls that may have been billed unseen (none: the row goes)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._settle_lease()
            for t in self.teachers:
                try:
                    await t.aclose()
                except Exception as e:  # pragma: no cover - best effort
                    log.warning("closing teacher %r failed: %s", t.id, e)
            b = self._budget
            stats.spent_usd = b.spent_usd - stats.prior_spent_usd
            stats.uncertain_usd = b.uncertain_usd - stats.prior_uncertain_usd
            stats.elapsed_s = time.perf_counter() - t0
            if bar is not None:
                self._postfix(bar, stats, force=True)
                bar.close()
        return ReplayResult(responses, failures, stats, [t.id for t in self.teachers])

    def _postfix(self, bar: Any, stats: ReplayStats, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_postfix < 0.25:
            return
        self._last_postfix = now
        b = self._budget
        spend = f"${b.spent_usd + b.uncertain_usd:.4f}"
        if b.max_usd is not None:
            spend += f"/{b.max_usd:g}"
        bar.set_postfix(calls=stats.calls, hits=stats.cache_hits, retries=stats.retries, spend=spend, refresh=False)

    # -- budget -----------------------------------------------------------------------------------
    async def _notify_budget(self) -> None:
        if self._budget_waiters:
            async with self._budget_cond:
                self._budget_cond.notify_all()

    async def _reserve(self, amount: float) -> bool:
        """Reserve ``amount``, waiting for in-flight calls to settle while they might free room."""
        b = self._budget
        if b.try_reserve(amount):
            return True
        async with self._budget_cond:
            while not b.try_reserve(amount):
                if b.in_flight == 0:
                    b.exhausted = True
                    return False
                self._budget_waiters += 1
                try:
                    await self._budget_cond.wait()
                finally:
                    self._budget_waiters -= 1
        return True

    def _lease_free(self) -> float:
        return self._lease_pool - self._lease_assigned

    async def _ensure_lease(self, share: float) -> None:
        """Assign ``share`` of the durable lease to a call about to be sent, raising the lease first if needed.

        Invariant (durable, at every commit): the lease row >= the shares of the calls sent and not
        yet recorded by a ``paid``/``maybe`` row; so after ``kill -9`` each call counts once: its
        row, or its share of the lease.
        """
        waited = False
        while self._lease_free() < share * (1 - 1e-9):
            if self._lease_task is None or self._lease_task.done():
                self._start_raise(share)
            assert self._lease_task is not None
            if not waited:
                waited = True
                self._stats.lease_waits += 1
                self._grow_headroom()
            await asyncio.shield(self._lease_task)
        self._lease_assigned += share
        self._lease_calls += 1
        # top up before the spare runs out, so the next calls rarely wait for a write
        if self._lease_free() < share * self._headroom_calls / 2 and (
            self._lease_task is None or self._lease_task.done()
        ):
            self._start_raise(0.0)

    def _grow_headroom(self) -> None:
        """A call found the spare used up: double it, once per top-up in flight (not at the first raise)."""
        if self._lease_pool > 0 and self._grown_for is not self._lease_task:
            self._grown_for = self._lease_task
            self._headroom_calls = min(self._headroom_max, 2 * self._headroom_calls)

    def _start_raise(self, share: float) -> None:
        assert self.max_usd is not None
        b = self._budget
        # what the ledger may hold at most: the ceiling minus what is recorded or about to be
        room = self.max_usd - b.spent_usd - b.uncertain_usd - self._pending_rows_usd
        have = self._lease_pool + self._lease_raising
        # spare worst cases beyond what is needed now; a tenth of what is left at most, so a crash
        # under a tight ceiling leaves little phantom spend (the spare is counted as spent then)
        spare = max(share, self._last_share) * self._headroom_calls
        spare = min(spare, 0.1 * max(0.0, room - self._lease_assigned - share))
        want = self._lease_assigned + share + spare
        delta = min(want, room) - have
        if share:
            self._last_share = share
            # the reservation of every sent call fits under the ceiling, so this is always possible
            delta = max(delta, self._lease_assigned + share - have)
        if delta <= 0:
            self._lease_task = None
            return
        self._lease_task = asyncio.create_task(self._raise_lease(delta))
        self._lease_task.add_done_callback(_retrieve)

    async def _raise_lease(self, delta: float) -> None:
        assert self.cache is not None
        self._lease_raising += delta
        self._lease_written = True
        try:
            await self.cache.acommit(ReplayCache.lease_add_stmts(self._lease_id, self.run_id, delta))
            self._lease_pool += delta
        finally:
            self._lease_raising -= delta

    def _drop_share(self, share: float) -> None:
        self._lease_calls = max(0, self._lease_calls - 1)
        self._lease_assigned = max(0.0, self._lease_assigned - share) if self._lease_calls else 0.0

    def _unlease(self, share: float) -> list[tuple[str, tuple[Any, ...]]]:
        """Take a call's share off the lease: the statements to commit with its row (in-memory pool lowered now)."""
        self._drop_share(share)
        self._lease_pool -= share
        return ReplayCache.lease_add_stmts(self._lease_id, self.run_id, -share)

    def _unassign(self, share: float) -> None:
        """A call that provably cost nothing gives its share back to the spare (trimmed when there is too much)."""
        self._drop_share(share)
        spare = share * self._headroom_calls
        excess = self._lease_free() - 2 * spare
        if excess > 0 and self.cache is not None:
            self._lease_pool -= excess
            self.cache.submit(ReplayCache.lease_add_stmts(self._lease_id, self.run_id, -excess))

    async def _settle_lease(self) -> None:
        """At the end of a run: the lease keeps only the shares of calls sent and never recorded."""
        if not self._use_lease or not self._lease_written or self.cache is None:
            return
        if self._lease_task is not None and not self._lease_task.done():
            with contextlib.suppress(Exception):
                await self._lease_task
        at_risk = self._lease_assigned + self._lease_lost
        status = "lease" if at_risk > 0 else "released"
        await self.cache.acommit(ReplayCache.ledger_stmts(self._lease_id, self.run_id, "", "*", status, at_risk))
        self._lease_pool = at_risk
        self._lease_written = at_risk > 0

    # -- one call -------------------------------------------------------------------------------------
    async def _call(self, t: Teacher, job: _Job) -> _Answer | CallFailure:
        """Send ``job`` to ``t`` (with retries); an answer is returned uncommitted, with its reservation held."""
        state, key = job.state, job.key
        retry = 0

        def failure(kind: str, message: str, attempts: int) -> CallFailure:
            return CallFailure(state.state_id, t.id, kind, message, attempts)

        while True:
            wait = self._pause_until[t.id] - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                reserve = t.max_cost(state.messages)
            except Exception as e:
                return failure("estimate", t.scrub(f"{type(e).__name__}: {e}"), retry)
            if not await self._reserve(reserve):
                fits = f"skipped: worst-case cost ${reserve:.6f} does not fit under max_usd={self.max_usd}"
                return failure("budget", fits, retry)
            attempt = f"{self._nonce}-{next(self._attempts)}"
            leased = sent = False
            try:
                if reserve > 0 and self._use_lease:
                    await self._ensure_lease(reserve)
                    leased = True
                self._stats.count(t.id, "calls")
                sent = True
                resp = await t.complete(state.messages, metadata=state.metadata)
            except TeacherCallError as e:
                if e.billed == "maybe" and reserve > 0:
                    await self._record_maybe(t, key, attempt, reserve, leased)
                else:
                    self._release(reserve, leased)
                await self._notify_budget()
                if e.retryable and retry < self.retry.max_retries:
                    if e.retry_after is not None:
                        until = time.monotonic() + min(e.retry_after, self.retry.retry_after_max_s)
                        self._pause_until[t.id] = max(self._pause_until[t.id], until)
                    delay = self.retry.delay(retry, e.retry_after, self._rng)
                    retry += 1
                    self._stats.count(t.id, "retries")
                    await asyncio.sleep(delay)
                    continue
                return failure(e.kind, t.scrub(str(e)), retry + 1)
            except TeacherError:
                self._release(reserve, leased)
                raise
            except Exception as e:
                self._release(reserve, leased)
                await self._notify_budget()
                return failure("error", t.scrub(f"{type(e).__name__}: {e}"), retry + 1)
            except BaseException:  # cancelled
                if sent:  # mid-call: it may have been billed; its share stays on the lease
                    self._budget.mark_uncertain(reserve)
                else:
                    self._release(reserve, leased)
                raise
            return _Answer(resp, reserve, attempt, leased)

    def _release(self, reserve: float, leased: bool) -> None:
        if leased:
            self._unassign(reserve)
        self._budget.release(reserve)

    async def _record_maybe(self, t: Teacher, key: str | None, attempt: str, reserve: float, leased: bool) -> None:
        """A call that may have been billed got no answer: a ``maybe`` row (its share leaves the lease with it)."""
        if self.cache is None:
            self._budget.mark_uncertain(reserve)
            return
        stmts = ReplayCache.ledger_stmts(attempt, self.run_id, key or "", t.id, "maybe", reserve)
        if leased:
            stmts += self._unlease(reserve)
        self._pending_rows_usd += reserve
        try:
            await self.cache.acommit(stmts)
        finally:
            self._pending_rows_usd -= reserve
            self._budget.mark_uncertain(reserve)

    async def _commit_answer(self, t: Teacher, job: _Job, ans: _Answer) -> TeacherResponse | CallFailure:
        """Commit an answer (cache row + ``paid`` ledger row in one transaction), then settle its reservation."""
        resp, key = ans.resp, job.key
        stmts: list[tuple[str, tuple[Any, ...]]] = []
        if self.cache is not None:
            if key is not None:
                stmts += ReplayCache.put_stmts(key, t.id, resp.model, resp.to_dict())
            if ans.reserve > 0 or resp.cost_usd > 0:
                stmts += ReplayCache.ledger_stmts(ans.attempt, self.run_id, key or "", t.id, "paid", resp.cost_usd)
            if ans.leased:
                stmts += self._unlease(ans.reserve)
        failure: CallFailure | None = None
        if stmts:
            assert self.cache is not None
            self._pending_rows_usd += ans.reserve
            try:
                await self.cache.acommit(stmts)
            except CacheError as e:
                failure = CallFailure(job.state.state_id, t.id, "cache", str(e), 1)
                if ans.leased:  # billed, and recorded nowhere: the lease keeps its share
                    self._lease_lost += ans.reserve
            finally:
                self._pending_rows_usd -= ans.reserve
        self._budget.settle(ans.reserve, resp.cost_usd)
        self._stats.count(t.id, "completed")
        self._stats.by_teacher[t.id].spent_usd += resp.cost_usd
        await self._notify_budget()
        return failure if failure is not None else resp


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Done-callback of background writes: a failure is logged here (the caller waiting on it sees it too)."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("replay: a spend-lease write failed: %s", task.exception())


def replay(
    states: Sequence[TraceState],
    teachers: Sequence[Teacher],
    **engine_kwargs: Any,
) -> ReplayResult:
    """Convenience: ``ReplayEngine(teachers, **engine_kwargs).run(states)``."""
    return ReplayEngine(teachers, **engine_kwargs).run(states)


def responses_table(result: ReplayResult) -> list[dict[str, Any]]:
    """One JSON-able row per state: every teacher's action text, by teacher id in sorted order (for inspection
    and DVC outputs: the same bytes whichever teacher answered first)."""
    return [
        {"state_id": sid, "teachers": {tid: by_t[tid].text for tid in sorted(by_t)}}
        for sid, by_t in result.responses.items()
    ]
