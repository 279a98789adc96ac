"""DiLoCo whose outer sync travels through an object store (``diloco.transport: object_store``).

Replicas never talk to each other: the store (``diloco.store``, an S3/GCS/Azure prefix or ``file://``) is
their only meeting point, so they can run as serverless jobs in places that cannot open ports to each
other. Layout of the run directory::

    run.json                          who the run is (run id, replicas, parameter shapes); a second run is refused
    init                              replica 0's state at the first sync (``init_sync``: everyone starts from it)
    rounds/<r>/grad-<i>-<restart>     replica i's pseudo-gradient for round r (codec + SHA-256)
    rounds/<r>/manifest.json          the participants of round r, created once (If-None-Match)
    state/<r>                         the global weights and outer optimizer state after round r

A round, on every replica: write the pseudo-gradient (``global - local``, encoded with ``diloco.compress``);
wait until every replica's is there or ``diloco.round_timeout_s`` has passed; then the first replica to try
creates the round manifest, listing the pseudo-gradients it read intact (a torn or corrupt one fails its
checksum and counts as missing). The create is conditional, so there is exactly one manifest per round and
every replica averages exactly the set it names, in index order, and applies the same outer step
(:func:`~composer_plugins.diloco.common.build_outer_optimizer`, the torchft path's optimizer; the same
restore / ``grad`` / ``step`` / ``lerp`` sequence as ``torchft.local_sgd``). The replica that created the
manifest writes the new global state.

Faults: a replica that missed the deadline (the manifest exists without it) drops its local steps and
loads the newest global state; a replica the launcher restarted loads it before training and reports
``"healed": true`` at its first sync; store errors are retried with bounded backoff
(:class:`~composer_plugins.diloco.store.ObjectStore`). With ``init_sync`` (default) the first round
reproduces torchft's: every replica takes replica 0's model and inner-optimizer state at the first sync,
so without faults an ``object_store`` run equals a ``torchft`` run of the same config and seeds.

The sync log has the torchft path's fields (``outer_step``, ``committed``, ``participants``, ``healed``,
``param_hash`` ...) plus ``transport``, ``bytes_written``, ``bytes_read``, ``compress_error``,
``sync_seconds`` and ``store_retries`` (store requests retried during the sync).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from composer_plugins.core.errors import ComposerPluginsError, ConfigError
from composer_plugins.diloco import launch as _launch
from composer_plugins.diloco.common import (
    DiLoCoConfig,
    ReplicaInfo,
    build_outer_optimizer,
    param_digest,
    split_fragments,
    stop_file_says_stop,
)
from composer_plugins.diloco.store import (
    CorruptObjectError,
    ObjectStore,
    decode_vector,
    encode_vector,
    pack,
    unpack,
)

log = logging.getLogger(__name__)

__all__ = ["ObjectStoreDiLoCoCallback", "RoundStore"]

_GRAD = re.compile(r"grad-(\d+)-(\d+)$")


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _torch_load(body: bytes) -> Any:
    return torch.load(io.BytesIO(body), weights_only=False)


class RoundStore:
    """The run directory's objects, read and written with checksums (see the module docstring)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @staticmethod
    def round_dir(r: int) -> str:
        return f"rounds/{r:08d}"

    # -- pseudo-gradients -------------------------------------------------------------
    def put_grad(self, r: int, index: int, restart: int, header: dict[str, Any], body: bytes) -> int:
        data = pack({**header, "round": r, "replica": index, "restart": restart}, body)
        self.store.put(f"{self.round_dir(r)}/grad-{index}-{restart}", data, create=True)
        return len(data)

    def grads_present(self, r: int) -> dict[int, str]:
        """``{replica: key}`` of the pseudo-gradients written for round ``r`` (the newest restart of each)."""
        best: dict[int, tuple[int, str]] = {}
        for key in self.store.list(self.round_dir(r)):
            m = _GRAD.search(key)
            if m:
                i, restart = int(m.group(1)), int(m.group(2))
                if i not in best or restart > best[i][0]:
                    best[i] = (restart, key.rsplit("/", 1)[1])
        return {i: name for i, (_, name) in best.items()}

    def read_grad(self, r: int, name: str) -> torch.Tensor | None:
        """The decoded pseudo-gradient ``name`` of round ``r``; ``None`` if missing, torn or corrupt."""
        data = self.store.get(f"{self.round_dir(r)}/{name}")
        if data is None:
            return None
        try:
            header, body = unpack(data, f"{self.store.url}/{self.round_dir(r)}/{name}")
            return decode_vector(header, body)
        except (CorruptObjectError, ValueError, KeyError) as e:
            log.warning("round %d: %s; treated as missing", r, e)
            return None

    # -- the manifest -----------------------------------------------------------------
    def manifest(self, r: int) -> dict[str, Any] | None:
        data = self.store.get(f"{self.round_dir(r)}/manifest.json")
        if data is None:
            return None
        _, body = unpack(data, f"{self.store.url}/{self.round_dir(r)}/manifest.json")
        return json.loads(body)

    def close_round(self, r: int, grads: dict[int, str], closer: int) -> tuple[dict[str, Any], bool]:
        """Create round ``r``'s manifest naming ``grads`` unless one exists; ``(manifest, created)``."""
        m = {"round": r, "participants": sorted(grads), "grads": {str(i): n for i, n in sorted(grads.items())},
             "closed_by": closer, "time": time.time()}  # fmt: skip
        key = f"{self.round_dir(r)}/manifest.json"
        if self.store.put(key, pack({"kind": "manifest"}, json.dumps(m).encode()), create=True):
            return m, True
        existing = self.manifest(r)
        if existing is None:  # pragma: no cover - a store that lost an object it said exists
            raise ComposerPluginsError(f"{self.store.url}/{key} exists but cannot be read")
        # our own create, whose answer was lost (a dropped connection) and whose retry found it there
        return existing, existing == m

    # -- states -----------------------------------------------------------------------
    def put_state(self, key: str, state: dict[str, Any], create: bool = True) -> int:
        data = pack({"kind": key.split("/")[0]}, _torch_bytes(state))
        self.store.put(key, data, create=create)
        return len(data)

    def get_state(self, key: str) -> dict[str, Any] | None:
        data = self.store.get(key)
        if data is None:
            return None
        try:
            _, body = unpack(data, f"{self.store.url}/{key}")
        except CorruptObjectError as e:
            log.warning("%s; treated as missing", e)
            return None
        return _torch_load(body)

    def latest_state_round(self) -> int | None:
        rounds = [int(k.rsplit("/", 1)[1]) for k in self.store.list("state") if k.rsplit("/", 1)[1].isdigit()]
        return max(rounds) if rounds else None


class ObjectStoreDiLoCoCallback(pl.Callback):
    """One DiLoCo replica whose outer sync goes through an object store (see the module docstring).

    Add it to a single-optimizer Lightning run in every replica process, as :class:`DiLoCoCallback`;
    outside Lightning call :meth:`attach` with the model and the inner optimizer.
    """

    transport = "object_store"

    def __init__(self, config: DiLoCoConfig | None = None, replica: ReplicaInfo | None = None) -> None:
        super().__init__()
        self.config = (config or DiLoCoConfig(transport="object_store")).validate()
        self.replica = replica or ReplicaInfo.from_env()
        self.history: list[dict[str, Any]] = []
        self.heal_count = 0
        self.store: ObjectStore | None = None
        self.rounds: RoundStore | None = None
        self.fragments: list[nn.Module] = []
        self.outer_optimizers: list[torch.optim.Optimizer] = []
        self.params: list[nn.Parameter] = []
        self.global_params: list[torch.Tensor] = []
        self.round = 0  # the next round to sync; == outer steps applied so far
        self._module: nn.Module | None = None
        self._inner: torch.optim.Optimizer | None = None
        self._trainer: pl.Trainer | None = None
        self._hook: Any = None
        self._inner_steps = 0
        self._since_sync = 0
        self._healed_since_sync = False
        self._target: int | None = self.config.outer_steps
        self._stop = False
        self._done = False
        self.bytes_pseudograd = 0

    # -- public state ---------------------------------------------------------------------
    @property
    def outer_step(self) -> int:
        return self.round

    @property
    def bytes_allreduced(self) -> int:
        """Bytes of pseudo-gradients this replica wrote (the torchft path's counter of the same name)."""
        return self.bytes_pseudograd

    @property
    def inner_steps(self) -> int:
        return self._inner_steps

    # -- Lightning hooks ----------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ComposerPluginsError(
                f"DiLoCo needs exactly one optimizer; {type(pl_module).__name__}.configure_optimizers returned "
                f"{len(trainer.optimizers)}. HINT: return a single optimizer (parameter groups are fine)."
            )
        self._trainer = trainer
        if self._target is None and trainer.max_steps and trainer.max_steps > 0:
            self._target = max(1, trainer.max_steps // self.config.sync_every)
            # the shared round counter decides when to stop; a replica left out of a round makes it up
            trainer.fit_loop.epoch_loop.max_steps = 2 * trainer.max_steps
        self.attach(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if self.history:
            last = self.history[-1]
            pl_module.log_dict({"diloco/outer_step": float(last["outer_step"]),
                                "diloco/participants": float(last["participants"]),
                                "diloco/bytes_allreduced": float(self.bytes_allreduced)},
                               on_step=True, on_epoch=False, batch_size=1)  # fmt: skip
        if self._stop:
            trainer.should_stop = True

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.close()

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # -- wiring ---------------------------------------------------------------------------
    def attach(self, module: nn.Module, inner_optimizer: torch.optim.Optimizer) -> ObjectStoreDiLoCoCallback:
        """Open the store, check the run directory, and (after a restart) load the newest global state."""
        if self.store is not None:
            return self
        c = self.config
        url = c.store or self.replica.store or os.environ.get(_launch.ENV_STORE)
        if not url:
            raise ConfigError("diloco.transport=object_store needs a store. HINT: -S diloco.store=s3://bucket/run "
                              "(or file:///abs/path).", key="diloco.store")  # fmt: skip
        self._module, self._inner = module, inner_optimizer
        self.fragments = split_fragments(module, 1)
        self.params = list(self.fragments[0].parameters())
        self.outer_optimizers = [build_outer_optimizer(c, self.params)]
        self.global_params = [p.detach().clone() for p in self.params]
        self.store = ObjectStore(url, retry_s=c.store_retry_s)
        self.rounds = RoundStore(self.store)
        self._check_run()
        if self.replica.restart > 0:
            k = self.rounds.latest_state_round()
            if k is not None:
                self._load_state(k)
                log.info("DiLoCo: restarted replica %d healed from %s state/%08d", self.replica.index, url, k)
            if self._target is not None and self.round >= self._target:
                self._done = True
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
        log.info("DiLoCo replica %s (%d/%d) on store %s: H=%d, compress=%s, %d params", self.replica.replica_id,
                 self.replica.index, self.replica.num_replicas, self.store.url, c.sync_every, c.compress,
                 sum(p.numel() for p in self.params))  # fmt: skip
        return self

    def _run_identity(self) -> dict[str, Any]:
        shapes = [list(p.shape) for p in self.params]
        return {"run_id": self.replica.run_id, "num_replicas": self.replica.num_replicas,
                "sync_every": self.config.sync_every, "compress": self.config.compress,
                "param_shapes": shapes}  # fmt: skip

    def _check_run(self) -> None:
        """Claim the run directory (``run.json``) or check that it holds this run; refuse another run's."""
        assert self.store is not None
        mine = self._run_identity()
        self.store.put("run.json", pack({"kind": "run"}, json.dumps(mine).encode()), create=True)
        data = self.store.get("run.json")
        try:
            theirs = json.loads(unpack(data or b"", f"{self.store.url}/run.json")[1])
        except CorruptObjectError as e:
            raise ConfigError(f"{e}: the run directory is damaged. HINT: point diloco.store at a fresh prefix.",
                              key="diloco.store") from e  # fmt: skip
        diff = [k for k in mine if theirs.get(k) != mine[k]]
        if diff:
            what = ", ".join(f"{k}: {theirs.get(k)!r} there, {mine[k]!r} here" for k in diff if k != "param_shapes")
            if "param_shapes" in diff:
                what += ("; " if what else "") + "another model (parameter shapes differ)"
            raise ConfigError(
                f"{self.store.url} holds another run ({what}). HINT: give this run a fresh prefix, e.g. "
                f"diloco.store={self.store.url.rsplit('/', 1)[0]}/<new-run>, or delete the old one.",
                key="diloco.store",
            )

    # -- state ----------------------------------------------------------------------------
    def _global_state(self) -> dict[str, Any]:
        return {"round": self.round, "global_params": [g.clone() for g in self.global_params],
                "outer_optimizers": [o.state_dict() for o in self.outer_optimizers]}  # fmt: skip

    def _load_state(self, k: int) -> None:
        assert self.rounds is not None
        state = self.rounds.get_state(f"state/{k:08d}")
        if state is None:
            raise ComposerPluginsError(f"{self.rounds.store.url}/state/{k:08d} is missing or corrupt")
        with torch.no_grad():
            for g, p, saved in zip(self.global_params, self.params, state["global_params"], strict=True):
                g.copy_(saved)
                p.copy_(saved)
        for opt, sd in zip(self.outer_optimizers, state["outer_optimizers"], strict=True):
            opt.load_state_dict(sd)
        self.round = k + 1
        self.heal_count += 1
        self._healed_since_sync = True

    def _replica_state(self) -> dict[str, Any]:
        assert self._module is not None and self._inner is not None
        scheds = [cfg.scheduler.state_dict() for cfg in self._trainer.lr_scheduler_configs] if self._trainer else []
        return {"model": self._module.state_dict(), "inner_optimizer": self._inner.state_dict(),
                "lr_schedulers": scheds, "global_params": [g.clone() for g in self.global_params]}  # fmt: skip

    def _init_sync(self) -> None:
        """Round 0 with ``init_sync``: replica 0 publishes its state; the others take it (as torchft heals)."""
        assert self.rounds is not None and self._module is not None and self._inner is not None
        if self.replica.index == 0:
            self.rounds.put_state("init", self._replica_state(), create=False)
            return
        deadline = time.monotonic() + self.config.round_timeout_s
        while (state := self.rounds.get_state("init")) is None:
            if time.monotonic() > deadline:
                log.warning("DiLoCo: no init state from replica 0 within %.0fs; starting from my own weights",
                            self.config.round_timeout_s)  # fmt: skip
                return
            time.sleep(self.config.poll_s)
        self._module.load_state_dict(state["model"])
        self._inner.load_state_dict(state["inner_optimizer"])
        if self._trainer is not None:
            for cfg, sd in zip(self._trainer.lr_scheduler_configs, state["lr_schedulers"], strict=False):
                cfg.scheduler.load_state_dict(sd)
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global_params"], strict=True):
                g.copy_(saved)
        self.heal_count += 1
        self._healed_since_sync = True

    # -- the round ------------------------------------------------------------------------
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
        c, rs, me = self.config, self.rounds, self.replica.index
        t0 = time.perf_counter()
        w0, r0, n0 = self.store.bytes_written, self.store.bytes_read, self.store.retries
        r = self.round
        err = None
        manifest = rs.manifest(r)
        if manifest is None:
            if r == 0 and c.init_sync and self.replica.num_replicas > 1 and self.replica.restart == 0:
                self._init_sync()
            with torch.no_grad():
                pseudo = torch.cat([(g - p.detach()).reshape(-1) for g, p in zip(self.global_params, self.params,
                                                                                  strict=True)])  # fmt: skip
            header, body = encode_vector(pseudo, c.compress)
            mine = decode_vector(header, body)  # what the others will read: average exactly that
            err = float((mine - pseudo).norm() / pseudo.norm().clamp_min(1e-30)) if c.compress != "none" else 0.0
            self.bytes_pseudograd += rs.put_grad(r, me, self.replica.restart, header, body)
            manifest, created, cache = self._close(r, me, mine)
        else:
            created, cache = False, {}
        participants = list(manifest["participants"])
        committed = me in participants and manifest["grads"].get(str(me)) == f"grad-{me}-{self.replica.restart}"
        if committed:
            total: torch.Tensor | None = None
            for i in participants:
                vec = cache.get(i)
                if vec is None:
                    vec = rs.read_grad(r, manifest["grads"][str(i)])
                if vec is None:
                    raise ComposerPluginsError(f"round {r}: replica {i}'s pseudo-gradient, listed in the manifest, "
                                               f"is unreadable in {self.store.url}")  # fmt: skip
                total = vec.clone() if total is None else total.add_(vec)
            assert total is not None
            self._outer_step(total.div_(len(participants)))
            self.round = r + 1
            if created:
                rs.put_state(f"state/{r:08d}", self._global_state())
        else:
            self._catch_up(r)
        self._record(r, committed, len(participants), err, time.perf_counter() - t0,
                     self.store.bytes_written - w0, self.store.bytes_read - r0, self.store.retries - n0)  # fmt: skip
        if self._trainer is not None and self._stop:
            self._trainer.should_stop = True

    def _close(self, r: int, me: int, mine: torch.Tensor) -> tuple[dict[str, Any], bool, dict[int, torch.Tensor]]:
        """Wait for the others' pseudo-gradients (up to the deadline), then close the round or read its manifest."""
        assert self.rounds is not None
        c, rs = self.config, self.rounds
        deadline = time.monotonic() + c.round_timeout_s
        mine_name = f"grad-{me}-{self.replica.restart}"
        cache: dict[int, torch.Tensor] = {}
        while True:
            m = rs.manifest(r)
            if m is not None:
                return m, False, cache
            present = rs.grads_present(r)
            if len(present) >= self.replica.num_replicas or time.monotonic() > deadline:
                good: dict[int, str] = {}
                for i, name in present.items():
                    if i == me and name == mine_name:
                        cache[i], good[i] = mine, name
                        continue
                    vec = rs.read_grad(r, name)
                    if vec is not None and vec.numel() == mine.numel():
                        cache[i], good[i] = vec, name
                missing = sorted(set(range(self.replica.num_replicas)) - set(good))
                if missing:
                    log.warning("DiLoCo round %d: closing without replica(s) %s (missing, late or corrupt)", r,
                                missing)  # fmt: skip
                m, created = rs.close_round(r, good, me)
                if not created:  # another replica closed it first: its set, its grads
                    cache = {i: v for i, v in cache.items() if m["grads"].get(str(i)) == good.get(i)}
                return m, created, cache
            time.sleep(c.poll_s)

    @torch.no_grad()
    def _outer_step(self, avg: torch.Tensor) -> None:
        """The outer step torchft's ``_StreamingDiLoCoFragment.perform_sync`` applies, on the averaged vector."""
        local = [p.detach().clone() for p in self.params]
        off = 0
        for p, g in zip(self.params, self.global_params, strict=True):
            p.copy_(g)  # restore the global weights
            n = p.numel()
            p.grad = avg[off : off + n].view_as(p).clone()
            off += n
        opt = self.outer_optimizers[0]
        opt.step()
        for p, g, loc in zip(self.params, self.global_params, local, strict=True):
            g.copy_(p)
            p.lerp_(loc, self.config.fragment_update_alpha)
        opt.zero_grad()

    def _catch_up(self, r: int) -> None:
        """Left out of round ``r``: drop the local steps and load the newest global state (>= ``r``)."""
        assert self.rounds is not None
        deadline = time.monotonic() + self.config.round_timeout_s
        while True:
            k = self.rounds.latest_state_round()
            if k is not None and k >= r:
                log.warning("DiLoCo: left out of round %d (late); catching up from state/%08d", r, k)
                self._load_state(k)
                return
            if time.monotonic() > deadline:
                raise ComposerPluginsError(
                    f"round {r} closed without this replica but no global state for it appeared in "
                    f"{self.rounds.store.url}/state within diloco.round_timeout_s={self.config.round_timeout_s:.0f}s"
                )
            time.sleep(self.config.poll_s)

    def _record(self, r: int, committed: bool, participants: int, err: float | None, seconds: float, written: int,
                read: int, retries: int) -> dict[str, Any]:  # fmt: skip
        c = self.config
        rec: dict[str, Any] = {
            "replica": self.replica.index,
            "replica_id": self.replica.replica_id,
            "restart": self.replica.restart,
            "outer_step": self.round,
            "inner_step": self._inner_steps,
            "committed": committed,
            "participants": participants,
            "fragment": 0,
            "healed": self._healed_since_sync,
            "bytes_allreduced": self.bytes_allreduced,
            "time": time.time(),
            "transport": self.transport,
            "round": r,
            "bytes_written": written,
            "bytes_read": read,
            "compress_error": err,
            "sync_seconds": seconds,
            "store_retries": retries,
        }
        self._healed_since_sync = False
        if self._target is not None and self.round >= self._target:
            self._stop = True
        if stop_file_says_stop(c.stop_file or self.replica.stop_file, self.round):
            self._stop = True
        rec["writes_checkpoint"] = False
        rec["stop"] = self._stop
        sync_log = c.sync_log or self.replica.sync_log
        if sync_log and c.log_param_hash:
            # the synced (trainable) weights: a frozen EMA hint teacher is per-replica local state
            synced = (p for p in self._module.parameters() if p.requires_grad)  # type: ignore[union-attr]
            rec["param_hash"], rec["param_sum"] = param_digest(synced)
            rec["fragment_hash"] = rec["param_hash"]
        self.history.append(rec)
        if sync_log:
            with open(sync_log, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec
