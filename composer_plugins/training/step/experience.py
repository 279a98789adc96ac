"""The one experience maker, and the one step computer that reads what it made.

:class:`ExperienceMaker` turns a scored rollout into the whole read-only
:class:`~composer_plugins.training.step.record.StepRecord` in one place, for every trainer path;
:class:`StepComputer` is the one local step: record and meta in, assembled inputs, composed loss and
statistics out. See docs/training.md "One training step".
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from composer_plugins.core.config import Config
from composer_plugins.core.errors import ConfigError
from composer_plugins.envs.hints import build_hint_provider, reads_groups
from composer_plugins.losses.functional import group_advantages
from composer_plugins.models.generation import tokenize_completions, tokenize_prompts
from composer_plugins.models.logprobs import completion_logprobs_no_grad
from composer_plugins.training.rollout.distributed import dp_normalisers
from composer_plugins.training.rollout.multiturn import build_generator
from composer_plugins.training.rollout.rewards import (
    derive_seed,
    env_rewards,
    reference_completion,
    rollout_groups,
    task_prompt,
    teacher_contexts,
)
from composer_plugins.training.rollout.rollouts import EpisodeGenerator, WeightSyncing
from composer_plugins.training.step.assemble import StepPolicy, assemble_inputs
from composer_plugins.training.step.metrics import reward_stats, scalar_metrics
from composer_plugins.training.step.record import Rollout, StepMeta, StepRecord, hint_candidates
from composer_plugins.training.step.teacher_scores import score_requests

__all__ = ["OWN_PATH_SETTINGS", "ExperienceMaker", "Sampler", "StepComputer", "hint_fields", "refuse_own_sampling"]


@dataclass
class Sampler:
    """The one sampler of a step's rollouts, built once from config: the generator ``rollout.generator`` names
    (HF ``generate`` by default; with ``rollout.max_turns > 1`` and a tool-using env, multi-turn episodes), the
    sampling settings and ``model.chat_template``. The Lightning module and the backends' local modes sample
    through it; a path that samples otherwise refuses the settings it cannot honour (:func:`refuse_own_sampling`).
    """

    generator: Any
    num_generations: int
    sampling: Mapping[str, Any]
    chat_template: str = "auto"
    #: Share of steps whose completions the policy samples (TRL GKD's ``lmbda``); the others read each task's
    #: reference completion once (the dataset's output, a group of one), drawn per step from its seed.
    on_policy_fraction: float = 1.0

    @classmethod
    def from_config(cls, cfg: Any, src: Any = None, env: Any = None) -> Sampler:
        """The sampler ``cfg.rollout`` describes (``env``: the run's env, for multi-turn episodes)."""
        r = cfg.rollout
        names = ("temperature", "top_p", "top_k", "max_new_tokens", "max_prompt_length")
        sampling = {k: getattr(r, k) for k in names}
        gen = build_generator(cfg, src, env)
        return cls(gen, r.num_generations, sampling, cfg.model.chat_template, float(r.on_policy_fraction))

    def on_policy(self, seed: int) -> bool:
        """Whether the step sampled with ``seed`` samples the policy (else it reads the dataset's completions)."""
        f = self.on_policy_fraction
        return f >= 1 or (f > 0 and random.Random(derive_seed(seed, 17)).random() < f)

    def sample(
        self, policy: Any, tokenizer: Any, env: Any, tasks: Sequence[Mapping[str, Any]], seed: int
    ) -> tuple[Rollout, list[float], list[Any]]:
        """``(rollout, rewards, feedback)``: ``G`` completions of each task, scored by ``env`` (episodes score
        every turn themselves)."""
        if not self.on_policy(seed):
            return self.dataset(policy, tokenizer, env, tasks)
        if isinstance(self.generator, EpisodeGenerator):
            return self.generator.episodes(
                policy, tokenizer, env, tasks, self.num_generations, seed=seed, **self.sampling
            )
        ro = self.generate(policy, tokenizer, [task_prompt(t, tokenizer, self.chat_template) for t in tasks], seed)
        rewards = env_rewards(env, tasks, ro.completions, self.num_generations)
        return ro, rewards, [None] * len(rewards)

    def dataset(
        self, policy: Any, tokenizer: Any, env: Any, tasks: Sequence[Mapping[str, Any]]
    ) -> tuple[Rollout, list[float], list[Any]]:
        """An off-policy step's ``(rollout, rewards, feedback)``: each task once (``G = 1``) with its reference
        completion as the completion, scored by ``env`` as a sample would be."""
        texts = [reference_completion(t) for t in tasks]
        if any(x is None for x in texts):
            raise ConfigError(
                "rollout.on_policy_fraction < 1 trains on each task's reference completion, but the env's tasks "
                "carry no 'target' or 'solution'. HINT: set rollout.on_policy_fraction: 1.0",
                key="rollout.on_policy_fraction",
            )
        prompts = [task_prompt(t, tokenizer, self.chat_template) for t in tasks]
        dev = next(policy.parameters()).device
        p_ids, p_mask = tokenize_prompts(tokenizer, prompts, self.sampling.get("max_prompt_length"), dev)
        c_ids, c_mask = tokenize_completions(tokenizer, texts, int(self.sampling["max_new_tokens"]), dev)
        index = torch.arange(len(tasks), device=dev)
        ro = Rollout(p_ids, p_mask, c_ids, c_mask, list(texts), prompts, index, 1, extra={"on_policy": False})
        rewards = env_rewards(env, tasks, ro.completions, 1)
        return ro, rewards, [None] * len(rewards)

    def generate(self, policy: Any, tokenizer: Any, prompts: Sequence[str], seed: int) -> Rollout:
        """``G`` completions of each of ``prompts`` (already rendered), unscored."""
        return self.generator.generate(
            policy, tokenizer, list(prompts), self.num_generations, seed=seed, **self.sampling
        )

    def due(self, step: int) -> bool:
        """Whether the generator's engine wants the policy's weights before sampling ``step``."""
        return isinstance(self.generator, WeightSyncing) and self.generator.wants_sync(step)

    def sync(self, policy: Any, tokenizer: Any, step: int, out_dir: str | None = None, *, push: bool = True) -> None:
        """Push the policy's weights to the generator's engine when :meth:`due` (``push``: this rank pushes; every
        rank records the step)."""
        if not self.due(step):
            return
        if push:
            self.generator.sync(policy, tokenizer, step, out_dir=out_dir)
        self.generator.last_synced = step


#: Settings only the native path honours in full (the one sampler's compile, the Lightning module's kernel pick, the
#: one optimizer builder): a path that samples or optimises on its own refuses any value but the field's default.
OWN_PATH_SETTINGS = ("rollout.compile", "compute.kernels", "optim.fused")


def refuse_own_sampling(cfg: Any, src: Any, where: str, honours: Sequence[str] = ()) -> None:
    """Refuse, at its config line, a setting a path that samples or optimises on its own (an upstream trainer,
    actors with their own policy copies) cannot honour: ``rollout.generator`` other than ``hf``, multi-turn
    episodes, an off-policy share, and any of :data:`OWN_PATH_SETTINGS` not in ``honours`` set to other than its
    default. ``where``: the path, in words."""
    src = src if src is not None else Config()
    r = cfg.rollout
    gen = r.generator.get("name") if isinstance(r.generator, Mapping) else r.generator
    fix = "run it with the lightning backend or a local mode (they sample through the one Sampler)"
    if gen not in (None, "hf"):
        raise src.error("rollout.generator", f"{where} samples on its own, not with generator {gen!r}: {fix}.")
    if r.max_turns > 1:
        raise src.error("rollout.max_turns", f"{where} samples single-turn completions only: {fix}, or set 1.")
    if r.on_policy_fraction < 1:
        raise src.error("rollout.on_policy_fraction", f"{where} samples every step on its own: {fix}, or set 1.0.")
    for key in (k for k in OWN_PATH_SETTINGS if k not in honours):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        default = next(f.default for f in fields(getattr(cfg, section)) if f.name == name)
        if value != default:
            msg = f"{where} samples and optimises on its own and does not honour {name}={value!r}"
            raise src.error(key, f"{msg}: run it with the lightning backend, or leave it {default!r}.")


def hint_fields(
    record: StepRecord,
    env: Any,
    provider: Any,
    *,
    success_threshold: float,
    max_hinted: int | None = None,
    tokenizer: Any = None,
    chat_template: str = "auto",
    groups: Sequence[Any] | None = None,
) -> dict[str, list[Any]]:
    """``groups``, ``hint_contexts`` and ``hint_kinds`` of ``record``: a hinted context for each row the
    provider hints among :func:`~composer_plugins.training.step.record.hint_candidates`.

    ``groups`` (one :class:`~composer_plugins.envs.hints.SiblingGroup` per row): given by a trainer whose
    groups span processes (TRL); by default built from the record's contiguous groups of ``num_generations``.
    The contexts are rendered for ``tokenizer`` with ``chat_template``, as the student's prompts are.
    """
    n = record.num_rows
    if record.rewards is None:
        raise ValueError("hint contexts are chosen by reward: the record has no rewards")
    if groups is None:
        groups = record.groups or rollout_groups(
            record.completions, record.rewards, record.num_generations, success_threshold
        )
    groups = list(groups)
    rows = hint_candidates(provider, record.rewards, success_threshold, max_hinted)
    feedback = record.feedback or [None] * n
    contexts = teacher_contexts(
        env,
        provider,
        [record.task_of(i) for i in rows],
        [record.completions[i] for i in rows],
        [feedback[i] for i in rows],
        [groups[i] for i in rows],
        tokenizer=tokenizer,
        chat_template=chat_template,
    )
    kinds = provider.kinds(contexts) if hasattr(provider, "kinds") else [None] * len(contexts)
    out_c: list[str | None] = [None] * n
    out_k: list[str | None] = [None] * n
    for i, c, k in zip(rows, contexts, kinds, strict=True):
        out_c[i], out_k[i] = c, (k if c is not None else None)
    return {"groups": groups, "hint_contexts": out_c, "hint_kinds": out_k}


@dataclass
class ExperienceMaker:
    """Makes a step's whole :class:`~composer_plugins.training.step.record.StepRecord` (see the module docstring); built
    from config by :meth:`~composer_plugins.training.step.components.StepComponents.from_config`.

    Attributes:
        policy: the policy (the no-grad sampling-time log-probs, when asked for).
        tokenizer: its tokenizer (hinted contexts).
        env: the env (``feedback`` for the hint provider).
        hint_provider: a hint provider (or its registry spec, or an older-shape provider: adapted once when
            the maker is made); ``None``: no hinted contexts.
        reference: the frozen reference model; ``None``: no reference log-probs computed.
        teacher_scoring: the ``teacher_distill`` scorers' pool; ``None``: no teacher scoring.
        advantage_kwargs: ``rollout.advantage_kwargs`` of the group advantages; ``None``: the trainer
            computes its own (the record's ``advantages`` stay ``None`` unless given).
        temperature, chunk_size, rows_per_micro_batch: as :class:`~composer_plugins.training.step.assemble.StepPolicy`.
        success_threshold, max_hinted: which rows are hinted (``rollout.success_threshold``,
            ``hints.max_hinted_per_step``).
        chat_template: ``model.chat_template`` (hinted contexts, the teachers' conversations).
    """

    policy: Any = None
    tokenizer: Any = None
    env: Any = None
    hint_provider: Any = None
    reference: Any = None
    teacher_scoring: Any = None
    advantage_kwargs: Mapping[str, Any] | None = None
    temperature: float = 1.0
    chunk_size: int | None = None
    rows_per_micro_batch: Callable[[int], int] | None = None
    success_threshold: float = 1.0
    max_hinted: int | None = None
    chat_template: str = "auto"

    def __post_init__(self) -> None:
        if self.hint_provider is not None:  # a spec or an older-shape provider: adapted once, here
            self.hint_provider = build_hint_provider(self.hint_provider, key="hint_provider")

    @property
    def reads_groups(self) -> bool:
        """Whether the hint provider reads the rollout group (a trainer whose groups span processes gathers
        the siblings then, and gives them to :meth:`make` as ``groups``)."""
        return reads_groups(self.hint_provider)

    def make(
        self,
        tasks: Sequence[Mapping[str, Any]],
        rollout: Rollout,
        rewards: Sequence[float] | Tensor | None,
        feedback: Sequence[Any] | None = None,
        *,
        advantages: Tensor | None = None,
        old_logprobs: bool | Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        groups: Sequence[Any] | None = None,
        extras: Mapping[str, Any] | None = None,
    ) -> StepRecord:
        """The read-only record of ``tasks``' scored ``rollout``.

        ``old_logprobs``: ``True`` computes the sampling-time log-probs now (no grad; for
        ``rollout.num_iterations > 1``), a tensor is the trainer's. ``advantages``/``ref_logprobs``: the
        trainer's (else computed here when configured). ``groups``: as :func:`hint_fields`.
        """
        dev = rollout.completion_ids.device
        r = None if rewards is None else torch.as_tensor(rewards, dtype=torch.float32).to(dev)
        if advantages is None and r is not None and self.advantage_kwargs is not None:
            adv = group_advantages(r, rollout.num_generations, **self.advantage_kwargs)
            advantages = (adv[0] if isinstance(adv, tuple) else adv).detach().float()
        base = StepRecord.from_rollout(tasks, rollout, r, advantages, feedback, extras=extras or {})
        if self.teacher_scoring is not None:  # first: the scorers run while the forwards below do
            base = self._score(base)
        fields: dict[str, Any] = {}
        if isinstance(old_logprobs, Tensor):
            fields["old_logprobs"] = old_logprobs
        elif old_logprobs:
            fields["old_logprobs"] = self.logprobs(self.policy, base)
        if ref_logprobs is not None:
            fields["ref_logprobs"] = ref_logprobs
        elif self.reference is not None:
            fields["ref_logprobs"] = self.logprobs(self.reference, base)
        if self.hint_provider is not None and r is not None:
            kw = {"max_hinted": self.max_hinted, "tokenizer": self.tokenizer, "chat_template": self.chat_template}
            kw.update(success_threshold=self.success_threshold, groups=groups)
            fields.update(hint_fields(base, self.env, self.hint_provider, **kw))
        return base.replace(**fields) if fields else base

    def from_state(self, state: Mapping[str, Any]) -> StepRecord:
        """The record a checkpoint kept (:meth:`StepRecord.state`), with teacher scoring started again: teacher
        scores (futures) are not checkpointed, so a resumed step's rows are scored anew."""
        rec = StepRecord.from_state(state)
        return self._score(rec) if self.teacher_scoring is not None else rec

    def _score(self, rec: StepRecord) -> StepRecord:
        """``rec`` with every row submitted to every scorer (``teacher_scores``: the futures)."""
        job = self.teacher_scoring.submit(score_requests(rec, self.chat_template))
        return rec.replace(teacher_scores=dict(job.futures))

    def logprobs(self, model: Any, rec: StepRecord) -> Tensor:
        """``model``'s per-token log-probs of ``rec``'s completions, without gradient, chunked."""
        width = int(rec.prompt_ids.shape[1] + rec.completion_ids.shape[1])
        mb = self.rows_per_micro_batch(width) if self.rows_per_micro_batch is not None else None
        ids = (rec.prompt_ids, rec.prompt_mask, rec.completion_ids, rec.completion_mask)
        kw = {"completion_attention_mask": rec.attention_mask, "micro_batch_size": mb, "chunk_size": self.chunk_size}
        return completion_logprobs_no_grad(model, *ids, temperature=self.temperature, **kw)


class StepComputer:
    """The one local step: the composed loss of the current policy on a read-only record.

    Args:
        composer: the :class:`~composer_plugins.losses.base.ChannelComposer` of the live channels.
        policy: the :class:`~composer_plugins.training.step.assemble.StepPolicy` (or a callable returning one).
        success_threshold: for the reward statistics (``reward``, ``pass@G`` ...).
        data_parallel: pass the data-parallel token normalisers (the native path; TRL gives its own).
    """

    def __init__(
        self,
        composer: Any,
        policy: StepPolicy | Callable[[], StepPolicy],
        *,
        success_threshold: float = 1.0,
        data_parallel: bool = True,
    ) -> None:
        self.composer = composer
        self.policy = policy
        self.success_threshold = float(success_threshold)
        self.data_parallel = data_parallel

    def loss(
        self,
        record: StepRecord,
        meta: StepMeta,
        *,
        given: Mapping[str, Any] | None = None,
        policy: StepPolicy | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """``(loss, stats)``: every channel input built once from ``record`` (micro-batched forwards, chunked LM
        head: ``compute``) and summed by the composer."""
        if policy is None:  # a trainer whose models change per call (TRL's wrapped model) passes its own
            policy = self.policy() if callable(self.policy) else self.policy
        extra = dict(given or {})
        if self.data_parallel:  # the global token normalisers: each rank's loss is its share of the union's
            rows = record.hint_rows
            hinted = float(record.completion_mask[rows].sum()) if rows else 0.0
            needs = self.composer.needs_teacher
            extra = {**dp_normalisers(record.completion_mask, hinted if needs else None), **extra}
        inputs, stats = assemble_inputs(record, self.composer, policy, meta=meta, given=extra)
        loss, metrics = self.composer(inputs)
        stats.update(scalar_metrics(metrics))
        if record.rewards is not None:
            stats.update(reward_stats(record.rewards, record.num_generations, self.success_threshold))
        stats["completion_tokens"] = float(record.completion_mask.sum())
        stats["completion_length"] = float(record.completion_mask.sum(1).float().mean())
        return loss, stats
