"""One RL step's data as one read-only record: :class:`StepRecord`, and the step's meta: :class:`StepMeta`.

The one experience maker makes the record and after that nobody writes it: an assignment raises
:class:`RecordFrozenError` naming the file and line that tried; the assembler only reads it, and what a
trainer lacks stays ``None``. As verl's ``DataProto``: row ``i`` of every per-row field is the same
completion (checked at construction), the row operations make new records, and the per-step meta is a
:class:`StepMeta` apart. See docs/training.md "One training step".
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import inspect
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.models.generation import Rollout

__all__ = ["RecordFrozenError", "Rollout", "StepMeta", "StepRecord", "hint_candidates", "sample_pairs"]

#: The annotation of a per-row list field (``RowList[str]``: one entry per row; empty: not computed). With
#: ``Tensor`` (every tensor field is per row, ``(N, ...)``) it is what :data:`ROW_TENSORS` and :data:`ROW_LISTS`
#: are read from: a field added to :class:`StepRecord` is selected, concatenated, moved and checked by its type.
RowList = Sequence


class RecordFrozenError(ComposerPluginsError, AttributeError):
    """A write to a :class:`StepRecord` after the experience maker made it."""


@dataclass(frozen=True)
class StepMeta:
    """What one optimizer step adds to a record: kept apart from the per-row fields.

    Attributes:
        step: the optimizer step (schedules inside channels: TAID's ``t``, step-scheduled hints).
        total_steps: the run's length (``None``: unknown).
        pairs: the preference pairs (``prompt``, ``chosen``, ``rejected``) sampled for this step.
    """

    step: int = 0
    total_steps: int | None = None
    pairs: tuple[Mapping[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "pairs", tuple(self.pairs))


@dataclass(eq=False)
class StepRecord:
    """The scored rollouts of one step and every no-grad field computed from them; read-only once made.

    Attributes:
        tasks: the step's tasks (the env's task dicts); row ``i`` answers ``tasks[group_index[i]]``.
        prompts: prompt text, one per row.
        completions: completion text, one per row.
        prompt_ids, prompt_mask: ``(N, P)`` left-padded prompt tokens and their mask.
        completion_ids, completion_mask: ``(N, C)`` right-padded completion tokens; the mask is 1 on the
            tokens that are trained on (multi-turn: actions only).
        rewards: ``(N,)`` env rewards (unscorable: NaN); ``None``: the trainer has none (a reward model's).
        advantages: ``(N,)`` group-relative advantages; ``None``: the trainer computes its own.
        num_generations: ``G``, completions per prompt.
        group_index: ``(N,)`` the task each row answers (``None``: row ``i`` answers task ``i // G``).
        feedback: the env's feedback per row (``None`` entries: read from ``env.feedback`` when needed).
        groups: one :class:`~composer_plugins.envs.hints.SiblingGroup` per row (empty: not computed).
        hint_contexts: the hinted teacher context per row, ``None`` for rows without a hint (empty: none).
        hint_kinds: the hint kind per hinted row (a chain's member), ``None`` elsewhere.
        attention_mask: ``(N, C)`` completion positions attended to (multi-turn: actions and
            observations); ``None``: the completion mask.
        sampling_logprobs: ``(N, C)`` the inference engine's log-probs of the sampled tokens (a server
            generator), for the importance-sampling correction; ``None`` with HF ``generate``.
        old_logprobs: ``(N, C)`` sampling-time log-probs computed apart (``num_iterations > 1``, TRL's
            ``old_per_token_logps``); ``None``: the first forward's, detached.
        ref_logprobs: ``(N, C)`` the reference model's log-probs, when a channel needs them.
        teacher_scores: teacher name → per-row top-k scores of the student's tokens, or the future of them
            (scoring started by the experience maker; empty without a scorer).
        extras: third-party inputs by name (a key here is handed to the channels as is).
    """

    tasks: Sequence[Mapping[str, Any]]
    prompts: RowList[str]
    completions: RowList[str]
    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    rewards: Tensor | None = None
    advantages: Tensor | None = None
    num_generations: int = 1
    group_index: Tensor | None = None
    feedback: RowList[Any] = ()
    groups: RowList[Any] = ()
    hint_contexts: RowList[str | None] = ()
    hint_kinds: RowList[str | None] = ()
    attention_mask: Tensor | None = None
    sampling_logprobs: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    teacher_scores: Mapping[str, Any] = field(default_factory=dict)
    extras: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "tasks", tuple(self.tasks))
        for name in ROW_LISTS:
            put(self, name, tuple(getattr(self, name) or ()))
        put(self, "teacher_scores", MappingProxyType(dict(self.teacher_scores)))
        put(self, "extras", MappingProxyType(dict(self.extras)))
        put(self, "num_generations", int(self.num_generations))
        self._check()
        put(self, "_sealed", True)

    def _check(self) -> None:
        """DataProto's consistency check: every per-row field has the record's ``N`` rows."""
        n = int(self.completion_ids.shape[0])
        bad = [
            f"{k} has {int(v.shape[0])} rows"
            for k in ROW_TENSORS
            if isinstance(v := getattr(self, k), Tensor) and (v.dim() == 0 or int(v.shape[0]) != n)
        ]
        bad += [f"{k} has {len(getattr(self, k))} entries" for k in ROW_LISTS if len(getattr(self, k)) not in (0, n)]
        if bad:
            raise ValueError(f"StepRecord of {n} rows (completion_ids): " + "; ".join(bad))

    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_sealed"):
            object.__setattr__(self, name, value)
            return
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None and frame.f_back is not None else frame
        where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
        raise RecordFrozenError(
            f"{where}: StepRecord.{name} is read-only once the experience maker made the record. Fix: give "
            "it to composer_plugins.training.step.experience.ExperienceMaker.make (or build a new record with "
            "record.replace(...)); the step, total steps and pairs are a StepMeta passed to assemble_inputs."
        )

    def __delattr__(self, name: str) -> None:
        raise RecordFrozenError(f"StepRecord.{name} cannot be deleted: the record is read-only")

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_rollout(
        cls,
        tasks: Sequence[Mapping[str, Any]],
        rollout: Rollout,
        rewards: Tensor | None = None,
        advantages: Tensor | None = None,
        feedback: Sequence[Any] | None = None,
        **kw: Any,
    ) -> StepRecord:
        """A record from a generator's :class:`~composer_plugins.models.generation.Rollout` and its scores."""
        own = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout) if f.name != "extra"}
        ex = {k: rollout.extra.get(k) for k in ("attention_mask", "sampling_logprobs")}
        return cls(tasks=tasks, rewards=rewards, advantages=advantages, feedback=feedback or (), **own, **ex, **kw)

    def replace(self, **changes: Any) -> StepRecord:
        """A new record with ``changes`` (checked as at construction; tensors shared, not copied)."""
        return dataclasses.replace(self, **changes)

    # -- reading ----------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """``N``, the number of completions."""
        return int(self.completion_ids.shape[0])

    @property
    def row_groups(self) -> list[int]:
        """The task index of each row (``group_index``, else ``i // G``)."""
        if self.group_index is not None:
            return [int(g) for g in self.group_index.tolist()]
        G = max(1, self.num_generations)
        return [i // G for i in range(self.num_rows)]

    def task_of(self, row: int) -> Mapping[str, Any]:
        """The task row ``row`` answers."""
        return self.tasks[self.row_groups[row]]

    @property
    def hint_rows(self) -> list[int]:
        """The rows that got a hinted teacher context, in order."""
        return [i for i, c in enumerate(self.hint_contexts) if c is not None]

    @property
    def hinted_contexts(self) -> list[str]:
        """The teacher contexts of :attr:`hint_rows`, in the same order."""
        return [c for c in self.hint_contexts if c is not None]

    # -- row operations (verl's DataProto: select_idxs, chunk, concat, to) ---------------------------
    def select(self, index: Sequence[int] | Tensor) -> StepRecord:
        """The rows ``index`` as a record (its tasks kept, ``group_index`` pointing into them)."""
        idx = torch.as_tensor(index, dtype=torch.long).reshape(-1).cpu()
        rows = idx.tolist()
        out: dict[str, Any] = {}
        for k in ROW_TENSORS:
            v = getattr(self, k)
            out[k] = v[idx.to(v.device)] if isinstance(v, Tensor) else v
        if out["group_index"] is None:
            out["group_index"] = torch.tensor(self.row_groups, device=self.completion_ids.device)[idx]
        for k in ROW_LISTS:
            v = getattr(self, k)
            out[k] = [v[i] for i in rows] if v else ()
        scores = {name: _select_scores(s, rows) for name, s in self.teacher_scores.items()}
        extras = {k: _select_extra(v, idx, self.num_rows) for k, v in self.extras.items()}
        return dataclasses.replace(self, teacher_scores=scores, extras=extras, **out)

    @classmethod
    def concat(cls, records: Sequence[StepRecord], pad_id: int = 0) -> StepRecord:
        """The records' rows in order, one record: prompts re-left-padded, completions re-right-padded,
        tasks appended (``group_index`` offset). Teacher scoring starts after the merge: records with
        scores are refused."""
        recs = [r for r in records if r.num_rows]
        if not recs:
            raise ValueError("StepRecord.concat: no rows")
        if any(r.teacher_scores for r in recs):
            raise ValueError("StepRecord.concat: merge records before teacher scoring starts (scores hold futures)")
        G = {r.num_generations for r in recs}
        if len(G) != 1:
            raise ValueError(f"StepRecord.concat: records of different num_generations {sorted(G)}")
        P = max(int(r.prompt_ids.shape[1]) for r in recs)
        C = max(int(r.completion_ids.shape[1]) for r in recs)
        out: dict[str, Any] = {}
        for k in ROW_TENSORS:
            vals = [getattr(r, k) for r in recs]
            if k == "group_index":
                offs, parts = 0, []
                for r in recs:
                    parts.append(torch.tensor(r.row_groups, device=r.completion_ids.device) + offs)
                    offs += len(r.tasks) or (max(r.row_groups) + 1)
                out[k] = torch.cat(parts)
            elif all(v is None for v in vals):
                out[k] = None
            elif any(v is None for v in vals):
                raise ValueError(f"StepRecord.concat: {k} is set in some records and not in others")
            elif vals[0].dim() == 1:
                out[k] = torch.cat(vals)
            else:
                left = k.startswith("prompt")
                width = P if left else C
                value = pad_id if k.endswith("_ids") else 0
                out[k] = torch.cat([_pad(v, width, value, left) for v in vals])
        for k in ROW_LISTS:
            have = [bool(getattr(r, k)) for r in recs]
            out[k] = [x for r in recs for x in (getattr(r, k) or [None] * r.num_rows)] if any(have) else ()
        extras = {k: v for r in recs for k, v in r.extras.items()}
        tasks = [t for r in recs for t in r.tasks]
        return cls(tasks=tasks, num_generations=G.pop(), extras=extras, **out)

    def to(self, device: Any) -> StepRecord:
        """The record with its tensors on ``device``."""
        moved = {k: v.to(device) for k in ROW_TENSORS if isinstance(v := getattr(self, k), Tensor)}
        return dataclasses.replace(self, **moved)

    # -- checkpoint --------------------------------------------------------------------------
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
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> StepRecord:
        """The record :meth:`state` wrote."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(state) - names)
        if unknown:
            raise ValueError(f"not fields of a StepRecord: {unknown} (fields: {sorted(names)})")
        return cls(**state)


#: Per-row tensor fields, ``(N, ...)``, and per-row list fields, read from :class:`StepRecord`'s annotations.
ROW_TENSORS: tuple[str, ...] = tuple(f.name for f in fields(StepRecord) if str(f.type).startswith("Tensor"))
ROW_LISTS: tuple[str, ...] = tuple(f.name for f in fields(StepRecord) if str(f.type).startswith("RowList["))


def _pad(x: Tensor, width: int, value: int, left: bool) -> Tensor:
    n = width - int(x.shape[1])
    return torch.nn.functional.pad(x, (n, 0) if left else (0, n), value=value) if n else x


def _select_scores(scores: Any, rows: list[int]) -> Any:
    """A teacher's scores of ``rows``: a list picked, a packed ``TeacherTopK`` indexed, a future mapped."""
    if isinstance(scores, cf.Future):
        out: cf.Future = cf.Future()

        def done(f: cf.Future) -> None:
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(_select_scores(f.result(), rows))

        scores.add_done_callback(done)
        return out
    if scores is None:
        return None
    if hasattr(scores, "rows"):
        return scores.rows(rows)
    return [scores[i] for i in rows]


def _select_extra(value: Any, idx: Tensor, n: int) -> Any:
    if isinstance(value, Tensor) and value.dim() and int(value.shape[0]) == n:
        return value[idx.to(value.device)]
    if isinstance(value, list | tuple) and len(value) == n:
        return [value[i] for i in idx.tolist()]
    return value


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
