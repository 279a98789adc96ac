"""The one assembler of channel inputs: a :class:`~composer_plugins.training.step.StepRecord` and a policy in,
each active channel's inputs out.

:func:`assemble_inputs` asks the composer which inputs its active channels read
(:meth:`~composer_plugins.losses.base.ChannelComposer.required_inputs`) and builds exactly those, each by
the builder :data:`INPUT_BUILDERS` names for it. The native :class:`~composer_plugins.training.module.ComposerModule`
and every backend adapter call it; a trainer that already holds an input (TRL's per-token log-probs
and token normaliser) passes it as ``given`` and its builder does not run.

Adding a channel input is one edit: a builder registered here (or by a plugin) with
:func:`register_input_builder`, and the name in the channel's ``requires``::

    @register_input_builder("my_scores")
    def my_scores(asm: Assembly) -> dict[str, Any]:
        return {"my_scores": asm.record.rewards * 2}

A builder receives the :class:`Assembly` (the record, the policy, inputs built so far through
:meth:`Assembly.get`, ``stats`` to report into) and returns a dict of inputs; one builder may provide
several names (the hint builder gives the student and teacher hidden states, the LM head and the mask).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from composer_plugins.core.errors import ComposerPluginsError, closest
from composer_plugins.training.step import StepRecord

__all__ = [
    "HINT_INPUTS",
    "INPUT_BUILDERS",
    "PAIR_INPUTS",
    "Assembly",
    "InputBuilder",
    "MissingInputError",
    "Needs",
    "StepPolicy",
    "assemble_inputs",
    "register_input_builder",
]

#: ``builder(assembly) -> {input name: value}``.
InputBuilder = Callable[["Assembly"], Mapping[str, Any]]

#: The one table of input builders: input name -> the function that builds it.
INPUT_BUILDERS: dict[str, InputBuilder] = {}

#: Inputs built beside an input a channel declares, which the channels that declare it read when present
#: (the policy channels' sampling-time log-probs and importance-sampling ratio).
COMPANIONS: dict[str, tuple[str, ...]] = {
    "logprobs": ("old_logprobs", "inference_logprobs", "importance_sampling_ratio")
}

#: Inputs built for every step whatever the channels declare (cheap: read from the record).
ALWAYS = (
    "completion_mask",
    "completion_ids",
    "advantages",
    "rewards",
    "num_generations",
    "group_index",
    "global_step",
    "total_steps",
)


class Needs:
    """The inputs a trainer's own loss reads, declared as a composer's active channels would declare them
    (for adapters whose loss is the upstream trainer's: VeRL, PRIME-RL)."""

    def __init__(self, *names: str) -> None:
        self.names = tuple(names)
        self.channels: list[Any] = []

    def required_inputs(self) -> tuple[str, ...]:
        return self.names


class MissingInputError(ComposerPluginsError):
    """A channel reads an input that no builder provides and the trainer did not give."""


def register_input_builder(*names: str, replace: bool = False) -> Callable[[InputBuilder], InputBuilder]:
    """Decorator: ``fn`` builds the inputs ``names`` (refused if a name has a builder, unless ``replace``)."""

    def deco(fn: InputBuilder) -> InputBuilder:
        taken = [n for n in names if n in INPUT_BUILDERS and INPUT_BUILDERS[n] is not fn]
        if taken and not replace:
            owners = ", ".join(
                f"{n!r} by {getattr(INPUT_BUILDERS[n], '__qualname__', INPUT_BUILDERS[n])}" for n in taken
            )
            raise ValueError(f"input(s) already built: {owners}; pass replace=True to override")
        for n in names:
            INPUT_BUILDERS[n] = fn
        return fn

    return deco


@dataclass
class StepPolicy:
    """The models and settings that turn a record into channel inputs.

    Attributes:
        model: the policy being optimised (its forwards record gradients).
        tokenizer: its tokenizer (hinted contexts, preference pairs).
        teacher: the module scoring the hinted contexts (an :class:`~composer_plugins.training.ema.EMATeacher`);
            ``None``: the policy itself, without gradient.
        reference: the frozen reference model (``ref_logprobs``, the pairs' reference log-probs);
            ``None``: the policy, without gradient.
        temperature: the sampling temperature (log-probs and hint distributions are taken at it).
        chunk_size: LM-head rows per chunk (``None``: chosen from the vocabulary).
        rows_per_micro_batch: ``f(sequence length) -> rows`` per forward micro-batch (``None``: all rows).
        max_context_length: hinted-context tokens kept (from the right).
        pair_prompt_length, pair_max_length: prompt and completion tokens kept per preference pair.
        importance_sampling: ``(mode, max, min)`` of the correction from a server's sampling log-probs
            (``rollout.importance_sampling``); ``None`` or mode ``off``: no correction.
        teacher_scoring: the ``teacher_distill`` scorers' pool (:func:`~composer_plugins.training.teacher_scores.
            build_teacher_scoring`): the ``teacher_scores`` builder starts it on a record not yet scored and
            waits for it up to its ``deadline_s`` (a teacher past it is skipped for the batch).
    """

    model: Any
    tokenizer: Any
    teacher: Any = None
    reference: Any = None
    temperature: float = 1.0
    chunk_size: int | None = None
    rows_per_micro_batch: Callable[[int], int] | None = None
    max_context_length: int = 256
    pair_prompt_length: int = 256
    pair_max_length: int = 128
    importance_sampling: tuple[str, float, float | None] | None = None
    teacher_scoring: Any = None

    def micro_batch(self, *tensors: Tensor) -> int | None:
        """Rows per micro-batch for sequences as long as the concatenated ``tensors``."""
        if self.rows_per_micro_batch is None:
            return None
        return self.rows_per_micro_batch(sum(int(t.shape[1]) for t in tensors))


@dataclass
class Assembly:
    """One assembly in progress: what builders read and write."""

    record: StepRecord
    policy: StepPolicy
    required: tuple[str, ...]
    values: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    #: Intermediate results builders share (``policy_hidden``: the student's hidden states).
    scratch: dict[str, Any] = field(default_factory=dict)
    _ran: set[int] = field(default_factory=set)

    def wants(self, name: str) -> bool:
        """True when some active channel reads ``name``."""
        return name in self.required

    def get(self, name: str) -> Any:
        """Input ``name``, built now if it was not (``None`` when its builder does not provide it)."""
        if name not in self.values:
            builder = INPUT_BUILDERS.get(name)
            if builder is not None and id(builder) not in self._ran:
                self._ran.add(id(builder))
                for k, v in builder(self).items():
                    self.values.setdefault(k, v)
        return self.values.get(name)

    @property
    def device(self) -> torch.device:
        return self.record.completion_ids.device


def assemble_inputs(
    record: StepRecord, composer: Any, policy: StepPolicy, *, given: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, float]]:
    """``(inputs, stats)``: every input the active channels of ``composer`` read, built from ``record``.

    ``given``: inputs the trainer already holds (their builders do not run); ``record.extras`` is
    given too. Pass ``inputs`` to the composer as both its model outputs and its batch:
    ``composer(inputs, inputs)``. ``stats`` holds what the builders measured (``hint/rows`` ...).
    Raises :class:`MissingInputError` naming the channel for an input nothing provides.
    """
    required = tuple(composer.required_inputs())
    asm = Assembly(record, policy, required)
    asm.values.update({k: v for k, v in record.extras.items() if v is not None})
    asm.values.update({k: v for k, v in (given or {}).items() if v is not None})
    for name in (*ALWAYS, *required):
        if name in asm.values:
            continue
        if name not in INPUT_BUILDERS:
            raise MissingInputError(_missing_message(name, composer))
        asm.get(name)
    for name in required:
        for extra in COMPANIONS.get(name, ()):
            if extra not in asm.values:
                asm.get(extra)
    return asm.values, asm.stats


def _missing_message(name: str, composer: Any) -> str:
    readers = [c.name for c in composer.channels if c.weight != 0.0 and name in _channel_inputs(c)]
    near = closest(name, list(INPUT_BUILDERS))
    sugg = f" Did you mean: {', '.join(map(repr, near))}?" if near else ""
    have = ", ".join(sorted(INPUT_BUILDERS))
    return (
        f"loss channel {', '.join(map(repr, readers)) or '?'} reads the input {name!r}, which no input builder "
        f"provides — register one with @register_input_builder({name!r}) (composer_plugins.training.assemble), "
        f"or put it in StepRecord.extras. Inputs with a builder: {have}.{sugg}"
    )


def _channel_inputs(ch: Any) -> tuple[str, ...]:
    opts = tuple(k for grp in getattr(ch, "input_options", ()) or () for k in grp)
    return tuple(ch.required_inputs()) + opts


# -- the built-in builders ------------------------------------------------------------------------
@register_input_builder(*ALWAYS)
def record_fields(asm: Assembly) -> dict[str, Any]:
    """What the record holds as is: masks, ids, rewards, advantages, group layout, the step."""
    r = asm.record
    return {
        "completion_mask": r.completion_mask.float(),
        "completion_ids": r.completion_ids,
        "advantages": r.advantages,
        "rewards": r.rewards,
        "num_generations": r.num_generations,
        "group_index": r.group_index,
        "global_step": r.step,
        "total_steps": r.total_steps,
    }


@register_input_builder("logprobs", "old_logprobs", "inference_logprobs", "importance_sampling_ratio")
def policy_logprobs(asm: Assembly) -> dict[str, Any]:
    """The policy's per-token log-probs of the completions (with grad, chunked from hidden states), the
    sampling-time ones, and the importance-sampling correction from an inference server's."""
    from composer_plugins.models.logprobs import completion_logprobs, completion_logprobs_no_grad

    r, p = asm.record, asm.policy
    logps = asm.values.get("logprobs")
    args = (p.model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    kw = {
        "temperature": p.temperature,
        "completion_attention_mask": r.attention_mask,
        "micro_batch_size": p.micro_batch(r.prompt_ids, r.completion_ids),
        "chunk_size": p.chunk_size,
    }
    old = r.old_logprobs
    if logps is None and asm.wants("logprobs"):
        out = completion_logprobs(*args, return_hidden=asm.wants("student_hidden") or asm.wants("hidden_states"), **kw)
        logps, hidden = out if isinstance(out, tuple) else (out, None)
        asm.scratch["policy_hidden"] = hidden
    if old is None:  # the sampling-time log-probs: this forward's, detached (or one without gradient)
        old = logps.detach() if logps is not None else completion_logprobs_no_grad(*args, **kw)
    values: dict[str, Any] = {"logprobs": logps, "old_logprobs": old}
    sampling = r.sampling_logprobs
    if sampling is None:
        # HF generate samples from this policy: the inference engine's log-probs are the sampling-time ones
        values["inference_logprobs"] = old
        return values
    values["inference_logprobs"] = sampling
    mode = p.importance_sampling
    if mode is not None and mode[0] != "off" and old is not None:
        from composer_plugins.losses.functional import importance_sampling_correction

        ratio = importance_sampling_correction(old, sampling, r.completion_mask, mode[0], mode[1], mode[2])
        values["importance_sampling_ratio"] = ratio
        m = r.completion_mask.float()
        asm.stats["is_ratio"] = float((ratio.expand_as(m) * m).sum() / m.sum().clamp(min=1))
    return values


@register_input_builder("ref_logprobs")
def reference_logprobs(asm: Assembly) -> dict[str, Any]:
    """The reference model's log-probs (the record's, else computed now without gradient)."""
    from composer_plugins.models.logprobs import completion_logprobs_no_grad

    r, p = asm.record, asm.policy
    if r.ref_logprobs is not None:
        return {"ref_logprobs": r.ref_logprobs}
    ref = p.reference if p.reference is not None else p.model
    lp = completion_logprobs_no_grad(
        ref,
        r.prompt_ids,
        r.prompt_mask,
        r.completion_ids,
        r.completion_mask,
        temperature=p.temperature,
        completion_attention_mask=r.attention_mask,
        micro_batch_size=p.micro_batch(r.prompt_ids, r.completion_ids),
        chunk_size=p.chunk_size,
    )
    return {"ref_logprobs": lp}


HINT_INPUTS = ("student_hidden", "teacher_hidden", "lm_head_weight", "teacher_lm_head_weight", "hint_mask", "hint_rows")


@register_input_builder(*HINT_INPUTS)
def hint_inputs(asm: Assembly) -> dict[str, Any]:
    """Student and teacher hidden states on the hinted rows' completion tokens, and the LM head(s).

    The teacher is the policy conditioned on the hinted context (no grad), or the EMA teacher. Both
    sides are divided by the sampling temperature, so the divergence compares the distributions the
    rollout sampled from (``softmax(h W^T / T)``). ``hint/teacher_margin`` (the precondition: how much
    likelier the teacher finds the student's tokens) goes to ``stats``.
    """
    from composer_plugins.losses.functional import chunked_logprobs
    from composer_plugins.models.generation import tokenize_prompts
    from composer_plugins.models.logprobs import completion_hidden, lm_head_weight

    r, p = asm.record, asm.policy
    rows = r.hint_rows
    n_in_batch = asm.values.get("hint_tokens_in_batch")
    if not rows:
        asm.stats.update({"hint/rows": 0.0, "hint/fraction": 0.0, **_margin_stat(0.0, 0.0, n_in_batch)})
        return {}
    T = p.temperature
    dev = r.completion_ids.device
    idx = torch.tensor(rows, device=dev)
    att = r.attention_mask
    c_ids, c_mask, c_att = r.completion_ids[idx], r.completion_mask[idx], None if att is None else att[idx]
    h_ids, h_mask = tokenize_prompts(p.tokenizer, r.hinted_contexts, p.max_context_length, dev)
    mb = p.micro_batch(h_ids, r.completion_ids)
    head = lm_head_weight(p.model)
    out: dict[str, Any] = {}
    if p.teacher is not None:  # the EMA weights (their own FSDP unit: its forward gathers them)
        teacher, t_head = p.teacher(h_ids, h_mask, c_ids, c_mask, c_att, mb)
        out["teacher_lm_head_weight"] = t_head
    else:
        with torch.no_grad():
            teacher = completion_hidden(
                p.model, h_ids, h_mask, c_ids, c_mask, completion_attention_mask=c_att, micro_batch_size=mb
            )
        t_head = head
    student = asm.scratch.get("policy_hidden")
    if student is not None:
        student = student[idx]
    else:  # the trainer computed the log-probs itself: the hinted rows' hidden states, with grad
        student = completion_hidden(
            p.model,
            r.prompt_ids[idx],
            r.prompt_mask[idx],
            c_ids,
            c_mask,
            completion_attention_mask=c_att,
            micro_batch_size=p.micro_batch(r.prompt_ids, r.completion_ids),
        )
    scale = 1.0 / T
    out["student_hidden"] = student * scale if T != 1.0 else student
    out["teacher_hidden"] = teacher * scale if T != 1.0 else teacher
    out["lm_head_weight"] = head
    out["hint_mask"] = c_mask.float()
    out["hint_rows"] = idx
    asm.stats.update({"hint/rows": float(len(rows)), "hint/fraction": len(rows) / r.num_rows})
    for kind in sorted({k for k in r.hint_kinds if k}):  # each hint kind's share (a chain's members apart)
        asm.stats[f"hint/fraction/{kind}"] = sum(k == kind for k in r.hint_kinds) / r.num_rows
    mask = c_mask.bool()
    with torch.no_grad():
        t_logps = chunked_logprobs(teacher, t_head, c_ids, mask=mask, temperature=T, chunk_size=p.chunk_size)
        logps = asm.values.get("logprobs")
        if logps is not None:
            s_logps = logps[idx].detach()
        else:
            s_logps = chunked_logprobs(student, head, c_ids, mask=mask, temperature=T, chunk_size=p.chunk_size)
        diff = ((t_logps - s_logps) * mask).sum()
    asm.stats.update(_margin_stat(float(diff), float(mask.sum()), n_in_batch))
    return out


def _margin_stat(diff_sum: float, tokens: float, tokens_in_batch: float | None) -> dict[str, float]:
    """``hint/teacher_margin``: this rank's sum of teacher − student log-probs over its hinted tokens, as
    its share of the mean over every rank's hinted tokens (``tokens_in_batch`` = all ranks' ÷ world
    size, so the ranks' average is the union mean); absent when no rank hinted a token."""
    n = tokens if tokens_in_batch is None else float(tokens_in_batch)
    return {"hint/teacher_margin": diff_sum / n} if n > 0 else {}


@register_input_builder("hint_teacher_logprobs")
def hint_teacher_logprobs(asm: Assembly) -> dict[str, Any]:
    """Per-token log-probs of the sampled tokens under the hint teacher on the hinted rows, the policy's own
    (sampling-time) elsewhere: PRIME-RL's ``opsd`` reference stream. ``None`` when no row was hinted."""
    from composer_plugins.models.generation import tokenize_prompts
    from composer_plugins.models.logprobs import completion_logprobs_no_grad

    r, p = asm.record, asm.policy
    rows = r.hint_rows
    if not rows:
        return {"hint_teacher_logprobs": None}
    ref = asm.get("old_logprobs").clone()
    idx = torch.tensor(rows, device=r.completion_ids.device)
    h_ids, h_mask = tokenize_prompts(p.tokenizer, r.hinted_contexts, p.max_context_length, r.completion_ids.device)
    scorer = getattr(p.teacher, "policy", p.teacher) if p.teacher is not None else p.model
    ref[idx] = completion_logprobs_no_grad(
        scorer,
        h_ids,
        h_mask,
        r.completion_ids[idx],
        r.completion_mask[idx],
        temperature=p.temperature,
        chunk_size=p.chunk_size,
    )
    return {"hint_teacher_logprobs": ref}


PAIR_INPUTS = (
    "chosen_logps",
    "rejected_logps",
    "chosen_avg_logps",
    "rejected_avg_logps",
    "chosen_lengths",
    "rejected_lengths",
    "ref_chosen_logps",
    "ref_rejected_logps",
)


@register_input_builder(*PAIR_INPUTS)
def pair_inputs(asm: Assembly) -> dict[str, Any]:
    """Sequence log-probs of the record's preference pairs: the policy's (with grad), the reference's (without)."""
    from composer_plugins.models.generation import tokenize_completions, tokenize_prompts
    from composer_plugins.models.logprobs import completion_logprobs, completion_logprobs_no_grad, sequence_logprob

    r, p = asm.record, asm.policy
    if not r.pairs:
        return {}
    k = len(r.pairs)
    dev = r.completion_ids.device
    prompts = [str(x["prompt"]) for x in r.pairs] * 2
    comps = [str(x["chosen"]) for x in r.pairs] + [str(x["rejected"]) for x in r.pairs]
    p_ids, p_mask = tokenize_prompts(p.tokenizer, prompts, p.pair_prompt_length, dev)
    c_ids, c_mask = tokenize_completions(p.tokenizer, comps, p.pair_max_length, dev)
    mb, cs = p.micro_batch(p_ids, c_ids), p.chunk_size
    logps = completion_logprobs(p.model, p_ids, p_mask, c_ids, c_mask, micro_batch_size=mb, chunk_size=cs)
    assert isinstance(logps, Tensor)
    seq = sequence_logprob(logps, c_mask.float())
    n = c_mask.sum(-1).float()
    out = {
        "chosen_logps": seq[:k],
        "rejected_logps": seq[k:],
        "chosen_avg_logps": seq[:k] / n[:k],
        "rejected_avg_logps": seq[k:] / n[k:],
        "chosen_lengths": n[:k],
        "rejected_lengths": n[k:],
    }
    if asm.wants("ref_chosen_logps") or asm.wants("ref_rejected_logps"):
        ref = p.reference if p.reference is not None else p.model
        ref_lp = completion_logprobs_no_grad(ref, p_ids, p_mask, c_ids, c_mask, micro_batch_size=mb, chunk_size=cs)
        ref_seq = sequence_logprob(ref_lp, c_mask.float())
        out.update(ref_chosen_logps=ref_seq[:k], ref_rejected_logps=ref_seq[k:])
    return out


# -- the teacher_distill channel's inputs (scoring itself: composer_plugins.training.teacher_scores) ---------
@register_input_builder("hidden_states")
def policy_hidden_states(asm: Assembly) -> dict[str, Any]:
    """The policy's final hidden states at every completion position (with grad), and its LM head.

    Shared with the log-prob builder's forward when it ran (``policy_hidden``), else one forward now.
    """
    from composer_plugins.models.logprobs import completion_hidden, lm_head_weight

    r, p = asm.record, asm.policy
    asm.get("logprobs")
    hidden = asm.scratch.get("policy_hidden")
    if hidden is None:
        hidden = completion_hidden(
            p.model,
            r.prompt_ids,
            r.prompt_mask,
            r.completion_ids,
            r.completion_mask,
            completion_attention_mask=r.attention_mask,
            micro_batch_size=p.micro_batch(r.prompt_ids, r.completion_ids),
        )
    return {"hidden_states": hidden, "lm_head_weight": lm_head_weight(p.model)}


@register_input_builder("teacher_scores", "teacher_logprobs")
def teacher_scores(asm: Assembly) -> dict[str, Any]:
    """The teachers' top-k of the record's rows as a ``TeacherTopK`` (running scorers awaited up to the deadline)."""
    import concurrent.futures as cf

    from composer_plugins.losses.teacher_distill import TeacherTopK
    from composer_plugins.teachers.scoring import ScoringJob
    from composer_plugins.training.teacher_scores import report_teacher_failures, start_teacher_scoring

    r, pool = asm.record, asm.policy.teacher_scoring
    start_teacher_scoring(r, pool)  # no-op when the trainer started it (or gave scores)
    if asm.wants("hidden_states"):
        asm.get("hidden_states")  # the student's forward first: scoring overlaps it
    pending = {k: v for k, v in r.teacher_scores.items() if isinstance(v, cf.Future)}
    if pending:
        job = ScoringJob(pending)
        done, stats = job.collect(getattr(pool, "deadline_s", None))
        asm.stats.update(stats)
        r.teacher_scores = {**{k: v for k, v in r.teacher_scores.items() if k not in pending}, **done}
        report_teacher_failures(pool, job.reasons)  # the step's futures are collected once: one line per step
    if pool is not None:
        asm.stats.update(pool.stats())
    scores = {k: v for k, v in r.teacher_scores.items() if v is not None}
    if not scores:
        return {}
    packed = next((v for v in scores.values() if isinstance(v, TeacherTopK)), None)
    if packed is None:
        packed = TeacherTopK.from_rows(scores, int(r.completion_ids.shape[1]), device=asm.device)
    n = float((r.completion_mask.bool() & packed.mask.any(1)).sum())
    asm.stats["teacher/scored_fraction"] = n / max(float(r.completion_mask.sum()), 1.0)
    # data parallel: each rank's mean over its own distilled tokens (min_agree filters per rank), which
    # DDP then averages; a trainer that wants the union mean passes teacher_tokens_in_batch itself
    out: dict[str, Any] = {"teacher_scores": packed}
    if asm.wants("teacher_logprobs"):
        out["teacher_logprobs"] = _sampled_teacher_logprobs(asm, scores)
    return out


def _sampled_teacher_logprobs(asm: Assembly, scores: Mapping[str, Any]) -> Tensor | None:
    """``(N, C)``: the teachers' log-prob of each sampled token (the mean of their probabilities where several
    scored it); where none did, the policy's own (detached), so a term on it is 0 there. ``None`` without any."""
    r = asm.record
    N, C = r.completion_ids.shape
    total = torch.zeros((N, C), dtype=torch.float64)
    count = torch.zeros((N, C), dtype=torch.float64)
    for rows in scores.values():
        for i, s in enumerate(rows if isinstance(rows, list) else ()):
            if s is None or getattr(s, "sampled", None) is None:
                continue
            t = min(int(s.sampled.shape[0]), C)
            v = s.sampled[:t].double()
            ok = s.mask[:t].bool() & torch.isfinite(v)
            total[i, :t] += torch.where(ok, v.exp(), torch.zeros_like(v))
            count[i, :t] += ok.double()
    if not bool((count > 0).any()):
        return None
    own = asm.get("logprobs")
    base = own.detach().double().cpu() if own is not None else torch.zeros((N, C), dtype=torch.float64)
    mixed = torch.where(count > 0, (total / count.clamp(min=1)).clamp(min=1e-30).log(), base)
    return mixed.to(device=asm.device, dtype=torch.float32)
