"""The global states of a run: ``init`` (round 0 with ``init_sync``), ``state/<r>`` written off the critical path,
and a replica's way back (replaying closed rounds, catching up from the newest intact state)."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.diloco.objstore.rounds import StoreObjectError
from composer_plugins.diloco.objstore.statehash import flatten, map_leaves, state_hash
from composer_plugins.diloco.store import CorruptObjectError, to_host

log = logging.getLogger(__name__)


class StatesMixin:
    """Loading, rebuilding and writing global states, for
    :class:`~composer_plugins.diloco.objstore.ObjectStoreDiLoCoCallback`."""

    def _global_state(self) -> dict[str, Any]:
        """This round's global state on the host (copies: the background writer encodes them later)."""
        return {
            "round": self.round,
            "global_params": [to_host(g).clone() for g in self.global_params],
            "outer_optimizers": [_host_tree(o.state_dict()) for o in self.outer_optimizers],
        }

    def _apply_state(self, k: int, state: dict[str, Any]) -> None:
        try:
            saved_params = list(state["global_params"])
            with torch.no_grad():
                for g, p, saved in zip(self.global_params, self.params, saved_params, strict=True):
                    if saved.shape != g.shape:
                        raise ValueError(f"a parameter of shape {list(saved.shape)} for {list(g.shape)}")
                    g.copy_(saved)
                    p.copy_(saved)
            for opt, sd in zip(self.outer_optimizers, state["outer_optimizers"], strict=True):
                opt.load_state_dict(sd)
        except (KeyError, TypeError, ValueError) as e:
            raise StoreObjectError(
                f"{self.store.where if self.store else ''}/state/{k:08d} does not fit this model: {e}"
            ) from e
        self._at_round(k + 1)
        self._healed()

    # -- replay points (``exact_every``) -----------------------------------------------------------------
    def _replay_points(self) -> bool:
        """Whether only one due state in ``exact_every`` is written (docs/diloco.md, "States: replay points")."""
        return self.config.exact_every > 1

    def _state_written(self, r: int) -> bool:
        """Whether round ``r``'s due state is written: the last of every ``exact_every`` due states, by round (the
        same on every replica and launch)."""
        k, e = self.config.state_every, self.config.exact_every
        return e <= 1 or (r // k) % e == e - 1

    def _put_state(self, r: int) -> Callable[[], None]:
        """A job writing round ``r``'s global state as it is now (with replay points, with its hash)."""
        rs, key, hashed = self.rounds, f"state/{r:08d}", self._replay_points()
        state = self._global_state()

        def put() -> None:
            digest = state_hash(flatten(state)) if hashed else None
            self.bytes_states += rs.put_state(key, state, create=True, digest=digest)

        return put

    def _replica_state(self) -> dict[str, Any]:
        scheds = [cfg.scheduler.state_dict() for cfg in self._trainer.lr_scheduler_configs] if self._trainer else []
        return _host_tree(
            {
                "model": self._module.state_dict(),
                "inner_optimizer": self._inner.state_dict(),
                "lr_schedulers": scheds,
                "global_params": list(self.global_params),
            }
        )

    def _init_sync(self) -> None:
        """Round 0 with ``init_sync``: replica 0 creates the run's ``init``, every replica starts from it
        (docs/diloco.md, "What a team can trust the store with", "One starting point")."""
        if self.replica.index == 0 and self.rounds.put_state("init", self._replica_state(), create=True):
            return
        deadline = time.monotonic() + self.config.barrier_timeout_s
        delay = self.config.poll_s
        while True:
            try:
                state = self.rounds.get_state("init")
            except CorruptObjectError as e:
                raise StoreObjectError(
                    f"{e}; refused (nothing in it was run). The run's starting point is damaged. "
                    "HINT: start the run again on a fresh prefix."
                ) from e
            if state is not None:
                break
            if time.monotonic() > deadline:
                raise ComposerPluginsError(
                    f"replica {self.replica.index}: no {self.rounds.store.where}/init within "
                    f"diloco.barrier_timeout_s={self.config.barrier_timeout_s:.0f}s (replica 0 writes it at its first "
                    "sync). HINT: start replica 0, or raise diloco.barrier_timeout_s."
                )
            time.sleep(delay)
            delay = min(delay * 1.5, self.config.poll_max_s)
        try:
            self._module.load_state_dict(state["model"])
            self._inner.load_state_dict(state["inner_optimizer"])
            if self._trainer is not None:
                for cfg, sd in zip(self._trainer.lr_scheduler_configs, state["lr_schedulers"], strict=False):
                    cfg.scheduler.load_state_dict(sd)
            with torch.no_grad():
                for g, saved in zip(self.global_params, state["global_params"], strict=True):
                    g.copy_(saved)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise StoreObjectError(f"{self.rounds.store.where}/init does not fit this model: {e}") from e
        self._healed()

    def _replay_closed_rounds(self) -> int:
        """Rebuild every round closed after the state held here from its manifest's pseudo-gradients (the same
        bits its participants computed), writing ``state/<r>`` where it is missing. Rounds replayed."""
        n = 0
        if self.round == 0 and (self.rounds.manifest(0) is None or not self._take_init_globals()):
            return 0
        while (m := self.rounds.manifest(self.round)) is not None:
            r = self.round
            if not self._apply_round(r, m, None, mix_local=False):
                break
            n += 1
            self._healed()
            key = f"state/{r:08d}"
            if self._state_due(r) and not self.rounds.store.exists(key):
                self._put_state(r)()
                log.warning(
                    "DiLoCo: rebuilt %s/%s from round %d's manifest (its closer did not write it)",
                    self.rounds.store.where,
                    key,
                    r,
                )
        if n:
            log.info(
                "DiLoCo: replica %d replayed %d closed round(s); now at round %d", self.replica.index, n, self.round
            )
        return n

    def _take_init_globals(self) -> bool:
        """Before rebuilding round 0: the global weights round 0 started from (``init``'s, with ``init_sync``)."""
        if not (self.config.init_sync and self.replica.num_replicas > 1):
            return True
        try:
            init = self.rounds.get_state("init")
        except CorruptObjectError as e:
            raise StoreObjectError(f"{e}; refused (nothing in it was run)") from e
        if init is None:
            return False
        with torch.no_grad():
            for g, p, saved in zip(self.global_params, self.params, init["global_params"], strict=True):
                g.copy_(saved)
                p.copy_(saved)
        return True

    def _catch_up(self, r: int, manifest: dict[str, Any]) -> None:
        """Left out of round ``r``: drop the local steps, rebuild round ``r`` (and any closed since) from the
        manifests, or load a newer global state when a listed pseudo-gradient is gone."""
        log.warning("DiLoCo: left out of round %d (late); catching up", r)
        if (r > 0 or self._take_init_globals()) and self._apply_round(r, manifest, None, mix_local=False):
            self._healed()
            self._replay_closed_rounds()
            self._align_to_others()
            return
        deadline = time.monotonic() + self.config.round_timeout_s
        while True:
            found = self.rounds.newest_valid_state(at_least=r)
            if found is not None:
                self._apply_state(*found)
                self._replay_closed_rounds()
                self._align_to_others()
                return
            if time.monotonic() > deadline:
                raise ComposerPluginsError(
                    f"round {r} closed without this replica, its pseudo-gradients are unreadable and no global state "
                    f"for it appeared in {self.rounds.store.where}/state within "
                    f"diloco.round_timeout_s={self.config.round_timeout_s:.0f}s"
                )
            time.sleep(self.config.poll_s)

    def _align_to_others(self) -> int:
        """A replica joining a round the others are already in takes only the inner steps they have left (their
        step time from the last two manifests, the lag since the last; nothing changes when the lag is a round or
        more): docs/diloco.md, "Goodput under failures". Steps skipped."""
        h, r = self.config.sync_every, self.round
        if r < 2 or h < 2:
            return 0
        last, before = self.rounds.manifest(r - 1), self.rounds.manifest(r - 2)
        if last is None or before is None:
            return 0
        try:
            step_s = (float(last["time"]) - float(before["time"])) / h
            lag_s = time.time() - float(last["time"])
        except (KeyError, TypeError, ValueError):
            return 0
        if not (step_s > 0 and 0 < lag_s < step_s * h):
            return 0
        skip = min(h - 1, int(lag_s / step_s))
        self._since_sync = max(self._since_sync, skip)
        if skip:
            log.info(
                "DiLoCo: replica %d joins round %d %.1fs late: %d of its %d inner steps",
                self.replica.index,
                r,
                lag_s,
                h - skip,
                h,
            )
        return skip

    def _state_due(self, r: int) -> bool:
        """Whether round ``r``'s global state is written: every ``state_every`` rounds and at the last round, of
        those one in ``exact_every`` (:meth:`_state_written`)."""
        k = self.config.state_every
        return (r % k == k - 1 or (self._target is not None and r + 1 >= self._target)) and self._state_written(r)

    def _write_state_async(self) -> None:
        """Write ``state/<round-1>`` in the background (the next inner steps do not wait for it)."""
        r = self.round - 1
        put = self._put_state(r)
        keep = self.config.keep_rounds

        def job() -> None:
            put()
            if keep:
                self.rounds.collect_garbage(r, keep)

        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diloco-state")
        self._pending.append(self._writer.submit(job))

    def _raise_write_error(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            f.result()

    def _flush_writes(self) -> None:
        for f in self._pending:
            f.result()
        self._pending = []


def _host_tree(obj: Any) -> Any:
    """``obj`` with every tensor copied to the host (a plain CPU tensor), for the data codec."""
    return map_leaves(_host_copy, obj)


def _host_copy(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    t = to_host(x)
    return t.clone() if t.data_ptr() == x.data_ptr() else t
