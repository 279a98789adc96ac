"""One RL step's data as one typed record: :class:`StepRecord`.

Every trainer fills one the same way — rollout (prompts, completions, token tensors) → env scores
(``rewards``, ``feedback``) → group ``advantages`` → the rollout ``groups`` and hinted teacher contexts
(:func:`add_hint_contexts`) → teacher/reference outputs — and hands it to the one assembler of channel
inputs (:func:`composer_plugins.training.assemble.assemble_inputs`). The native Lightning module and the
TRL, VeRL, PRIME-RL and Monarch adapters build the same record; nothing downstream reads untyped dicts.

As verl's ``DataProto`` and OpenRLHF's ``Experience``: row ``i`` of every per-row field is the same
completion (``N = len(tasks) × num_generations`` rows; row ``i`` answers ``tasks[i // G]`` where the
trainer keeps groups contiguous).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from composer_plugins.models.generation import Rollout

__all__ = ["Rollout", "StepRecord", "add_hint_contexts", "hint_candidates", "sample_pairs"]


@dataclass
class StepRecord:
    """The scored rollouts of one step and everything computed from them before the policy's forward.

    Attributes:
        tasks: the step's tasks (one per prompt; the env's task dicts).
        prompts: prompt text, one per row.
        completions: completion text, one per row.
        prompt_ids, prompt_mask: ``(N, P)`` left-padded prompt tokens and their mask.
        completion_ids, completion_mask: ``(N, C)`` right-padded completion tokens; the mask is 1 on the
            tokens that are trained on (multi-turn: actions only).
        rewards: ``(N,)`` env rewards.
        advantages: ``(N,)`` group-relative advantages.
        num_generations: ``G``, completions per prompt.
        group_index: ``(N,)`` the prompt each row belongs to (``None`` where a trainer shuffled rows).
        feedback: the env's feedback per row (``None`` entries: read from ``env.feedback`` when needed).
        groups: one :class:`~composer_plugins.envs.hints.SiblingGroup` per row (empty until computed).
        hint_contexts: the hinted teacher context per row, ``None`` for rows without a hint (empty: none).
        attention_mask: ``(N, C)`` completion positions attended to (multi-turn: actions and
            observations); ``None``: the completion mask.
        sampling_logprobs: ``(N, C)`` the inference engine's log-probs of the sampled tokens (a server
            generator), for the importance-sampling correction; ``None`` with HF ``generate``.
        old_logprobs: ``(N, C)`` sampling-time log-probs when they were computed apart (``num_iterations > 1``,
            TRL's ``old_per_token_logps``); ``None``: the first forward's, detached.
        ref_logprobs: ``(N, C)`` the reference model's log-probs, when a channel needs them.
        pairs: the preference pairs (``prompt``, ``chosen``, ``rejected``) sampled for this step.
        step, total_steps: the optimizer step and the run's length (schedules inside channels).
        teacher_scores: teacher name → per-row top-k scores of the student's tokens
            (``TeacherScores``, filled by a teacher channel's scorer; empty without one).
        extras: third-party inputs by name (a key here is handed to the channels as is).
    """

    tasks: list[Mapping[str, Any]]
    prompts: list[str]
    completions: list[str]
    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    rewards: Tensor
    advantages: Tensor
    num_generations: int = 1
    group_index: Tensor | None = None
    feedback: list[Any] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)
    hint_contexts: list[str | None] = field(default_factory=list)
    hint_kinds: list[str | None] = field(default_factory=list)
    attention_mask: Tensor | None = None
    sampling_logprobs: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    pairs: list[Mapping[str, str]] = field(default_factory=list)
    step: int = 0
    total_steps: int | None = None
    teacher_scores: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_rollout(
        cls,
        tasks: Sequence[Mapping[str, Any]],
        rollout: Rollout,
        rewards: Tensor,
        advantages: Tensor,
        feedback: Sequence[Any] | None = None,
        **kw: Any,
    ) -> StepRecord:
        """A record from a generator's :class:`~composer_plugins.models.generation.Rollout` and its scores."""
        ex = rollout.extra
        return cls(
            tasks=list(tasks),
            prompts=list(rollout.prompts),
            completions=list(rollout.completions),
            prompt_ids=rollout.prompt_ids,
            prompt_mask=rollout.prompt_mask,
            completion_ids=rollout.completion_ids,
            completion_mask=rollout.completion_mask,
            rewards=rewards,
            advantages=advantages,
            num_generations=rollout.num_generations,
            group_index=rollout.group_index,
            feedback=list(feedback) if feedback is not None else [None] * len(rollout.completions),
            attention_mask=ex.get("attention_mask"),
            sampling_logprobs=ex.get("sampling_logprobs"),
            **kw,
        )

    @property
    def rollout(self) -> Rollout:
        """The rollout part as a :class:`~composer_plugins.models.generation.Rollout` (a view, not a copy)."""
        extra = {
            k: v
            for k, v in (("attention_mask", self.attention_mask), ("sampling_logprobs", self.sampling_logprobs))
            if v is not None
        }
        n = self.completion_ids.shape[0]
        gi = (
            self.group_index
            if self.group_index is not None
            else torch.arange(n, device=self.completion_ids.device) // max(1, self.num_generations)
        )
        return Rollout(
            self.prompt_ids,
            self.prompt_mask,
            self.completion_ids,
            self.completion_mask,
            list(self.completions),
            list(self.prompts),
            gi,
            self.num_generations,
            extra,
        )

    @property
    def num_rows(self) -> int:
        """``N``, the number of completions."""
        return int(self.completion_ids.shape[0])

    @property
    def hint_rows(self) -> list[int]:
        """The rows that got a hinted teacher context, in order."""
        return [i for i, c in enumerate(self.hint_contexts) if c is not None]

    @property
    def hinted_contexts(self) -> list[str]:
        """The teacher contexts of :attr:`hint_rows`, in the same order."""
        return [c for c in self.hint_contexts if c is not None]

    def state(self) -> dict[str, Any]:
        """Plain data (tensors, lists, dicts) for a checkpoint; :meth:`from_state` inverts it."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "tasks":
                v = [dict(t) for t in v]
            elif f.name == "groups":
                continue  # recomputed from completions and rewards where needed
            elif f.name == "teacher_scores":
                v = {}  # futures and per-row objects: a resumed step scores its rows again
            elif f.name == "extras":
                v = {k: x for k, x in v.items() if isinstance(x, Tensor | int | float | str | list)}
            out[f.name] = list(v) if isinstance(v, list) else v
        return out

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> StepRecord:
        """The record :meth:`state` wrote."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(state) - names)
        if unknown:
            raise ValueError(f"not fields of a StepRecord: {unknown} (fields: {sorted(names)})")
        return cls(**dict(state))


def add_hint_contexts(
    record: StepRecord,
    env: Any,
    provider: Any,
    *,
    success_threshold: float,
    max_hinted: int | None = None,
    tokenizer: Any = None,
    chat_template: str = "auto",
) -> StepRecord:
    """Fill ``record.groups`` and ``record.hint_contexts``: a hinted context for each failed row the provider hints.

    The rows offered to the provider are :func:`hint_candidates`. Rows must be laid out in contiguous
    groups of ``num_generations``. The contexts are rendered for ``tokenizer`` with ``chat_template``
    (:mod:`composer_plugins.training.chat`), as the student's prompts are.
    """
    from composer_plugins.training.batches import rollout_groups, teacher_contexts

    G = record.num_generations
    n = record.num_rows
    failed = hint_candidates(provider, record.rewards, success_threshold, max_hinted)
    if not record.groups:
        record.groups = rollout_groups(record.completions, record.rewards, G, success_threshold)
    feedback = record.feedback or [None] * n
    contexts = teacher_contexts(
        env,
        provider,
        [record.tasks[i // G] for i in failed],
        [record.completions[i] for i in failed],
        [feedback[i] for i in failed],
        [record.groups[i] for i in failed],
        tokenizer=tokenizer,
        chat_template=chat_template,
    )
    record.hint_contexts = [None] * n
    record.hint_kinds = [None] * n
    kinds = provider.kinds(contexts) if hasattr(provider, "kinds") else [None] * len(contexts)
    for i, c, k in zip(failed, contexts, kinds, strict=True):
        record.hint_contexts[i] = c
        record.hint_kinds[i] = k if c is not None else None
    return record


def hint_candidates(provider: Any, rewards: Any, success_threshold: float, max_hinted: int | None = None) -> list[int]:
    """The rows offered to a hint provider: the failed ones (reward below ``success_threshold``), or every
    row for a provider whose ``rows`` is ``all`` (SDPO's rule: successful rows get a sibling's demonstration
    too); the first ``max_hinted`` of them."""
    values = [float(r) for r in (rewards.tolist() if hasattr(rewards, "tolist") else rewards)]
    if getattr(provider, "rows", "failed") == "all":
        rows = list(range(len(values)))
    else:
        rows = [i for i, r in enumerate(values) if not r >= success_threshold]
    return rows if max_hinted is None else rows[:max_hinted]


def sample_pairs(pairs: Sequence[Mapping[str, str]], k: int, seed: int) -> list[Mapping[str, str]]:
    """``min(k, len(pairs))`` preference pairs drawn without replacement with ``random.Random(seed)``."""
    if not pairs or k <= 0:
        return []
    rng = random.Random(seed)
    return [pairs[i] for i in rng.sample(range(len(pairs)), min(int(k), len(pairs)))]
