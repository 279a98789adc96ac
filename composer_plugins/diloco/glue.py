"""The Lightning glue both DiLoCo callbacks share (:class:`DiLoCoCallbackBase`): one optimizer checked, the round
target from ``max_steps``, the sync record and log, the ``diloco/*`` metrics, the stop flag and :meth:`close` on
teardown (docs/diloco.md, "Design: a callback, not a strategy").
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.diloco.common import DiLoCoConfig, ReplicaInfo, param_digest, stop_file_says_stop

log = logging.getLogger(__name__)

__all__ = ["DiLoCoCallbackBase"]


class DiLoCoCallbackBase(pl.Callback):
    """What every DiLoCo callback does in a Lightning run; subclasses implement :meth:`attach` and :meth:`close`."""

    #: the transport's registered name (:mod:`.transports`)
    transport = ""

    def __init__(self, config: DiLoCoConfig | None = None, replica: ReplicaInfo | None = None) -> None:
        super().__init__()
        self.config = (config or DiLoCoConfig(transport=self.transport)).validate()
        self.replica = replica or ReplicaInfo.from_env()
        #: the trainable parameters in groups synced together, and one outer optimizer for each (set by :meth:`attach`)
        self.fragments: list[nn.Module] = []
        self.outer_optimizers: list[torch.optim.Optimizer] = []
        self.history: list[dict[str, Any]] = []
        self.heal_count = 0
        self._module: nn.Module | None = None
        self._inner: torch.optim.Optimizer | None = None
        self._trainer: pl.Trainer | None = None
        self._hook: Any = None
        self._inner_steps = 0
        self._since_sync = 0
        self._healed_since_sync = False
        self._target: int | None = self.config.outer_steps
        self._step_cap: int | None = None  # how far max_steps may grow to make up missed rounds
        self._stop = False

    # -- the heal counters: written here only -------------------------------------------------
    def stop_file_says_stop(self, step: int) -> bool:
        """This replica's STOP file (``stop_file`` in its config, else the launcher's) says stop at ``step``."""
        return stop_file_says_stop(self.config.stop_file or self.replica.stop_file, step)

    def _healed(self) -> None:
        """A heal (a state loaded, rounds replayed, a round caught up): counted, and reported by the next sync."""
        self.heal_count += 1
        self._healed_since_sync = True

    # -- the sync log: one record per sync, finished and written here only ----------------------
    def _sync_record(self, outer_step: int, committed: bool, participants: int, fragment: int) -> dict[str, Any]:
        """The fields every transport's sync record starts with (docs/diloco.md "Sync log"); whether a heal happened
        since the last one (the next starts afresh)."""
        healed, self._healed_since_sync = self._healed_since_sync, False
        return {
            "replica": self.replica.index,
            "replica_id": self.replica.replica_id,
            "restart": self.replica.restart,
            "outer_step": outer_step,
            "inner_step": self._inner_steps,
            "committed": committed,
            "participants": participants,
            "fragment": fragment,
            "healed": healed,
            "bytes_allreduced": self.bytes_allreduced,
            "time": time.time(),
        }

    def _keep_sync(
        self, rec: dict[str, Any], synced: Sequence[torch.Tensor] | None = None, digest: tuple[str, float] | None = None
    ) -> None:
        """Finish ``rec`` (``stop``, the hashes of the synced weights and fragment) and keep it in ``history`` and
        the sync log. ``synced`` defaults to the trainable parameters (a frozen EMA hint teacher is per-replica
        local state); ``digest``: their hash, if taken already."""
        rec["stop"] = self._stop
        sync_log = self.config.sync_log or self.replica.sync_log
        if sync_log and self.config.log_param_hash:
            assert self._module is not None
            weights = synced if synced is not None else (p for p in self._module.parameters() if p.requires_grad)
            rec["param_hash"], rec["param_sum"] = digest or param_digest(weights)
            whole = len(self.fragments) == 1  # one fragment: the synced weights themselves
            fragment = self.fragments[rec["fragment"]].parameters()
            rec["fragment_hash"] = rec["param_hash"] if whole else param_digest(fragment)[0]
        self.history.append(rec)
        if sync_log:
            with open(sync_log, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if self._stop and self._trainer is not None:
            self._trainer.should_stop = True

    # -- what a transport provides ---------------------------------------------------------
    def attach(self, module: nn.Module, inner_optimizer: torch.optim.Optimizer) -> DiLoCoCallbackBase:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    @property
    def attached(self) -> bool:
        return self._module is not None

    @property
    def bytes_allreduced(self) -> int:
        return 0

    @property
    def inner_steps(self) -> int:
        return self._inner_steps

    def after_batch(self, trainer: pl.Trainer) -> None:
        """Per-batch work of the transport (the torchft callback writes its checkpoints here)."""

    # -- Lightning hooks -------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise ComposerPluginsError(
                f"DiLoCo needs exactly one optimizer; {type(pl_module).__name__}.configure_optimizers returned "
                f"{len(optimizers)}. HINT: return a single optimizer (parameter groups are fine)."
            )
        if not pl_module.automatic_optimization:
            log.warning("DiLoCo: manual optimization; syncs happen on the optimizer's step() calls")
        self._trainer = trainer
        if self._target is None and trainer.max_steps and trainer.max_steps > 0:
            self._target = max(1, trainer.max_steps // (self.config.sync_every // self.config.num_fragments))
            # the shared outer step decides when to stop: missed syncs are made up (:meth:`_make_up`)
            self._step_cap = 2 * trainer.max_steps
        self.attach(pl_module, optimizers[0])

    def _make_up(self, trainer: pl.Trainer) -> None:
        """At ``max_steps`` short of the round target (a sync that did not commit, a peer being waited for): one
        more round of inner steps, up to twice the configured ``max_steps`` (docs/diloco.md, "Fault tolerance")."""
        loop = trainer.fit_loop.epoch_loop
        if self._stop or self._step_cap is None or trainer.global_step < loop.max_steps:
            return
        if loop.max_steps < self._step_cap:
            per_sync = self.config.sync_every // self.config.num_fragments
            loop.max_steps = min(self._step_cap, trainer.global_step + per_sync)
            log.info(
                "DiLoCo: outer step target %s not reached at max_steps; %d more inner steps (up to %d)",
                self._target,
                loop.max_steps - trainer.global_step,
                self._step_cap,
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.attached:
            return
        if self.history:
            last = self.history[-1]
            pl_module.log_dict(
                {
                    "diloco/outer_step": float(last["outer_step"]),
                    "diloco/participants": float(last["participants"]),
                    "diloco/bytes_allreduced": float(self.bytes_allreduced),
                },
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )
        self.after_batch(trainer)
        if self._stop:
            trainer.should_stop = True
        else:
            self._make_up(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # after ``on_train_end``, so a final checkpoint written there still carries the DiLoCo state
        if stage == "fit":
            self.close()
