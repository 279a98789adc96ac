"""The object-store DiLoCo callback: wiring a replica to its store, the round on each replica (publish, close,
settle; with ``overlap: 1`` in a background thread) and its sync log. The run's identity, its states and each
round's aggregate are in :mod:`.identity`, :mod:`.states` and :mod:`.aggregate`."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Any

import torch
from torch import nn

from composer_plugins.core.errors import ConfigError, one_line
from composer_plugins.diloco import env as _env
from composer_plugins.diloco.codecs import CodecError, get_codec
from composer_plugins.diloco.common import (
    DiLoCoConfig,
    ReplicaInfo,
    build_outer_optimizer,
    param_digest,
    split_fragments,
)
from composer_plugins.diloco.glue import DiLoCoCallbackBase
from composer_plugins.diloco.objstore.aggregate import AggregateMixin
from composer_plugins.diloco.objstore.identity import RunIdentityMixin
from composer_plugins.diloco.objstore.rounds import RoundStore, encode_slices
from composer_plugins.diloco.objstore.states import StatesMixin
from composer_plugins.diloco.store import ObjectStore, redact_url, to_host
from composer_plugins.diloco.transports import get_transport

log = logging.getLogger(__name__)


class ObjectStoreDiLoCoCallback(RunIdentityMixin, StatesMixin, AggregateMixin, DiLoCoCallbackBase):
    """One DiLoCo replica whose outer sync goes through an object store; used as :class:`DiLoCoCallback` is."""

    transport = "object_store"

    def __init__(self, config: DiLoCoConfig | None = None, replica: ReplicaInfo | None = None) -> None:
        super().__init__(config, replica)
        self.store: ObjectStore | None = None
        self.rounds: RoundStore | None = None
        self.params: list[nn.Parameter] = []
        self.global_params: list[torch.Tensor] = []
        self.round = 0  # the next round to sync; == outer steps applied so far
        self._done = False
        self.bytes_pseudograd = 0
        self.run_id: str | None = None
        self._residual: torch.Tensor | None = None  # a lossy codec's error feedback (host, fp32)
        #: replicas that said they stopped (their codec broke its contract): not waited for in later rounds
        self._stopped: dict[int, str] = {}
        #: the same for the mean slices this replica wrote: (slice, values) -> what the stored mean left out
        self._mean_residual: dict[tuple[int, int], torch.Tensor] = {}
        self._counted = (0, 0, 0)  # the store's byte and retry counters at the last sync record
        self.bytes_states = 0  # bytes of global states this replica wrote (their share of ``bytes_written``)
        self._states_counted = 0
        self._kinds_counted: dict[str, int] = {}  # ``RoundStore.bytes_by_kind`` at the last sync record
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[None]] = []
        self._background: concurrent.futures.ThreadPoolExecutor | None = None
        self._overlapped: tuple[Any, ...] | None = None  # overlap: 1 -- (round, future, snapshot, result, seconds)

    @property
    def outer_step(self) -> int:
        return self.round

    def _at_round(self, r: int) -> None:
        """Round ``r`` is the next to sync (``r`` outer steps applied): the one place the round moves."""
        self.round = r

    @property
    def bytes_allreduced(self) -> int:
        """Bytes of pseudo-gradients this replica wrote (the torchft path's counter of the same name)."""
        return self.bytes_pseudograd

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._background is not None:
            if self._overlapped is not None:
                try:  # an exception ended the run: let the round's writes finish, report nothing more
                    self._overlapped[1].result()
                except Exception as e:  # the run is already failing
                    log.warning("DiLoCo: the background sync of round %d failed: %s", self._overlapped[0], one_line(e))
                self._overlapped = None
            self._background.shutdown(wait=True)
            self._background = None
        if self._writer is not None:
            try:
                self._flush_writes()
            finally:
                self._writer.shutdown(wait=True)
                self._writer = None

    def attach(self, module: nn.Module, inner_optimizer: torch.optim.Optimizer) -> ObjectStoreDiLoCoCallback:
        """Open the store, check the run directory, and take the newest global state if the run has one."""
        if self.store is not None:
            return self
        c = self.config
        url = c.store or self.replica.store or os.environ.get(_env.ENV_STORE)
        get_transport(self.transport).require(c, url)
        assert url is not None
        self.run_id = c.run_id or self.replica.run_id
        if not self.run_id:
            raise ConfigError(
                f"this replica does not know which run on {redact_url(url)} it belongs to (no diloco.run_id and no "
                f"${_env.ENV_RUN_ID}). HINT: `composer-plugins diloco` sets it; a replica started by hand must name "
                "the run: -S diloco.run_id=<id> (see run.json in the store for the id of a run to join).",
                key="diloco.run_id",
            )
        self._module, self._inner = module, inner_optimizer
        self.fragments = split_fragments(module, 1)
        self.params = list(self.fragments[0].parameters())
        # the outer optimizer steps the global weights themselves (leaf tensors that need no autograd), so an
        # outer step in the background (``overlap: 1``) never touches the weights the inner steps train
        self.global_params = [nn.Parameter(p.detach().clone(), requires_grad=False) for p in self.params]
        self.outer_optimizers = [build_outer_optimizer(c, self.global_params)]
        self.store = ObjectStore(url, retry_s=c.store_retry_s, request_timeout_s=c.request_timeout_s)
        self.rounds = RoundStore(self.store, self.run_id)
        self._probe_conditional_create()
        self._check_run()
        found = self.rounds.newest_valid_state()
        if found is not None:
            self._apply_state(*found)
            log.info("DiLoCo: replica %d starts from %s/state/%08d", self.replica.index, self.store.where, found[0])
        self._replay_closed_rounds()
        if found is not None:  # restarted into a round the others are in: take only the steps they have left
            self._align_to_others()
        if self._target is not None and self.round >= self._target:
            self._done = True
        self._counted = (self.store.bytes_written, self.store.bytes_read, self.store.retries)
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
        log.info(
            "DiLoCo replica %s (%d/%d) on store %s (run %s): H=%d, compress=%s, %d params",
            self.replica.replica_id,
            self.replica.index,
            self.replica.num_replicas,
            self.store.where,
            self.run_id,
            c.sync_every,
            c.compress,
            sum(p.numel() for p in self.params),
        )
        return self

    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._inner_steps += 1
        if self._done:  # restarted after the run's last round: hold the final global weights
            with torch.no_grad():
                for p, g in zip(self.params, self.global_params, strict=True):
                    p.copy_(g)
            self._stop = True
            if self._trainer is not None:
                self._trainer.should_stop = True
            return
        self._since_sync += 1
        if self._since_sync < self.config.sync_every:
            return
        self._since_sync = 0
        self._sync()

    def _sync(self) -> None:
        assert self.rounds is not None and self.store is not None
        self._raise_write_error()
        t0 = time.perf_counter()
        if self._overlapped is not None:  # overlap: 1 -- the previous round's sync, applied one round late
            self._finish_overlapped()
        r = self.round
        last = self._target is not None and r + 1 >= self._target
        if self.config.overlap and not last:  # the background job looks for the round's manifest itself
            self._launch_overlapped(r, t0)
            return
        manifest = self.rounds.manifest(r)
        if manifest is not None:  # closed without this replica (late): catch up in the foreground
            self._settle(r, manifest, False, None, None, None, t0)
            return
        mine_name, mine, err = self._publish(r)
        manifest, created = self._close(r, self.replica.index, mine_name)
        self._settle(r, manifest, created, mine_name, mine, err, t0)

    def _publish(self, r: int, params: list[torch.Tensor] | None = None) -> tuple[str | None, torch.Tensor, float]:
        """Write this replica's pseudo-gradient of round ``r`` from ``params`` (default: the model's; ``init_sync``
        first at round 0): ``(name or None when not finite, the values the others read, compression error)``."""
        assert self.rounds is not None
        c = self.config
        if params is None and r == 0 and c.init_sync and self.replica.num_replicas > 1:
            self._init_sync()
        with torch.no_grad():
            pairs = zip(self.global_params, params if params is not None else self.params, strict=True)
            pseudo = torch.cat([to_host(g - p.detach()).reshape(-1) for g, p in pairs])
        codec = get_codec(c.compress)
        if self._residual is not None:  # error feedback: what the last round's rounding left out (decayed)
            decay = float(getattr(codec, "feedback_decay", 1.0))
            pseudo = pseudo + (self._residual if decay == 1.0 else decay * self._residual)
        try:
            parts, mine = encode_slices(pseudo, c.compress, self.replica.num_replicas)
        except CodecError as e:  # tell the others first, so they close the round without waiting for this one
            self.rounds.put_refused(r, self.replica.index, f"stopped: {e}")
            raise
        err = float((mine - pseudo).norm() / pseudo.norm().clamp_min(1e-30)) if c.compress != "none" else 0.0
        if codec.error_feedback:
            self._residual = pseudo - mine
        if not bool(torch.isfinite(mine).all()):
            log.error("DiLoCo round %d: this replica's pseudo-gradient is not finite; not published (left out)", r)
            self.rounds.put_refused(r, self.replica.index, "its pseudo-gradient is not finite")
            return None, mine, err
        name, nbytes = self.rounds.put_grad(r, self.replica.index, self.replica.restart, parts)
        self.bytes_pseudograd += nbytes
        return name, mine, err

    def _settle(
        self,
        r: int,
        manifest: dict[str, Any],
        created: bool,
        mine_name: str | None,
        mine: torch.Tensor | None,
        err: float | None,
        t0: float,
    ) -> None:
        """Apply round ``r`` in the foreground (or catch up when left out of it) and record it."""
        committed = mine_name is not None and manifest["grads"].get(str(self.replica.index)) == mine_name
        if committed and self._apply_round(r, manifest, mine, mix_local=True):
            if created and self._state_due(r):
                self._write_state_async()
                if self._target is not None and self.round >= self._target:
                    self._flush_writes()  # the last round: no inner steps left to overlap, and it is counted here
        else:
            committed = False
            self._catch_up(r, manifest)
        self._record(r, committed, len(manifest["participants"]), err, time.perf_counter() - t0)

    def _launch_overlapped(self, r: int, t0: float) -> None:
        """``overlap: 1``: snapshot the weights and sync round ``r`` on the global weights in a background thread
        (docs/diloco.md, "overlap: 1"); ``init_sync`` (round 0) stays in the foreground."""
        me = self.replica.index
        c = self.config
        if r == 0 and c.init_sync and self.replica.num_replicas > 1:
            self._init_sync()
        snapshot = [p.detach().clone() for p in self.params]
        result: dict[str, Any] = {}
        want_hash = bool((c.sync_log or self.replica.sync_log) and c.log_param_hash)

        def job() -> tuple[dict[str, Any], bool]:
            assert self.rounds is not None
            closed = self.rounds.manifest(r)
            if closed is not None:  # closed without this replica (late): caught up at the next sync
                return closed, False
            times = result["background_s"] = {}
            t, cpu = time.perf_counter(), time.thread_time()
            mine_name, mine, result["err"] = self._publish(r, snapshot)
            times["publish"], t = time.perf_counter() - t, time.perf_counter()
            manifest, created = self._close(r, me, mine_name)
            times["close"], t = time.perf_counter() - t, time.perf_counter()
            committed = mine_name is not None and manifest["grads"].get(str(me)) == mine_name
            if not (committed and self._apply_round(r, manifest, mine, mix_local=False, live=False)):
                return manifest, False
            if want_hash:  # the global weights this round produced (untouched until the next job)
                result["digest"] = param_digest(self.global_params)
            times["mean_and_outer_step"], t = time.perf_counter() - t, time.perf_counter()
            if created and self._state_due(r):
                self._put_state(r)()
                if self.config.keep_rounds:
                    self.rounds.collect_garbage(r, self.config.keep_rounds)
                times["state"] = time.perf_counter() - t
            times["cpu"] = time.thread_time() - cpu  # this thread's CPU time for the round (the rest is waiting)
            return manifest, True

        if self._background is None:
            self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diloco-overlap")
        self._overlapped = (r, self._background.submit(job), snapshot, result, time.perf_counter() - t0)

    @torch.no_grad()
    def _finish_overlapped(self) -> None:
        """Wait for the background sync of round ``r`` and apply it one round late (``θ ← θ_global + θ − θ_snapshot``),
        or catch up when left out of it."""
        assert self._overlapped is not None
        r, future, snapshot, result, launch_s = self._overlapped
        self._overlapped = None
        t0 = time.perf_counter()
        manifest, committed = future.result()
        if committed:
            for p, g, s in zip(self.params, self.global_params, snapshot, strict=True):
                p.add_(g - s)
        else:
            self._catch_up(r, manifest)
        self._record(
            r,
            committed,
            len(manifest["participants"]),
            result.get("err"),
            launch_s + time.perf_counter() - t0,
            digest=result.get("digest") if committed else None,
            background=result.get("background_s"),
        )

    def _record(
        self,
        r: int,
        committed: bool,
        participants: int,
        err: float | None,
        seconds: float,
        digest: tuple[str, float] | None = None,
        background: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        assert self.store is not None
        # since the last record: the state written in the background after a sync counts in the next one
        w0, r0, n0 = self._counted
        self._counted = (self.store.bytes_written, self.store.bytes_read, self.store.retries)
        written, read, retries = self._counted[0] - w0, self._counted[1] - r0, self._counted[2] - n0
        states, self._states_counted = self.bytes_states - self._states_counted, self.bytes_states
        kinds = dict(self.rounds.bytes_by_kind) if self.rounds is not None else {}
        by_kind = {k: n - self._kinds_counted.get(k, 0) for k, n in kinds.items()}
        self._kinds_counted = kinds
        rec = self._sync_record(self.round, committed, participants, 0)
        rec |= {
            "transport": self.transport,
            "round": r,
            "bytes_written": written,
            "bytes_read": read,
            "bytes_states": states,
            "bytes_by_kind": by_kind,  # docs/diloco.md, "Sync log"
            "compress_error": err,
            "sync_seconds": seconds,
            "store_retries": retries,
        }
        if background is not None:  # overlap: 1 -- where the background sync's time went (publish, close, ...)
            rec["background_s"] = background
        if (self._target is not None and self.round >= self._target) or self.stop_file_says_stop(self.round):
            self._stop = True
        rec["writes_checkpoint"] = False
        if self.config.overlap and not self._stop:
            # with overlap: 1 the model carries its own steps since the last snapshot: the global weights are synced
            # (the background job hashed them already, ``digest``, unless this round was caught up here)
            self._keep_sync(rec, self.global_params, digest)
        else:
            self._keep_sync(rec)
        return rec
