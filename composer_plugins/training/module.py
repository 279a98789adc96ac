"""``ComposerModule``: the Lightning module that samples rollouts and optimises the composed loss.

One training step (one micro-batch of prompts):

1. generate ``G`` completions per prompt with HF ``generate`` (sampling, KV cache);
   tool-using envs are driven through their ``reset``/``step`` loop instead;
2. score them with the env's ``reward`` and compute group-relative advantages;
3. build hint-teacher contexts for failed completions (the same policy, conditioned on a
   hint, scores the student's tokens without gradient);
4. run the policy forward once and let :class:`~composer_plugins.losses.base.ChannelComposer`
   sum ``weight · loss`` over the live channels (policy-gradient, hint distillation, replay
   DPO when preference pairs are present).

Only the inputs some live channel ``requires`` are computed: with the hint channel off, no
teacher forward runs; with replay off, no pair forward runs; a reference model exists only
when a live channel needs reference log-probs.

What a step is fed (task streams, prompts, rewards, hinted contexts, :class:`RolloutBatch`) is
:mod:`composer_plugins.training.batches`; the validation metrics are :mod:`composer_plugins.training.metrics`;
the SFT module is :mod:`composer_plugins.training.sft`. Over 600 lines because it is one class whose
step phases (rollout, scoring, hint contexts, the micro-batched loss, resumable state) share its state;
its module-level helpers are the private ones only it uses.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torchmetrics import MeanMetric

from composer_plugins.core.steps import step_result
from composer_plugins.envs.hints import hints_all_rows
from composer_plugins.losses.functional import chunked_logprobs
from composer_plugins.models.generation import Rollout, generate_completions, left_pad, tokenize_prompts
from composer_plugins.models.logprobs import (
    completion_hidden,
    completion_logprobs,
    completion_logprobs_no_grad,
    lm_head_weight,
    sequence_logprob,
)
from composer_plugins.training.batches import (
    RolloutBatch,
    derive_seed,
    env_rewards,
    load_pairs,
    rollout_groups,
    sibling_group,
    task_prompt,
    teacher_contexts,
)
from composer_plugins.training.builders import build_channels, build_env, build_generator, build_hint_provider
from composer_plugins.training.config import TrainConfig, train_config_from_dict
from composer_plugins.training.distributed import all_gather_objects, dp_normalisers, world
from composer_plugins.training.metrics import PassAtK, Ratio
from composer_plugins.training.policy import load_policy_for


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    v, s, g = state["python"]
    random.setstate((v, tuple(s), g))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, Tensor) and v.numel() == 1:
            out[k] = float(v.detach().float().item())
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[k] = float(v)
    return out


class ComposerModule(L.LightningModule):
    """Samples rollouts from the env, and optimises the sum of the configured loss channels.

    Args:
        config: a :class:`~composer_plugins.training.config.TrainConfig` (or its dict form).
        policy, tokenizer: an already loaded policy; by default loaded with
            ``from_pretrained`` from ``config.model`` (the tiny default is built and cached).
        env, channels, hint_provider: already built components; by default built from the
            registry by the names in ``config``.
        pairs: preference pairs for the replay channel; by default read from
            ``config.replay.pairs_path`` when a live channel needs them.
        src: the loaded :class:`~composer_plugins.core.config.Config`, used to locate errors.
    """

    def __init__(
        self,
        config: Any,
        *,
        policy: Any = None,
        tokenizer: Any = None,
        env: Any = None,
        channels: Sequence[Any] | None = None,
        hint_provider: Any = None,
        pairs: Sequence[Mapping[str, str]] | None = None,
        src: Any = None,
    ) -> None:
        super().__init__()
        from composer_plugins.core.config import redact, to_dict
        from composer_plugins.losses.base import ChannelComposer

        cfg = config if isinstance(config, TrainConfig) else train_config_from_dict(config)
        self.cfg = cfg
        self.save_hyperparameters(redact(to_dict(cfg)))
        if policy is None:
            policy, tokenizer = load_policy_for(cfg)
        if tokenizer is None:
            raise ValueError("pass tokenizer= together with policy=")
        # from_pretrained returns eval mode; Lightning trains modules in the mode it finds them in
        # (dropout on in training; generation and validation switch to eval mode themselves)
        self.policy = policy.train()
        self.tokenizer = tokenizer
        if cfg.compute.gradient_checkpointing:
            if not getattr(policy, "supports_gradient_checkpointing", False):
                raise ValueError(
                    f"compute.gradient_checkpointing: {type(policy).__name__} does not support gradient "
                    "checkpointing; set it to false"
                )
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.env = env if env is not None else build_env(cfg, src)
        if channels is None:
            channels = build_channels(cfg, src)
        self.composer = ChannelComposer(list(channels))
        self._live = [c for c in self.composer.channels if c.weight != 0.0]
        self._required: set[str] = set()
        for c in self._live:
            req = c.required_inputs() if hasattr(c, "required_inputs") else getattr(c, "requires", ())
            self._required.update(req)
            for group in getattr(c, "input_options", ()) or ():
                self._required.update(group)
        self.needs_teacher = any(getattr(c, "needs_teacher", False) for c in self._live)
        from composer_plugins.core.config import Config
        from composer_plugins.training.ema import EMATeacher, teacher_from

        try:
            teacher, ema_rate = teacher_from(self._live)
        except ValueError as e:
            raise (src if src is not None else Config()).error("losses", str(e)) from None
        #: The frozen EMA copy of the policy that scores the hinted contexts (``losses.<hint>.teacher: ema``),
        #: a submodule (checkpointed, sharded like the policy); ``None`` when the teacher is the live policy.
        self.ema_teacher: EMATeacher | None = EMATeacher(self.policy, ema_rate) if teacher == "ema" else None
        self._ema_pairs: list[tuple[Tensor, Tensor]] | None = None
        self.needs_ref_tokens = "ref_logprobs" in self._required
        self.needs_pairs = bool(self._required & {"chosen_logps", "rejected_logps", "chosen_avg_logps"})
        self.hint_provider = hint_provider
        if self.needs_teacher and self.hint_provider is None:
            self.hint_provider = build_hint_provider(cfg, src)
        self.pairs: list[Mapping[str, str]] = list(pairs) if pairs is not None else []
        if self.needs_pairs and pairs is None and cfg.replay.pairs_path:
            self.pairs = load_pairs(cfg.replay.pairs_path)
        # A frozen reference copy is kept outside the module tree: not optimised, not checkpointed
        # (it is the initial policy, rebuilt identically on resume).
        self._reference: list[Any] = []
        needs_ref_pairs = bool(self._required & {"ref_chosen_logps", "ref_rejected_logps"}) and bool(self.pairs)
        if self.needs_ref_tokens or needs_ref_pairs:
            ref = copy.deepcopy(self.policy).eval()
            for p in ref.parameters():
                p.requires_grad_(False)
            self._reference.append(ref)
        #: What samples the training rollouts (``rollout.generator``; HF ``generate`` by default).
        self.generator = build_generator(cfg, src)
        self.val_accuracy = MeanMetric()
        self.val_reward = MeanMetric()
        self.val_pass = PassAtK(cfg.eval.k)
        #: eval.hint_uplift: hinted greedy failures fixed / hinted, hinted / greedy failures
        self.val_hint_fix = Ratio()
        self.val_hint_coverage = Ratio()
        self._uplift_provider: Any = self.hint_provider
        if cfg.eval.hint_uplift and self._uplift_provider is None:
            self._uplift_provider = build_hint_provider(cfg, src)
        self._resume_rng: dict[str, Any] | None = None
        self._rollout_cache: tuple[int, RolloutBatch] | None = None
        #: Set to a list to collect per-problem validation predictions.
        self.predictions: list[dict[str, Any]] | None = None
        self.last_step_stats: dict[str, float] = {}
        #: The rollouts the last training step optimised on (this rank's share under data parallel).
        self.last_rollout: RolloutBatch | None = None

    # -- helpers -------------------------------------------------------------------------
    @property
    def reference(self) -> Any:
        """The frozen reference policy, or ``None`` when no live channel needs one."""
        return self._reference[0] if self._reference else None

    def generate(
        self,
        prompts: Sequence[str],
        num_generations: int,
        *,
        seed: int | None,
        do_sample: bool = True,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        max_prompt_length: int | None = None,
    ) -> Rollout:
        """Sample completions with the rollout settings of the config (``max_prompt_length`` overrides it)."""
        r = self.cfg.rollout
        return generate_completions(
            self.policy,
            self.tokenizer,
            prompts,
            num_generations,
            max_new_tokens=max_new_tokens or r.max_new_tokens,
            temperature=temperature or r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            do_sample=do_sample,
            seed=seed,
            max_prompt_length=max_prompt_length or r.max_prompt_length,
        )

    def rollout(self, tasks: Sequence[Mapping[str, Any]], seed: int) -> tuple[Rollout, list[float], list[Any]]:
        """Rollouts and rewards for ``tasks``: single-turn generate+score, or the env's reset/step loop."""
        G = self.cfg.rollout.num_generations
        if self.cfg.rollout.max_turns > 1 and hasattr(self.env, "reset") and hasattr(self.env, "step"):
            return self._multi_turn(tasks, seed)
        prompts = [task_prompt(t) for t in tasks]
        r = self.cfg.rollout
        with self.full_params():
            ro = self.generator.generate(
                self.policy,
                self.tokenizer,
                prompts,
                G,
                seed=seed,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                max_new_tokens=r.max_new_tokens,
                max_prompt_length=r.max_prompt_length,
            )
        rewards = env_rewards(self.env, tasks, ro.completions, G)
        return ro, rewards, [None] * len(rewards)

    def full_params(self, recurse: bool = False) -> Any:
        """A context in which the policy's parameters are whole (FSDP: gathered; otherwise nothing to do).

        ``recurse=False`` gathers only the root unit (embeddings, LM head): the wrapped decoder layers
        gather their own on each forward, as TRL samples under FSDP. ``recurse=True`` gathers all
        (saving the weights for an inference server).
        """
        import contextlib

        trainer = self._trainer
        model = getattr(getattr(trainer, "strategy", None), "model", None) if trainer is not None else None
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # inside the training/validation forward FSDP has already gathered the root unit's parameters
        idle = getattr(getattr(model, "training_state", None), "name", "IDLE") == "IDLE"
        if isinstance(model, FSDP) and idle:
            return FSDP.summon_full_params(model, writeback=False, recurse=recurse)
        return contextlib.nullcontext()

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: str | None = None) -> None:  # fmt: skip
        """Lightning's clipping; under FSDP a norm clip goes through ``FSDP.clip_grad_norm_`` (the global norm)."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = getattr(self._trainer.strategy, "model", None) if self._trainer is not None else None
        if isinstance(model, FSDP) and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            model.clip_grad_norm_(float(gradient_clip_val))
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # outside the (FSDP/DDP-wrapped) forward, where whole parameters can be gathered
        self.sync_generator()

    def sync_generator(self) -> None:
        """Push the policy's weights to the rollout engine when it is due (rank 0 saves; every rank waits)."""
        from composer_plugins.training.distributed import barrier

        gen = self.generator
        wants = getattr(gen, "wants_sync", None)
        step = self.global_step
        if wants is None or not wants(step):
            return
        rank, _ = world()
        with self.full_params(recurse=True):
            if rank == 0:
                gen.sync(self.policy, self.tokenizer, step, out_dir=self.cfg.output_dir)
        gen.last_synced = step
        barrier()

    def _multi_turn(self, tasks: Sequence[Mapping[str, Any]], seed: int) -> tuple[Rollout, list[float], list[Any]]:
        """Drive ``env.reset(task)`` / ``env.step(action)`` for the ``G`` episodes of each task.

        Every episode runs on a shallow copy of the env (its own episode state, shared score
        cache). Contexts are kept as token ids: turn ``k`` is generated from
        ``prompt + action_1 + observation_1 + ... `` exactly as the trajectory is later scored,
        and only action tokens are trained on (observation tokens are masked out). The episode
        reward is the reward of its last step; the feedback of the last step goes to the hint
        provider.
        """
        G = self.cfg.rollout.num_generations
        max_turns = self.cfg.rollout.max_turns
        pad = self.tokenizer.pad_token_id
        episodes: list[dict[str, Any]] = []
        for t in tasks:
            for _ in range(G):
                env = copy.copy(self.env)
                obs = env.reset(task=dict(t))
                prompt = _obs_text(obs)
                p_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                p_ids = p_ids[-self.cfg.rollout.max_prompt_length :]
                episodes.append(
                    {
                        "env": env,
                        "prompt": prompt,
                        "prompt_ids": p_ids,
                        "ids": [],
                        "mask": [],
                        "reward": 0.0,
                        "done": False,
                        "actions": [],
                        "feedback": None,
                    }
                )
        for turn in range(max_turns):
            live = [e for e in episodes if not e["done"]]
            if not live:
                break
            ro = generate_completions(
                self.policy,
                self.tokenizer,
                None,
                1,
                max_new_tokens=self.cfg.rollout.max_new_tokens,
                temperature=self.cfg.rollout.temperature,
                top_p=self.cfg.rollout.top_p,
                top_k=self.cfg.rollout.top_k,
                seed=derive_seed(seed, turn),
                prompt_token_ids=[e["prompt_ids"] + e["ids"] for e in live],
            )
            for j, e in enumerate(live):
                act_ids = ro.completion_ids[j][ro.completion_mask[j].bool()].tolist()
                obs, reward, done, info = step_result(e["env"].step(ro.completions[j]))
                e["ids"] += act_ids
                e["mask"] += [1] * len(act_ids)
                e["actions"].append(ro.completions[j])
                e["reward"] = 0.0 if reward is None else float(reward)
                e["feedback"] = (info or {}).get("feedback", getattr(obs, "feedback", None))
                if done or turn == max_turns - 1:
                    e["done"] = True
                    continue
                obs_ids = self.tokenizer("\n" + _obs_text(obs) + "\n", add_special_tokens=False)["input_ids"]
                e["ids"] += obs_ids
                e["mask"] += [0] * len(obs_ids)
        for e in episodes:
            close = getattr(e["env"], "close", None)
            if close is not None and e["env"] is not self.env:
                close()
        prompt_ids, prompt_mask = left_pad([e["prompt_ids"] for e in episodes], pad, self.device)
        width = max(1, max(len(e["ids"]) for e in episodes))
        cids = torch.full((len(episodes), width), pad, dtype=torch.long, device=self.device)
        cmask = torch.zeros((len(episodes), width), dtype=torch.long, device=self.device)
        for i, e in enumerate(episodes):
            if e["ids"]:
                cids[i, : len(e["ids"])] = torch.tensor(e["ids"], device=self.device)
                cmask[i, : len(e["mask"])] = torch.tensor(e["mask"], device=self.device)
        ro = Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=cids,
            completion_mask=cmask,
            completions=["\n".join(e["actions"]) for e in episodes],
            prompts=[e["prompt"] for e in episodes],
            group_index=torch.arange(len(tasks), device=self.device).repeat_interleave(G),
            num_generations=G,
        )
        ro.extra["attention_mask"] = _trajectory_attention(episodes, width, self.device)
        return ro, [e["reward"] for e in episodes], [e["feedback"] for e in episodes]

    # -- training ----------------------------------------------------------------------
    def on_train_start(self) -> None:
        if self._resume_rng is not None:
            _set_rng_state(self._resume_rng)
            self._resume_rng = None
        for ref in self._reference:
            ref.to(self.device)

    def step_seed(self, index: int, rank: int = 0, world_size: int = 1) -> int:
        """Sampling seed of step ``index`` on data-parallel ``rank`` (one process: ``(seed, 1, index)``)."""
        if world_size == 1:
            return derive_seed(self.cfg.seed, 1, index)
        return derive_seed(self.cfg.seed, 1, index, rank)

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> Tensor:
        from composer_plugins.training.distributed import reduce_stats

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
        # the progress bar shows reward, loss and each channel's loss; every statistic goes to the
        # loggers (MLflow) directly, once per optimizer step (cheaper than one self.log per key)
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

    def make_rollout_batch(self, tasks: Sequence[Mapping[str, Any]], seed: int,
                           old_logprobs: bool = False) -> RolloutBatch:  # fmt: skip
        """Generate and score rollouts, compute advantages and the hinted teacher contexts.

        With ``old_logprobs`` the sampling-time log-probs are computed now (no grad), for
        ``rollout.num_iterations > 1`` where the same rollouts are optimised on several times;
        otherwise they equal the first forward's detached log-probs and cost nothing extra.
        """
        from composer_plugins.losses import functional as F

        G = self.cfg.rollout.num_generations
        ro, rewards_list, feedback = self.rollout(tasks, seed)
        rewards = torch.tensor(rewards_list, dtype=torch.float32, device=self.device)
        advantages = F.group_advantages(rewards, G, **self.cfg.rollout.advantage_kwargs)
        if isinstance(advantages, tuple):
            advantages = advantages[0]
        rb = RolloutBatch(tasks=list(tasks), rollout=ro, rewards=rewards, advantages=advantages.detach().float())
        att = ro.extra.get("attention_mask")
        args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        kw = {
            "temperature": self.cfg.rollout.temperature,
            "completion_attention_mask": att,
            "micro_batch_size": self.micro_batch_size(ro.prompt_ids, ro.completion_ids),
            "chunk_size": self.cfg.compute.chunk_size,
        }
        if old_logprobs:
            rb.old_logprobs = completion_logprobs_no_grad(self.policy, *args, **kw)
        if self.needs_ref_tokens and self.reference is not None:
            rb.ref_logprobs = completion_logprobs_no_grad(self.reference, *args, **kw)
        if self.needs_teacher:
            failed = (rewards < self.cfg.rollout.success_threshold).nonzero().flatten().tolist()
            if hints_all_rows(self.hint_provider):  # SDPO's rule: every row, the provider decides which get one
                failed = list(range(len(ro.completions)))
            cap = self.cfg.hints.max_hinted_per_step
            if cap is not None:
                failed = failed[:cap]
            groups = rollout_groups(ro.completions, rewards, G, self.cfg.rollout.success_threshold)
            contexts = teacher_contexts(
                self.env,
                self.hint_provider,
                [tasks[i // G] for i in failed],
                [ro.completions[i] for i in failed],
                [feedback[i] for i in failed],
                [groups[i] for i in failed],
            )
            rb.hint_rows = [i for i, c in zip(failed, contexts, strict=True) if c is not None]
            rb.hint_contexts = [c for c in contexts if c is not None]
        return rb

    def micro_batch_size(self, *tensors: Tensor) -> int:
        """Rows per micro-batch for sequences as long as the concatenated ``tensors`` (``compute`` section)."""
        return self.cfg.compute.rows_per_micro_batch(sum(t.shape[1] for t in tensors))

    def loss_on(self, rb: RolloutBatch, seed: int) -> tuple[Tensor, dict[str, float]]:
        """The composed loss of the current policy on the rollouts ``rb`` (``seed`` picks replay pairs).

        The policy's decoder body runs micro-batch by micro-batch (:func:`completion_hidden`), and
        every channel input comes from the final hidden states through the LM head in chunks:
        per-token log-probs (``logprobs``), the hinted rows' student/teacher hidden states for the
        distillation channel, the replay pairs' sequence log-probs. The composed loss is computed
        once over the whole batch, so it equals the one-shot loss for every loss type and channel.
        """
        self.last_rollout = rb
        ro = rb.rollout
        G = ro.num_generations
        T = self.cfg.rollout.temperature
        batch: dict[str, Any] = {
            "completion_mask": ro.completion_mask.float(),
            "advantages": rb.advantages,
            "rewards": rb.rewards,
            "num_generations": G,
            "group_index": ro.group_index,
            # schedules inside channels (TAID's t) follow the optimizer step
            "global_step": self.global_step,
            "total_steps": self.cfg.trainer.max_steps,
        }
        # data parallel: the global token-count normalisers, so each rank's loss is its share of the
        # union batch's (no-op in one process)
        hinted = float(ro.completion_mask[rb.hint_rows].sum()) if rb.hint_rows else 0.0
        batch.update(dp_normalisers(ro.completion_mask, hinted if self.needs_teacher else None))
        outputs: dict[str, Any] = {}
        out = completion_logprobs(
            self.policy,
            ro.prompt_ids,
            ro.prompt_mask,
            ro.completion_ids,
            ro.completion_mask,
            temperature=T,
            completion_attention_mask=ro.extra.get("attention_mask"),
            micro_batch_size=self.micro_batch_size(ro.prompt_ids, ro.completion_ids),
            chunk_size=self.cfg.compute.chunk_size,
            return_hidden=self.needs_teacher,
        )
        logps, hidden = out if isinstance(out, tuple) else (out, None)
        outputs["logprobs"] = logps
        batch["old_logprobs"] = rb.old_logprobs if rb.old_logprobs is not None else logps.detach()
        stats: dict[str, float] = {}
        sampling = ro.extra.get("sampling_logprobs")
        if sampling is None:
            # HF generate samples from this policy, so the inference engine's log-probs are the sampling-time ones
            batch["inference_logprobs"] = batch["old_logprobs"]
        else:
            # an inference server sampled with weights that may lag the policy: its own log-probs, and
            # TRL's truncated importance-sampling correction from them to the policy at rollout time
            batch["inference_logprobs"] = sampling
            r = self.cfg.rollout
            if r.importance_sampling != "off":
                from composer_plugins.losses.functional import importance_sampling_correction

                ratio = importance_sampling_correction(
                    batch["old_logprobs"], sampling, ro.completion_mask, r.importance_sampling,
                    r.importance_sampling_max, r.importance_sampling_min,
                )  # fmt: skip
                batch["importance_sampling_ratio"] = ratio
                m = ro.completion_mask.float()
                stats["is_ratio"] = float((ratio.expand_as(m) * m).sum() / m.sum().clamp(min=1))
        if rb.ref_logprobs is not None:
            batch["ref_logprobs"] = rb.ref_logprobs
        if self.needs_teacher:
            stats.update(self._hint_inputs(rb, hidden, outputs, batch))
        if self.needs_pairs and self.pairs:
            self._pair_inputs(seed, outputs, batch)
        loss, metrics = self.composer(outputs, batch)
        rewards = rb.rewards
        stats.update(_numeric(metrics))
        stats["reward"] = float(rewards.mean())
        stats["accuracy"] = float((rewards >= self.cfg.rollout.success_threshold).float().mean())
        stats["completion_tokens"] = float(ro.num_completion_tokens)
        stats["completion_length"] = float(ro.completion_mask.sum(1).float().mean())
        stats["groups_with_signal"] = float((rewards.view(-1, G).std(1) > 0).float().mean())
        return loss, stats

    def _hint_inputs(self, rb: RolloutBatch, student_hidden: Tensor | None, outputs: dict[str, Any],
                     batch: dict[str, Any]) -> dict[str, float]:  # fmt: skip
        """Teacher hidden states (the current policy on prompt + hint, no grad) on the failed completions.

        Both sides are divided by the sampling temperature, so the divergence compares the
        distributions the rollout sampled from (``softmax(h W^T / T)``), as the logits path did.
        """
        if not rb.hint_rows or student_hidden is None:
            return {"hint/rows": 0.0, "hint/fraction": 0.0, **_margin_stat(0.0, 0.0, batch.get("hint_tokens_in_batch"))}
        ro = rb.rollout
        T = self.cfg.rollout.temperature
        idx = torch.tensor(rb.hint_rows, device=self.device)
        att = ro.extra.get("attention_mask")
        h_ids, h_mask = tokenize_prompts(
            self.tokenizer, rb.hint_contexts, self.cfg.hints.max_context_length, self.device
        )
        args = (h_ids, h_mask, ro.completion_ids[idx], ro.completion_mask[idx], None if att is None else att[idx],
                self.micro_batch_size(h_ids, ro.completion_ids))  # fmt: skip
        head = lm_head_weight(self.policy)
        if self.ema_teacher is not None:  # the EMA weights (their own FSDP unit: its forward gathers them)
            teacher, t_head = self.ema_teacher(*args)
            outputs["teacher_lm_head_weight"] = t_head
        else:
            with torch.no_grad():
                teacher = completion_hidden(self.policy, *args[:4], completion_attention_mask=args[4],
                                            micro_batch_size=args[5])  # fmt: skip
            t_head = head
        scale = 1.0 / T
        outputs["student_hidden"] = student_hidden[idx] * scale if T != 1.0 else student_hidden[idx]
        outputs["teacher_hidden"] = teacher * scale if T != 1.0 else teacher
        outputs["lm_head_weight"] = head
        batch["hint_mask"] = ro.completion_mask[idx].float()
        batch["hint_rows"] = idx
        stats = {"hint/rows": float(len(rb.hint_rows)), "hint/fraction": len(rb.hint_rows) / ro.completion_ids.shape[0]}
        mask = ro.completion_mask[idx].bool()
        with torch.no_grad():  # the precondition: how much likelier the teacher finds the student's tokens
            t_logps = chunked_logprobs(teacher, t_head, ro.completion_ids[idx], mask=mask, temperature=T,
                                       chunk_size=self.cfg.compute.chunk_size)  # fmt: skip
            diff = ((t_logps - outputs["logprobs"][idx].detach()) * mask).sum()
        stats.update(_margin_stat(float(diff), float(mask.sum()), batch.get("hint_tokens_in_batch")))
        return stats

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's optimizer step (once per optimizer step, after gradient accumulation), then the EMA update."""
        super().optimizer_step(*args, **kwargs)
        self.update_ema_teacher()

    def update_ema_teacher(self) -> None:
        """``teacher ← (1 − rate)·teacher + rate·policy`` (nothing without an EMA teacher).

        Under FSDP the pairs are the two copies' local shards (the teacher is sharded as the policy);
        under DDP every rank applies the same update to the same weights.
        """
        if self.ema_teacher is None:
            return
        from composer_plugins.training.ema import ema_pairs, ema_update

        if self._ema_pairs is None:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = getattr(self._trainer.strategy, "model", None) if self._trainer is not None else None
            holder = model if isinstance(model, FSDP) else self
            self._ema_pairs = ema_pairs(holder, "ema_teacher.policy", "policy")
        ema_update(self._ema_pairs, self.ema_teacher.rate)

    def _pair_inputs(self, seed: int, outputs: dict[str, Any], batch: dict[str, Any]) -> None:
        """Policy (with grad) and reference (no grad) sequence log-probs of sampled preference pairs."""
        rng = random.Random(seed)
        k = min(self.cfg.replay.pairs_per_step, len(self.pairs))
        picked = rng.sample(range(len(self.pairs)), k)
        pairs = [self.pairs[i] for i in picked]
        prompts = [str(p["prompt"]) for p in pairs] * 2
        comps = [str(p["chosen"]) for p in pairs] + [str(p["rejected"]) for p in pairs]
        p_ids, p_mask = tokenize_prompts(self.tokenizer, prompts, self.cfg.rollout.max_prompt_length, self.device)
        c_ids, c_mask = _right_pad(self.tokenizer, comps, self.cfg.replay.max_completion_length, self.device)
        mb = self.micro_batch_size(p_ids, c_ids)
        cs = self.cfg.compute.chunk_size
        logps = completion_logprobs(self.policy, p_ids, p_mask, c_ids, c_mask, micro_batch_size=mb, chunk_size=cs)
        assert isinstance(logps, Tensor)
        seq = sequence_logprob(logps, c_mask.float())
        lengths = c_mask.sum(-1).float()
        outputs["chosen_logps"], outputs["rejected_logps"] = seq[:k], seq[k:]
        outputs["chosen_avg_logps"], outputs["rejected_avg_logps"] = seq[:k] / lengths[:k], seq[k:] / lengths[k:]
        batch["chosen_lengths"], batch["rejected_lengths"] = lengths[:k], lengths[k:]
        if not self._required & {"ref_chosen_logps", "ref_rejected_logps"}:
            return
        ref = self.reference if self.reference is not None else self.policy
        ref_logps = completion_logprobs_no_grad(ref, p_ids, p_mask, c_ids, c_mask, micro_batch_size=mb, chunk_size=cs)
        ref_seq = sequence_logprob(ref_logps, c_mask.float())
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref_seq[:k], ref_seq[k:]

    # -- evaluation ------------------------------------------------------------------
    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        stats = self.evaluate_tasks(batch["tasks"], seed=derive_seed(self.cfg.eval.seed, 2, int(batch["index"])))
        self.val_accuracy.update(stats["correct_greedy"])
        # mean reward of the sampled completions (eval.temperature) when there are any, else greedy
        sampled = stats["rewards_samples"]
        self.val_reward.update(sampled.flatten() if sampled is not None else stats["rewards_greedy"])
        if stats["correct_samples"] is not None:
            self.val_pass.update(stats["correct_samples"])
        n = len(batch["tasks"])
        self.log("val/accuracy", self.val_accuracy, prog_bar=True, batch_size=n)
        self.log("val/mean_reward", self.val_reward, batch_size=n)
        if stats["correct_samples"] is not None:
            self.log(f"val/pass_at_{self.cfg.eval.k}", self.val_pass, batch_size=n)
        up = stats.get("hint_uplift")
        if up is not None:
            self.val_hint_fix.update(up["fixed"], up["hinted"])
            self.val_hint_coverage.update(up["hinted"], up["failures"])
            self.log("val/hint_fix_rate", self.val_hint_fix, batch_size=n)
            self.log("val/hint_coverage", self.val_hint_coverage, batch_size=n)
            for k in ("failures", "hinted", "fixed"):
                self.log(f"val/hint_{k}", float(up[k]), batch_size=n, reduce_fx="sum")
        if self.predictions is not None:
            for i, task in enumerate(batch["tasks"]):
                row = {k: v for k, v in task.items() if isinstance(v, str | int | float | bool | type(None))}
                row.update(
                    completion=stats["completions"][i],
                    reward=float(stats["rewards_greedy"][i]),
                    correct=bool(stats["correct_greedy"][i] > 0),
                )
                if stats["correct_samples"] is not None:
                    row["samples_correct"] = int(stats["correct_samples"][i].sum())
                if up is not None and i in up["rows"]:
                    row.update(up["rows"][i])
                self.predictions.append(row)

    @torch.no_grad()
    def evaluate_tasks(self, tasks: Sequence[Mapping[str, Any]], seed: int) -> dict[str, Any]:
        """Greedy accuracy / reward and ``eval.num_samples`` sampled completions per task (pass@k, mean reward)."""
        e = self.cfg.eval
        thr = self.cfg.rollout.success_threshold
        prompts = [task_prompt(t) for t in tasks]
        mnt = e.max_new_tokens or self.cfg.rollout.max_new_tokens
        greedy = self.generate(prompts, 1, seed=None, do_sample=False, max_new_tokens=mnt)
        r_greedy = torch.tensor(env_rewards(self.env, tasks, greedy.completions, 1), device=self.device)
        out: dict[str, Any] = {
            "rewards_greedy": r_greedy,
            "correct_greedy": (r_greedy >= thr).float(),
            "correct_samples": None,
            "rewards_samples": None,
            "completions": greedy.completions,
        }
        if e.k > 0 and e.num_samples >= e.k:
            ro = self.generate(prompts, e.num_samples, seed=seed, temperature=e.temperature, max_new_tokens=mnt)
            r = torch.tensor(env_rewards(self.env, tasks, ro.completions, e.num_samples), device=self.device)
            out["correct_samples"] = (r >= thr).view(len(tasks), e.num_samples)
            out["rewards_samples"] = r.view(len(tasks), e.num_samples)
        if e.hint_uplift:
            out["hint_uplift"] = self.hint_uplift(tasks, greedy.completions, r_greedy, seed)
        return out

    def hint_uplift(self, tasks: Sequence[Mapping[str, Any]], greedy: Sequence[str], rewards: Tensor,
                    seed: int) -> dict[str, Any]:  # fmt: skip
        """Does a hint fix what the policy gets wrong? (``eval.hint_uplift``).

        For the problems whose greedy completion fails, the teacher context of ``hints.provider``
        (:func:`teacher_contexts`, as in training) is decoded greedily by the same policy. A provider
        that reads the rollout group gets, per failure, the group ``[greedy attempt, k samples]`` with
        the greedy attempt as the row: ``eval.hint_uplift_samples`` samples at ``eval.temperature``,
        whose successes are its siblings. Returns the counts ``failures``, ``hinted`` (got a hint),
        ``fixed`` (hinted and then solved) and per-row details for the predictions file.
        """
        from composer_plugins.envs.hints import wants_groups

        e = self.cfg.eval
        thr = self.cfg.rollout.success_threshold
        mnt = e.max_new_tokens or self.cfg.rollout.max_new_tokens
        provider = self._uplift_provider
        if provider is None:
            raise ValueError("eval.hint_uplift needs hints.provider (a hint provider to evaluate)")
        failed = [i for i in range(len(tasks)) if float(rewards[i]) < thr]
        out: dict[str, Any] = {"failures": len(failed), "hinted": 0, "fixed": 0, "rows": {}}
        if not failed:
            return out
        groups = None
        if wants_groups(provider):
            k = max(1, int(e.hint_uplift_samples))
            f_tasks = [tasks[i] for i in failed]
            ro = self.generate([task_prompt(t) for t in f_tasks], k, seed=derive_seed(seed, 5),
                               temperature=e.temperature, max_new_tokens=mnt)  # fmt: skip
            r = env_rewards(self.env, f_tasks, ro.completions, k)
            groups = []
            for j, i in enumerate(failed):  # the failed greedy attempt is the row, the k samples its siblings
                comps, rs = ro.completions[j * k : (j + 1) * k], r[j * k : (j + 1) * k]
                groups.append(sibling_group([greedy[i], *comps], [float(rewards[i]), *rs], thr))
        contexts = teacher_contexts(self.env, provider, [tasks[i] for i in failed], [greedy[i] for i in failed],
                                    groups=groups)  # fmt: skip
        hinted = [(i, c) for i, c in zip(failed, contexts, strict=True) if c is not None]
        out["hinted"] = len(hinted)
        if not hinted:
            return out
        ro = self.generate(
            [c for _, c in hinted],
            1,
            seed=None,
            do_sample=False,
            max_new_tokens=mnt,
            max_prompt_length=self.cfg.hints.max_context_length,
        )  # as the teacher reads it
        r_hint = env_rewards(self.env, [tasks[i] for i, _ in hinted], ro.completions, 1)
        out["fixed"] = sum(1 for v in r_hint if v >= thr)
        for (i, ctx), comp, v in zip(hinted, ro.completions, r_hint, strict=True):
            out["rows"][i] = {"hint_context": ctx, "hinted_completion": comp, "hint_fixed": bool(v >= thr)}
        return out

    # -- optimisation / checkpoint state ---------------------------------------------
    def configure_optimizers(self) -> Any:
        from composer_plugins.training.optim import build_optimization

        return build_optimization(self.cfg.optim, self.policy.parameters(), self.cfg.trainer.max_steps)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this on every rank and writes rank 0's dict: each rank's RNG state and
        # re-used rollouts (num_iterations > 1) are gathered into it, so a resume restores every rank
        cache = (self._rollout_cache[0], self._rollout_cache[1].state()) if self._rollout_cache is not None else None
        ranks = all_gather_objects({"rng": _rng_state(), "rollout_cache": cache})
        checkpoint["composer_rng"] = ranks[0]["rng"]
        if cache is not None:
            checkpoint["composer_rollout_cache"] = cache
        if len(ranks) > 1:
            checkpoint["composer_ranks"] = ranks

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._resume_rng = checkpoint.get("composer_rng")
        cached = checkpoint.get("composer_rollout_cache")
        rank, size = world()
        ranks = checkpoint.get("composer_ranks")
        if ranks is not None and len(ranks) == size:  # same world size: each rank its own state
            self._resume_rng, cached = ranks[rank]["rng"], ranks[rank]["rollout_cache"]
        elif size > 1:  # another world size: the step batches are re-split, so re-used rollouts are stale
            cached = None
        self._rollout_cache = (cached[0], RolloutBatch.from_state(cached[1])) if cached else None

    def export_pretrained(self, path: str | Path) -> Path:
        """Write the policy and tokenizer with ``save_pretrained`` (loadable by any HF ``from_pretrained``)."""
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(p)
        self.tokenizer.save_pretrained(p)
        return p


def _margin_stat(diff_sum: float, tokens: float, tokens_in_batch: float | None) -> dict[str, float]:
    """``hint/teacher_margin``: this rank's sum of teacher − student log-probs over its hinted tokens, as
    its share of the mean over every rank's hinted tokens (``tokens_in_batch`` = all ranks' ÷ world
    size, so the ranks' average is the union mean); absent when no rank hinted a token."""
    n = tokens if tokens_in_batch is None else float(tokens_in_batch)
    return {"hint/teacher_margin": diff_sum / n} if n > 0 else {}


def _right_pad(tokenizer: Any, texts: Sequence[str], max_length: int, device: Any) -> tuple[Tensor, Tensor]:
    pad = tokenizer.pad_token_id
    rows = [
        (tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:max_length] for t in texts
    ]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


def _trajectory_attention(episodes: Sequence[Mapping[str, Any]], width: int, device: Any) -> Tensor:
    """Attention over a multi-turn trajectory: every real token (actions and observations)."""
    att = torch.zeros((len(episodes), width), dtype=torch.long, device=device)
    for i, e in enumerate(episodes):
        att[i, : len(e["ids"])] = 1
    return att


def _obs_text(obs: Any) -> str:
    if isinstance(obs, str):
        return obs
    if isinstance(obs, Mapping):
        for k in ("text", "observation", "prompt"):
            if k in obs:
                return str(obs[k])
    for k in ("text", "observation", "prompt"):
        if hasattr(obs, k):
            return str(getattr(obs, k))
    return str(obs)
