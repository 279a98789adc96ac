"""DiLoCo for the Lightning training loop, built on torchft (``torchft.local_sgd.DiLoCo``): the ``torchft``
transport's callback (:class:`DiLoCoCallback`). The all-reduce, the outer step, streaming fragments and the
rollback of a failed sync are torchft's own; this module only wires them into Lightning.

Why a callback, fault tolerance, checkpoints and the sync log: docs/diloco.md ("Design: a callback, not a
strategy", "Fault tolerance", "Sync log").
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from composer_plugins.core.errors import ComposerPluginsError, ConfigError
from composer_plugins.diloco import coordination as _coordination
from composer_plugins.diloco import env as _env
from composer_plugins.diloco.common import (
    DiLoCoConfig,
    ReplicaInfo,
    build_outer_optimizer,
    split_fragments,
)
from composer_plugins.diloco.glue import DiLoCoCallbackBase

log = logging.getLogger(__name__)

__all__ = ["DiLoCoCallback", "make_process_group"]


def make_process_group(timeout: timedelta) -> Any:
    """A ``torchft.ProcessGroupGloo`` that also counts the bytes it all-reduces (``.bytes_allreduced``)."""
    from torchft.process_group import ProcessGroupGloo

    class CountingProcessGroupGloo(ProcessGroupGloo):
        bytes_allreduced: int = 0
        allreduce_calls: int = 0

        def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
            self.bytes_allreduced += sum(t.numel() * t.element_size() for t in tensors)
            self.allreduce_calls += 1
            return super().allreduce(tensors, opts)

    return CountingProcessGroupGloo(timeout=timeout)


def _wait_barrier(address: str, index: int, timeout_s: float) -> dict[int, str]:
    """Meet the other first-generation replicas at the launcher's start barrier (as replica ``index``); the
    replicas that exited before arriving, logged (docs/diloco.md, "Fault tolerance", "Start-up")."""
    from torch.distributed import TCPStore

    from composer_plugins.diloco.rendezvous import RendezvousError, StoreRendezvous

    host, _, port = address.rpartition(":")
    store = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    rendezvous = StoreRendezvous(store, None, name=_coordination.StartBarrier.NAME, what="replica")
    try:
        gone = rendezvous.wait(index, timeout_s, allow_gone=True)
    except RendezvousError as e:
        log.warning("start barrier: %s; going on without them", e)
        return {}
    for m, reason in sorted(gone.items()):
        log.warning("start barrier: replica %d %s before arriving; going on without it", m, reason)
    return gone


# -- the callback ---------------------------------------------------------------------------


class DiLoCoCallback(DiLoCoCallbackBase):
    """Turn a single-optimizer Lightning run into one DiLoCo replica (torchft ``Manager`` + ``DiLoCo``).

    The launcher's environment says which replica this is; outside Lightning, :meth:`attach` then :meth:`close`.
    After the first sync: ``outer_step`` (torchft step), ``num_participants``, ``bytes_allreduced``, ``history``.
    """

    transport = "torchft"

    def __init__(self, config: DiLoCoConfig | None = None, replica: ReplicaInfo | None = None) -> None:
        super().__init__(config, replica)
        self.manager: Any = None
        self.diloco: Any = None
        self.process_group: Any = None
        self._store: Any = None
        self._last_step = 0
        self._checkpoint_due: int | None = None
        self._resume: dict[str, Any] | None = None
        self._board: _coordination.RejoinBoard | None = None
        self._pre_hook: Any = None
        self._deferred_since: float | None = None

    # -- public state ------------------------------------------------------------------
    @property
    def outer_step(self) -> int:
        return int(self.manager.current_step()) if self.manager is not None else 0

    @property
    def num_participants(self) -> int:
        return int(self.manager.num_participants()) if self.manager is not None else 0

    @property
    def bytes_allreduced(self) -> int:
        return int(getattr(self.process_group, "bytes_allreduced", 0))

    # -- Lightning hooks ---------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return self.manager is not None

    def after_batch(self, trainer: pl.Trainer) -> None:
        if self._checkpoint_due is not None:
            step, self._checkpoint_due = self._checkpoint_due, None
            assert self.config.checkpoint_dir is not None
            path = Path(self.config.checkpoint_dir) / f"diloco-outer{step:06d}.ckpt"
            path.parent.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(str(path))
            if self.history:
                self.history[-1]["checkpoint"] = str(path)

    def state_dict(self) -> dict[str, Any]:
        """Checkpointed with the run: torchft step, global weights and outer optimizer state."""
        if self.manager is None:
            return {}
        # torchft keeps the last global weights per fragment in ``original_parameters``.
        global_params = [
            {k: v.detach().clone() for k, v in getattr(frag, "original_parameters", {}).items()}
            for frag in getattr(self.diloco, "_fragments", [])
        ]
        return {
            "manager": dict(self.manager.state_dict()),
            "outer_optimizers": [o.state_dict() for o in self.outer_optimizers],
            "global_params": global_params,
            "inner_steps": self._inner_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict) if state_dict else None
        if self.manager is not None and self._resume:
            self._apply_resume()

    # -- wiring --------------------------------------------------------------------------
    def attach(self, module: nn.Module, inner_optimizer: torch.optim.Optimizer) -> DiLoCoCallback:
        """Create the torchft manager and ``DiLoCo`` around ``module`` and its ``inner_optimizer``."""
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.local_sgd import DiLoCo

        if self.manager is not None:
            return self
        c = self.config
        lighthouse = c.lighthouse or self.replica.lighthouse or os.environ.get(_env.ENV_LIGHTHOUSE)
        if not lighthouse:
            raise ConfigError(
                "no torchft lighthouse address. HINT: start replicas with `composer-plugins diloco --replicas N`, "
                f"or set diloco.lighthouse / ${_env.ENV_LIGHTHOUSE} to a running `torchft_lighthouse`.",
                key="diloco.lighthouse",
            )
        # torchft warns on every quorum that it cannot reset the NCCL flight recorder (CPU runs); keep errors.
        logging.getLogger("torchft.manager").setLevel(logging.ERROR)
        self._module, self._inner = module, inner_optimizer
        timeout = timedelta(seconds=c.timeout_s)
        self._store = TCPStore(c.store_host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self.process_group = make_process_group(timeout)
        transport = None
        if c.checkpoint_transport == "pg":
            from torchft.checkpointing.pg_transport import PGTransport

            transport = PGTransport(self.process_group, timeout=timeout, device=next(module.parameters()).device)
        self.manager = Manager(
            pg=self.process_group,
            load_state_dict=self._load_replica_state,
            state_dict=self._replica_state,
            min_replica_size=c.min_replica_size,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=c.quorum_timeout_s),
            connect_timeout=timedelta(seconds=c.connect_timeout_s),
            rank=0,
            world_size=1,
            store_addr=c.store_host,
            store_port=self._store.port,
            lighthouse_addr=lighthouse,
            replica_id=self.replica.replica_id,
            hostname=c.hostname,
            checkpoint_transport=transport,
            init_sync=c.init_sync,
            max_retries=c.max_retries,
        )
        self.fragments = split_fragments(module, c.num_fragments)
        self.outer_optimizers = [build_outer_optimizer(c, f.parameters()) for f in self.fragments]
        self.diloco = DiLoCo(
            self.manager,
            self.fragments,
            inner_optimizer,
            self.outer_optimizers,
            sync_every=c.sync_every,
            pin_memory=False,
            use_bucketization=c.use_bucketization,
            bucket_cap_mb=c.bucket_cap_mb,
            fragment_sync_delay=c.fragment_sync_delay,
            fragment_update_alpha=c.fragment_update_alpha,
        )
        if self._resume:
            self._apply_resume()
        self.diloco.__enter__()
        # Registered after DiLoCo's own post-hook, so it runs right after a sync has happened.
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
        if self.replica.rejoin:
            self._board = _coordination.RejoinBoard.connect(self.replica.rejoin)
            self._pre_hook = inner_optimizer.register_step_pre_hook(self._before_inner_step)
        if self.replica.restart > 0:
            # its local steps are thrown away when it heals: ask for the quorum after one step, not H
            first = c.sync_every // c.num_fragments - c.fragment_sync_delay - 1
            self.diloco._local_step = first
            self._since_sync = first
            self._post("ready")
        if self.replica.barrier and self.replica.restart == 0 and self.replica.barrier_size > 1:
            _wait_barrier(self.replica.barrier, self.replica.index, c.barrier_timeout_s)
        log.info(
            "DiLoCo replica %s (%d/%d) on lighthouse %s: H=%d, fragments=%d, %d params",
            self.replica.replica_id,
            self.replica.index,
            self.replica.num_replicas,
            lighthouse,
            c.sync_every,
            c.num_fragments,
            sum(p.numel() for f in self.fragments for p in f.parameters()),
        )
        return self

    def close(self) -> None:
        """Remove the hooks and shut the torchft manager down (idempotent)."""
        for hook in (self._hook, self._pre_hook):
            if hook is not None:
                hook.remove()
        self._hook = self._pre_hook = None
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        if self.manager is not None:
            try:
                self.manager.shutdown(wait=False)
            except Exception as e:  # pragma: no cover - best effort on the way out
                log.warning("torchft manager shutdown: %s", e)
        self.manager = self.diloco = self._store = None

    # -- torchft state (live recovery) ----------------------------------------------------
    def _schedulers(self) -> list[Any]:
        t = self._trainer
        return [c.scheduler for c in t.lr_scheduler_configs] if t is not None else []

    def _replica_state(self) -> dict[str, Any]:
        assert self._module is not None and self._inner is not None
        return {
            "model": self._module.state_dict(),
            "inner_optimizer": self._inner.state_dict(),
            "lr_schedulers": [s.state_dict() for s in self._schedulers()],
            "progress": {"inner_steps": self._inner_steps, "replica": self.replica.index},
        }

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        assert self._module is not None and self._inner is not None
        self._module.load_state_dict(state["model"])
        self._inner.load_state_dict(state["inner_optimizer"])
        for sched, sd in zip(self._schedulers(), state.get("lr_schedulers", []), strict=False):
            sched.load_state_dict(sd)
        self._healed()
        # torchft set its step to the peers' step before calling us; a sync commits if it moves past it.
        self._last_step = int(self.manager.current_step())
        log.info("DiLoCo: healed from a peer at torchft step %d", self._last_step)
        if self.replica.restart > 0:
            self._post("joined", self._last_step)

    def _apply_resume(self) -> None:
        state, self._resume = self._resume, None
        if not state:
            return
        self.manager.load_state_dict(state["manager"])
        for opt, sd in zip(self.outer_optimizers, state.get("outer_optimizers", []), strict=False):
            opt.load_state_dict(sd)
        for frag, saved in zip(getattr(self.diloco, "_fragments", []), state.get("global_params", []), strict=False):
            orig = getattr(frag, "original_parameters", {})
            for k, v in saved.items():
                if k in orig:
                    orig[k].copy_(v)
        self._inner_steps = int(state.get("inner_steps", 0))
        self._last_step = int(self.manager.current_step())

    # -- a restarted peer's way back (the launcher's RejoinBoard) --------------------------
    def _post(self, state: str, detail: object = "") -> None:
        if self._board is not None:
            try:
                self._board.post(self.replica.index, state, self.replica.restart, detail)
            except Exception as e:  # the launcher is gone; nobody is waiting for this
                log.warning("DiLoCo: cannot post %r to the launcher's rejoin board: %s", state, e)

    def _returning_peers(self) -> dict[int, str]:
        """Peers the launcher restarted that have not healed yet (``{index: pending|ready}``)."""
        if self._board is None:
            return {}
        peers = [i for i in range(self.replica.num_replicas) if i != self.replica.index]
        try:
            return self._board.outstanding(peers)
        except Exception as e:
            log.warning("DiLoCo: cannot read the launcher's rejoin board: %s", e)
            return {}

    def _before_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Before the step whose sync would reach the target: wait (bounded) until no restarted peer is
        ``pending``, so it can ask for the quorum of that last sync (docs/diloco.md, "Fault tolerance")."""
        if self.diloco is None or self._target is None or self.replica.restart > 0:
            return
        c = self.config
        per = c.sync_every // c.num_fragments
        if self.diloco._local_step + 1 != per - c.fragment_sync_delay:
            return  # this step does not start a quorum
        if int(self.manager.current_step()) + 1 < self._target:
            return
        deadline = time.monotonic() + c.rejoin_timeout_s
        waiting = self._returning_peers()
        if any(s == "pending" for s in waiting.values()):
            log.info(
                "DiLoCo: waiting up to %.0fs for restarted replica(s) %s before the last sync",
                c.rejoin_timeout_s,
                sorted(waiting),
            )
        while any(s == "pending" for s in waiting.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            waiting = self._returning_peers()

    def _defer_stop(self, step: int) -> bool:
        """True while a restarted peer has not healed yet (at most ``rejoin_timeout_s`` after the target)."""
        waiting = self._returning_peers()
        if not waiting:
            return False
        now = time.monotonic()
        if self._deferred_since is None:
            self._deferred_since = now
            log.info(
                "DiLoCo: torchft step %d reached the target; training on until restarted replica(s) %s "
                "heal (at most %.0fs)",
                step,
                sorted(waiting),
                self.config.rejoin_timeout_s,
            )
        if now - self._deferred_since > self.config.rejoin_timeout_s:
            log.warning(
                "DiLoCo: replica(s) %s did not rejoin within diloco.rejoin_timeout_s=%.0f; stopping",
                sorted(waiting),
                self.config.rejoin_timeout_s,
            )
            return False
        return True

    # -- after every inner step ----------------------------------------------------------
    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        c = self.config
        self._inner_steps += 1
        self._since_sync += 1
        if self._since_sync < c.sync_every // c.num_fragments:
            return
        self._since_sync = 0
        m = self.manager
        step = int(m.current_step())
        committed = step > self._last_step
        fragment = (step - 1 if committed else step) % c.num_fragments
        self._last_step = step
        rec = self._sync_record(step, committed, int(m.num_participants()), fragment)
        if self.replica.restart > 0 and self.heal_count == 0 and len(self.history) == 0:
            self.history.append(rec)
            self._post("gone", "no live peer")
            raise ComposerPluginsError(
                f"replica {self.replica.index} was restarted (restart {self.replica.restart}) but found no live "
                f"peer to heal from at its first sync (torchft step {step}, {rec['participants']} participant(s)): "
                "the other replicas have finished or died. Not starting an independent run. HINT: restart the "
                "whole job, from a DiLoCo checkpoint (diloco.checkpoint_dir) if you have one."
            )
        if committed:
            if c.checkpoint_dir and step % c.checkpoint_every == 0 and m.participating_rank() == 0:
                self._checkpoint_due = step  # written in on_train_batch_end, once the step has finished
            if self._target is not None and step >= self._target and not self._defer_stop(step):
                self._stop = True
            if self.stop_file_says_stop(step):
                self._stop = True
        else:
            log.warning("DiLoCo: sync at torchft step %d did not commit; weights rolled back", step)
        rec["writes_checkpoint"] = self._checkpoint_due == step
        self._keep_sync(rec)
