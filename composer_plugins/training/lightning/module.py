"""``ComposerModule``: the Lightning glue of RL post-training with composed loss channels.

A step is rollout → the read-only :class:`~composer_plugins.training.step.record.StepRecord` (the one experience
maker) → the step computer's assembled inputs → :class:`~composer_plugins.losses.base.ChannelComposer`.
Every piece is built by :meth:`~composer_plugins.training.step.components.StepComponents.from_config`; the module
holds and calls them. See docs/training.md "One training step".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from composer_plugins.core.config import redact, to_dict
from composer_plugins.models.logprobs import lm_head_weight
from composer_plugins.training.config.train import TrainConfig, train_config_from_dict
from composer_plugins.training.lightning.checkpoints import rng_state, set_rng_state
from composer_plugins.training.lightning.evaluation import Validator
from composer_plugins.training.lightning.tracking import log_kernel_pick
from composer_plugins.training.rollout.distributed import (
    all_gather_objects,
    barrier,
    fsdp_root,
    full_params,
    reduce_stats,
    world,
)
from composer_plugins.training.rollout.rewards import derive_seed
from composer_plugins.training.step.assemble import StepPolicy
from composer_plugins.training.step.components import StepComponents, configured_hint_provider
from composer_plugins.training.step.input_builders import PAIR_REF_KEYS
from composer_plugins.training.step.optim import build_optimization
from composer_plugins.training.step.record import StepMeta, StepRecord


class ComposerModule(L.LightningModule):
    """Samples rollouts from the env, and optimises the sum of the configured loss channels.

    Args:
        config: a :class:`~composer_plugins.training.config.train.TrainConfig` (or its dict form).
        src: the loaded :class:`~composer_plugins.core.config.Config`, used to locate errors.
        parts: already built ``policy``/``tokenizer``, ``env``, ``channels``, ``hint_provider``, ``pairs``
            (:meth:`~composer_plugins.training.step.components.StepComponents.from_config`; by default built from
            ``config``).
    """

    def __init__(self, config: Any, *, src: Any = None, **parts: Any) -> None:
        super().__init__()
        cfg = config if isinstance(config, TrainConfig) else train_config_from_dict(config)
        self.cfg = cfg
        self.kernel_pick: Any = None  # the LM-head kernels picked for the device at the start of training
        self.save_hyperparameters(redact(to_dict(cfg)))
        #: Everything the step is made of, from the one path from config.
        self.parts = p = StepComponents.from_config(cfg, src, **parts)
        # the modules Lightning moves, checkpoints and shards (the EMA teacher in the step's compute dtype)
        self.policy, self.composer, self.ema_teacher = p.policy, p.composer, p.ema_teacher
        self.tokenizer, self.env, self.sampler = p.tokenizer, p.env, p.sampler
        self.experience, self.stepper = p.experience, p.stepper
        self.hint_provider, self.teacher_scoring = p.hint_provider, p.teacher_scoring
        self.required_inputs, self.needs_pairs = p.required_inputs, p.needs_pairs
        self.needs_teacher = self.composer.needs_teacher
        #: Held-out evaluation (its metrics and predictions); ``eval.hint_uplift`` evaluates the training provider.
        uplift = self.hint_provider
        if uplift is None and cfg.eval.hint_uplift:
            uplift = configured_hint_provider(cfg, src)
        self.validator = Validator(cfg, self.tokenizer, self.env, uplift)
        self._resume_rng: dict[str, Any] | None = None
        self._rollout_cache: tuple[int, StepRecord] | None = None
        self.last_step_stats: dict[str, float] = {}
        #: The step record and meta the last training step optimised on (this rank's share under data parallel).
        self.last_rollout: StepRecord | None = None
        self.last_meta: StepMeta | None = None

    @property
    def generator(self) -> Any:
        """The sampler's rollout generator."""
        return self.sampler.generator

    @property
    def reference(self) -> Any:
        """The frozen reference policy, or ``None`` when no live channel needs one."""
        return self.parts.reference

    def full_params(self, recurse: bool = False) -> Any:
        """:func:`~composer_plugins.training.rollout.distributed.full_params` under this module's trainer."""
        return full_params(self._trainer, recurse)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Lightning's clipping; under FSDP a norm clip goes through ``FSDP.clip_grad_norm_`` (the global norm)."""
        root = fsdp_root(self._trainer)
        if root is not None and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            root.clip_grad_norm_(float(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # outside the (FSDP/DDP-wrapped) forward, where whole parameters can be gathered
        self.sync_generator()

    def sync_generator(self) -> None:
        """Push the policy's weights to the rollout engine when it is due (rank 0 saves; every rank waits)."""
        step = self.global_step
        if not self.sampler.due(step):
            return
        with self.full_params(recurse=True):
            self.sampler.sync(self.policy, self.tokenizer, step, self.cfg.output_dir, push=world()[0] == 0)
        barrier()

    def on_train_start(self) -> None:
        r = self.cfg.rollout
        tokens = r.prompts_per_step * r.num_generations * r.max_new_tokens
        self.kernel_pick = self.cfg.compute.pick_kernels(int(lm_head_weight(self.policy).shape[0]), tokens, self.device)
        log_kernel_pick(self.logger, self.kernel_pick)
        self.parts.chunk_size = self.kernel_pick.chunk_size
        for ch in self.composer.active if self.kernel_pick.kernels != "liger" else ():
            if getattr(ch, "kernels", None) == "auto":  # a channel on its own `kernels: auto` follows the pick
                ch.kernels = "torch"
        if self._resume_rng is not None:
            set_rng_state(self._resume_rng)
            self._resume_rng = None
        if self.reference is not None:
            self.reference.to(self.device)
        self.cache_pair_references()  # before a step (or a DiLoCo heal) moves the weights

    def step_seed(self, index: int, rank: int = 0, world_size: int = 1) -> int:
        """Sampling seed of step ``index`` on data-parallel ``rank`` (one process: ``(seed, 1, index)``)."""
        return derive_seed(self.cfg.seed, 1, index, *((rank,) if world_size > 1 else ()))

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        index = int(batch["index"])
        rank, size = int(batch.get("rank", 0)), int(batch.get("world_size", 1))
        mu = max(1, self.cfg.rollout.num_iterations)
        if mu == 1:
            loss, stats = self.compute_step(batch["tasks"], seed=self.step_seed(index, rank, size))
        else:
            # one rollout batch every `mu` batches, optimised on `mu` times (PPO-style epochs):
            # the importance ratio against the kept sampling-time log-probs is then live
            start = index - index % mu
            if self._rollout_cache is None or self._rollout_cache[0] != start:
                rb = self.make_rollout_batch(batch["tasks"], self.step_seed(start, rank, size), old_logprobs=True)
                self._rollout_cache = (start, rb)
            loss, stats = self.loss_on(self._rollout_cache[1], self.step_seed(index, rank, size))
            stats["iteration"] = float(index - start)
        # every rank computed its share; the step's statistics are those of the union batch
        stats = reduce_stats(stats)
        self.last_step_stats = stats
        # the bar shows reward and losses; every statistic goes to the loggers once per optimizer step
        bar = {f"train/{k}": v for k, v in stats.items() if k in ("reward", "loss") or k.endswith("/loss")}
        self.log_dict(bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=len(batch["tasks"]))
        self._log_step({f"train/{k}": v for k, v in stats.items()})
        if not loss.requires_grad:  # no active channel had a row this step (SDPO without GRPO, no success): no-op
            loss = loss + 0.0 * next(p for p in self.policy.parameters() if p.requires_grad).sum()
        return loss

    def _log_step(self, metrics: Mapping[str, float]) -> None:
        trainer = self._trainer
        if trainer is None or not trainer.loggers or trainer.fit_loop._should_accumulate():
            return
        # logged at the step being completed (1 for the first optimizer step), as history.csv writes it
        step = trainer.global_step + 1
        if (step - 1) % max(1, trainer.log_every_n_steps) != 0:
            return
        for lg in trainer.loggers:
            lg.log_metrics(dict(metrics), step=step)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Prompt batches hold only Python data (tasks); tensors are made on the device later."""
        if isinstance(batch, Mapping) and "tasks" in batch:
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def compute_step(self, tasks: Sequence[Mapping[str, Any]], seed: int) -> tuple[Tensor, dict[str, float]]:
        """Rollout, score and compute the composed loss for one micro-batch of ``tasks``."""
        return self.loss_on(self.make_rollout_batch(tasks, seed), seed)

    def rollout(self, tasks: Sequence[Mapping[str, Any]], seed: int) -> tuple[Any, list[float], list[Any]]:
        """``(rollout, rewards, feedback)`` of ``tasks`` from the configured generator and the env."""
        with self.full_params():
            return self.sampler.sample(self.policy, self.tokenizer, self.env, tasks, seed)

    def make_rollout_batch(
        self, tasks: Sequence[Mapping[str, Any]], seed: int, old_logprobs: bool = False
    ) -> StepRecord:
        """The step record of ``tasks``: sampled with ``seed``, then made whole by the one experience maker.

        With ``old_logprobs`` the sampling-time log-probs are computed now (no grad), for
        ``rollout.num_iterations > 1`` where the same rollouts are optimised on several times;
        otherwise they equal the first forward's detached log-probs and cost nothing extra.
        """
        ro, rewards, feedback = self.rollout(tasks, seed)
        return self.experience.make(tasks, ro, rewards, feedback, old_logprobs=old_logprobs)

    @property
    def live_parts(self) -> StepComponents:
        """:attr:`parts` with the modules as Lightning holds them now (an FSDP strategy wraps them in place)."""
        self.parts.policy, self.parts.ema_teacher = self.policy, self.ema_teacher
        return self.parts

    def step_policy(self) -> StepPolicy:
        """The models and settings the assembler builds channel inputs with."""
        return self.live_parts.step_policy()

    def step_meta(self, seed: int, step: int | None = None) -> StepMeta:
        """This step's meta: the optimizer step (``step``, else the Trainer's; 0 without one), the run length and
        ``seed``'s preference pairs."""
        if step is None:
            step = self.global_step if self._trainer is not None else 0
        return self.live_parts.step_meta(seed, step, self.full_params)

    def cache_pair_references(self) -> None:
        """The replay pairs' reference sequence log-probs under the starting policy, kept with the pairs (once)."""
        self.live_parts.cache_pair_references(self.full_params)

    def loss_on(self, rec: StepRecord, seed: int, step: int | None = None) -> tuple[Tensor, dict[str, float]]:
        """The composed loss of the current policy on the step record ``rec`` (``seed`` picks replay pairs; ``step``:
        the optimizer step, by default the Trainer's)."""
        self.last_rollout, self.last_meta = rec, self.step_meta(seed, step)
        return self.stepper.loss(rec, self.last_meta)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's optimizer step (once per optimizer step, after gradient accumulation), then the EMA update."""
        super().optimizer_step(*args, **kwargs)
        self.update_ema_teacher()

    def update_ema_teacher(self) -> None:
        """The EMA teacher's update (:meth:`StepComponents.update_ema`); under FSDP the pairs are the two copies'
        local shards (the teacher is sharded as the policy), under DDP every rank updates the same weights."""
        root = fsdp_root(self._trainer)
        self.parts.update_ema(root if root is not None else self, salt=self.global_step)

    # -- evaluation (composer_plugins.training.lightning.evaluation) -----------------------------------
    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        self.validator.validation_step(self.policy, batch, self.log)

    # -- optimisation / checkpoint state ---------------------------------------------
    def configure_optimizers(self) -> Any:
        return build_optimization(self.cfg.optim, self.policy.parameters(), self.cfg.trainer.max_steps)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this on every rank and writes rank 0's dict: each rank's RNG state and
        # re-used rollouts (num_iterations > 1) are gathered into it, so a resume restores every rank
        cache = (self._rollout_cache[0], self._rollout_cache[1].state()) if self._rollout_cache is not None else None
        ranks = all_gather_objects({"rng": rng_state(), "rollout_cache": cache})
        checkpoint["composer_rng"] = ranks[0]["rng"]
        if cache is not None:
            checkpoint["composer_rollout_cache"] = cache
        if self.parts.pairs and PAIR_REF_KEYS[0] in self.parts.pairs[0]:
            checkpoint["composer_pair_refs"] = [[p[k] for k in PAIR_REF_KEYS] for p in self.parts.pairs]
        if len(ranks) > 1:
            checkpoint["composer_ranks"] = ranks

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        refs = checkpoint.get("composer_pair_refs")
        if refs is not None and len(refs) == len(self.parts.pairs):
            k0, k1 = PAIR_REF_KEYS
            self.parts.pairs = [{**p, k0: c, k1: j} for p, (c, j) in zip(self.parts.pairs, refs, strict=True)]
            self.parts.pair_refs_due = False
        else:  # a checkpoint without them: the weights are still the starting policy's here
            self.cache_pair_references()
        self._resume_rng = checkpoint.get("composer_rng")
        cached = checkpoint.get("composer_rollout_cache")
        rank, size = world()
        ranks = checkpoint.get("composer_ranks")
        if ranks is not None and len(ranks) == size:  # same world size: each rank its own state
            self._resume_rng, cached = ranks[rank]["rng"], ranks[rank]["rollout_cache"]
        elif size > 1:  # another world size: the step batches are re-split, so re-used rollouts are stale
            cached = None
        self._rollout_cache = (cached[0], self.experience.from_state(cached[1])) if cached else None

    def export_pretrained(self, path: str | Path) -> Path:
        """Write the policy and tokenizer with ``save_pretrained`` (loadable by any HF ``from_pretrained``)."""
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(p)
        self.tokenizer.save_pretrained(p)
        return p
