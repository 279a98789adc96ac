"""The built-in channel input builders, registered through the ``register_input_builders`` hook.

Each is ``builder(assembly) -> {input name: value}`` (:class:`~composer_plugins.training.step.assemble.Assembly`):
it reads the read-only record and computes with-grad inputs or collects the teachers' scores. The default
plugin :mod:`composer_plugins.training.runs.plugin` registers them lazily under the inputs each provides.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from composer_plugins.losses.base import inputs_for
from composer_plugins.losses.functional import chunked_logprobs
from composer_plugins.losses.teacher_distill import TeacherTopK
from composer_plugins.models.generation import tokenize_completions, tokenize_prompts
from composer_plugins.models.logprobs import (
    completion_hidden,
    completion_logprobs,
    completion_logprobs_no_grad,
    lm_head_weight,
    sequence_logprob,
)
from composer_plugins.training.step.assemble import Assembly, _channel_inputs
from composer_plugins.training.step.teacher_scores import report_teacher_failures


def record_fields(asm: Assembly) -> dict[str, Any]:
    """What the record and its meta hold as is: masks, ids, rewards, advantages, group layout, the step, and
    the sampling temperature (``sampling_temperature``: a channel that owns a temperature may default to it).

    A field the record lacks (``None``: a trainer that computes its advantages itself) is left out, and a
    channel that reads it fails with the located error."""
    r, m = asm.record, asm.meta
    for name in ("advantages", "rewards"):
        if getattr(r, name) is None and asm.wants(name):
            raise asm.lacking(name, name, f"give {name}= to ExperienceMaker.make")
    out = {
        "completion_mask": r.completion_mask.float(),
        "completion_ids": r.completion_ids,
        "advantages": r.advantages,
        "rewards": r.rewards,
        "num_generations": r.num_generations,
        "group_index": r.group_index,
        "global_step": m.step,
        "total_steps": m.total_steps,
        "sampling_temperature": asm.policy.temperature,
    }
    return {k: v for k, v in out.items() if v is not None}


def policy_logprobs(asm: Assembly) -> dict[str, Any]:
    """The policy's per-token log-probs of the completions (with grad, chunked from hidden states), the
    sampling-time ones, and the importance-sampling correction from an inference server's.

    When every active channel reading ``logprobs`` declares ``row_separable``, their LM-head gradients are
    formed while the log-probs are computed (:func:`~composer_plugins.kernels.fused.fused_logprobs`, three
    matmuls a chunk); otherwise the generic path (four). ``compute.kernels: materialised`` makes either one chunk."""
    r, p = asm.record, asm.policy
    logps = asm.values.get("logprobs")
    args = (p.model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    mb = p.micro_batch(r.prompt_ids, r.completion_ids)
    readers = _separable_readers(asm)
    if logps is None and asm.wants("logprobs") and readers:
        from composer_plugins.losses.functional import fused_logprobs

        hidden = completion_hidden(*args, completion_attention_mask=r.attention_mask, micro_batch_size=mb)
        asm.scratch["policy_hidden"] = hidden
        logps = fused_logprobs(
            hidden,
            lm_head_weight(p.model),
            r.completion_ids,
            r.completion_mask,
            _readers_loss(asm, readers),
            chunk_size=p.chunk_size,
            temperature=p.temperature,
        )
    elif logps is None and asm.wants("logprobs"):
        kw = {"temperature": p.temperature, "completion_attention_mask": r.attention_mask, "micro_batch_size": mb}
        want_hidden = asm.wants("student_hidden") or asm.wants("hidden_states")
        out = completion_logprobs(*args, return_hidden=want_hidden, chunk_size=p.chunk_size, **kw)
        logps, hidden = out if isinstance(out, tuple) else (out, None)
        asm.scratch["policy_hidden"] = hidden
    if r.old_logprobs is None and logps is None and asm.wants("old_logprobs"):
        fix = "make the record with ExperienceMaker.make(old_logprobs=True)"
        raise asm.lacking("old_logprobs", "old_logprobs", fix)
    return {"logprobs": logps, **_sampling_inputs(asm, logps, report=True)}


def _sampling_inputs(asm: Assembly, logps: Tensor | None, report: bool) -> dict[str, Any]:
    """``old_logprobs`` (the record's, else ``logps`` detached), ``inference_logprobs`` and the IS ratio."""
    r, p = asm.record, asm.policy
    old = r.old_logprobs
    if old is None and logps is not None:  # the sampling-time log-probs: this forward's, detached
        old = logps.detach()
    sampling = r.sampling_logprobs
    if sampling is None:  # HF generate samples from this policy: the inference engine's log-probs are these
        return {"old_logprobs": old, "inference_logprobs": old}
    values: dict[str, Any] = {"old_logprobs": old, "inference_logprobs": sampling}
    mode = p.importance_sampling
    if mode is not None and mode[0] != "off" and old is not None:
        from composer_plugins.losses.functional import importance_sampling_correction

        ratio = importance_sampling_correction(old, sampling, r.completion_mask, mode[0], mode[1], mode[2])
        values["importance_sampling_ratio"] = ratio
        if report:
            m = r.completion_mask.float()
            asm.stats["is_ratio"] = float((ratio.expand_as(m) * m).sum() / m.sum().clamp(min=1))
    return values


#: What the log-prob builder itself provides (a separable reader's loss gets them from the live log-probs).
_OWN = ("logprobs", "old_logprobs", "inference_logprobs", "importance_sampling_ratio")


def _separable_readers(asm: Assembly) -> list[Any]:
    """The active channels that read ``logprobs``, when every one declares ``row_separable`` (else none)."""
    chans = getattr(asm.composer, "active", None) or []
    readers = [c for c in chans if "logprobs" in _channel_inputs(c)]
    return readers if readers and all(getattr(c, "row_separable", False) for c in readers) else []


def _readers_loss(asm: Assembly, readers: list[Any]) -> Any:
    """``loss(logprobs)``: the readers' weighted losses, their other inputs built as the assembler would."""
    for k in dict.fromkeys(k for c in readers for k in c.required_inputs() if k not in _OWN):
        asm.get(k)  # now, outside the kernel (whose autocast is off)

    def loss(lp: Tensor) -> Tensor:
        vals = {**asm.values, **_sampling_inputs(asm, lp.detach(), report=False), "logprobs": lp}
        return sum((c.weight * c(inputs_for(c, vals))[0] for c in readers), lp.new_zeros(()))

    return loss


def reference_logprobs(asm: Assembly) -> dict[str, Any]:
    """The reference model's log-probs: the record's (the experience maker computes them, without gradient)."""
    if asm.record.ref_logprobs is None:
        raise asm.lacking("ref_logprobs", "ref_logprobs", "give the ExperienceMaker a reference model")
    return {"ref_logprobs": asm.record.ref_logprobs}


def hint_inputs(asm: Assembly) -> dict[str, Any]:
    """Student and teacher hidden states on the hinted rows' completion tokens, and the LM head(s).

    The teacher is the policy conditioned on the hinted context (no grad), or the EMA teacher. The hidden
    states are the models' own: the ``hint_distill`` channel owns the temperature and divides the logits by
    it once (its ``temperature``, by default the ``sampling_temperature`` this assembler passes).
    With ``teacher_margin`` on (``hints.teacher_margin``; one more LM-head pass of teacher and student),
    ``hint/teacher_margin`` (the precondition: how much likelier the teacher finds the student's tokens, at
    the sampling temperature) goes to ``stats``.
    """
    r, p = asm.record, asm.policy
    rows = r.hint_rows
    n_in_batch = asm.values.get("hint_tokens_in_batch")
    if not rows:
        margin = _margin_stat(0.0, 0.0, n_in_batch) if p.teacher_margin else {}
        asm.stats.update({"hint/rows": 0.0, "hint/fraction": 0.0, **margin})
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
    # the trainer computed the log-probs itself: the hinted rows' hidden states, with grad
    student = student[idx] if student is not None else _policy_hidden(asm, idx)
    out.update(
        student_hidden=student, teacher_hidden=teacher, lm_head_weight=head, hint_mask=c_mask.float(), hint_rows=idx
    )
    asm.stats.update({"hint/rows": float(len(rows)), "hint/fraction": len(rows) / r.num_rows})
    for kind in sorted({k for k in r.hint_kinds if k}):  # each hint kind's share (a chain's members apart)
        asm.stats[f"hint/fraction/{kind}"] = sum(k == kind for k in r.hint_kinds) / r.num_rows
    if not p.teacher_margin:
        return out
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


def hint_teacher_logprobs(asm: Assembly) -> dict[str, Any]:
    """Per-token log-probs of the sampled tokens under the hint teacher on the hinted rows, the policy's own
    (sampling-time) elsewhere: PRIME-RL's ``opsd`` reference stream. ``None`` when no row was hinted."""
    r, p = asm.record, asm.policy
    rows = r.hint_rows
    if not rows:
        return {"hint_teacher_logprobs": None}
    own = asm.get("old_logprobs")
    if own is None:
        fix = "make the record with ExperienceMaker.make(old_logprobs=True)"
        raise asm.lacking("old_logprobs", "old_logprobs", fix)
    ref = own.clone()
    idx = torch.tensor(rows, device=r.completion_ids.device)
    h_ids, h_mask = tokenize_prompts(p.tokenizer, r.hinted_contexts, p.max_context_length, r.completion_ids.device)
    scorer = getattr(p.teacher, "policy", p.teacher) if p.teacher is not None else p.model
    rows = (r.completion_ids[idx], r.completion_mask[idx])
    ref[idx] = completion_logprobs_no_grad(
        scorer, h_ids, h_mask, *rows, temperature=p.temperature, chunk_size=p.chunk_size
    )
    return {"hint_teacher_logprobs": ref}


#: Where a preference pair caches its reference sequence log-probs (:func:`cache_pair_references`).
PAIR_REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def _pair_tensors(p: Any, pairs: Sequence[Mapping[str, Any]], dev: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(prompt ids, prompt mask, completion ids, completion mask)``: the chosen rows, then the rejected."""
    prompts = [str(x["prompt"]) for x in pairs] * 2
    comps = [str(x["chosen"]) for x in pairs] + [str(x["rejected"]) for x in pairs]
    p_ids, p_mask = tokenize_prompts(p.tokenizer, prompts, p.pair_prompt_length, dev)
    c_ids, c_mask = tokenize_completions(p.tokenizer, comps, p.pair_max_length, dev)
    return p_ids, p_mask, c_ids, c_mask


def _sequence_logps(model: Any, p: Any, t: tuple[Tensor, Tensor, Tensor, Tensor], grad: bool) -> Tensor:
    kw = {"micro_batch_size": p.micro_batch(t[0], t[2]), "chunk_size": p.chunk_size}
    logps = (completion_logprobs if grad else completion_logprobs_no_grad)(model, *t, **kw)
    assert isinstance(logps, Tensor)
    return sequence_logprob(logps, t[3].float())


def cache_pair_references(p: Any, pairs: Sequence[Mapping[str, Any]], batch: int = 32) -> list[dict[str, Any]]:
    """``pairs`` with their sequence log-probs under ``p.reference`` (else ``p.model``, without gradient) at
    :data:`PAIR_REF_KEYS`: computed once, before the first optimizer step, so no copy of the policy is kept for them."""
    model = p.reference if p.reference is not None else p.model
    out: list[dict[str, Any]] = []
    for i in range(0, len(pairs), batch):
        part = pairs[i : i + batch]
        seq = _sequence_logps(model, p, _pair_tensors(p, part, lm_head_weight(model).device), False).tolist()
        out += [{**x, PAIR_REF_KEYS[0]: seq[j], PAIR_REF_KEYS[1]: seq[len(part) + j]} for j, x in enumerate(part)]
    return out


def pair_inputs(asm: Assembly) -> dict[str, Any]:
    """Sequence log-probs of the record's preference pairs: the policy's (with grad), the reference's (without:
    the pairs' cached ones, :func:`cache_pair_references`, else ``reference``'s, else the policy's)."""
    r, p, pairs = asm.record, asm.policy, asm.meta.pairs
    if not pairs:
        return {}
    k = len(pairs)
    t = _pair_tensors(p, pairs, r.completion_ids.device)
    seq = _sequence_logps(p.model, p, t, True)
    n = t[3].sum(-1).float()
    out = {
        "chosen_logps": seq[:k],
        "rejected_logps": seq[k:],
        "chosen_avg_logps": seq[:k] / n[:k],
        "rejected_avg_logps": seq[k:] / n[k:],
        "chosen_lengths": n[:k],
        "rejected_lengths": n[k:],
    }
    if asm.wants(PAIR_REF_KEYS[0]) or asm.wants(PAIR_REF_KEYS[1]):
        if all(key in x for x in pairs for key in PAIR_REF_KEYS):
            out.update({key: torch.tensor([float(x[key]) for x in pairs], device=seq.device) for key in PAIR_REF_KEYS})
        else:
            ref_seq = _sequence_logps(p.reference if p.reference is not None else p.model, p, t, False)
            out.update(ref_chosen_logps=ref_seq[:k], ref_rejected_logps=ref_seq[k:])
    return out


# -- the teacher_distill channel's inputs (scoring itself: composer_plugins.training.step.teacher_scores) ---------
def policy_hidden_states(asm: Assembly) -> dict[str, Any]:
    """The policy's final hidden states at every completion position (with grad), and its LM head.

    Shared with the log-prob builder's forward when it ran (``policy_hidden``), else one forward now.
    """
    asm.get("logprobs")
    hidden = asm.scratch.get("policy_hidden")
    hidden = hidden if hidden is not None else _policy_hidden(asm)
    return {"hidden_states": hidden, "lm_head_weight": lm_head_weight(asm.policy.model)}


def _policy_hidden(asm: Assembly, idx: Tensor | None = None) -> Tensor:
    """The policy's final hidden states (with grad) at the completion positions of rows ``idx`` (``None``: all)."""
    r, p = asm.record, asm.policy
    rows = [r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.attention_mask]
    if idx is not None:
        rows = [None if t is None else t[idx] for t in rows]
    mb = p.micro_batch(r.prompt_ids, r.completion_ids)
    return completion_hidden(p.model, *rows[:4], completion_attention_mask=rows[4], micro_batch_size=mb)


def teacher_scores(asm: Assembly) -> dict[str, Any]:
    """The teachers' top-k of the record's rows as a ``TeacherTopK`` (running scorers awaited up to the deadline)."""

    from composer_plugins.teachers.scoring import ScoringJob
    from composer_plugins.teachers.scoring.pool import fit_rows

    r, pool = asm.record, asm.policy.teacher_scoring
    if asm.wants("hidden_states"):
        asm.get("hidden_states")  # the student's forward first: scoring (started by the experience maker) overlaps it
    collected = dict(r.teacher_scores)
    pending = {k: v for k, v in collected.items() if isinstance(v, cf.Future)}
    if pending:
        job = ScoringJob(pending)
        done, stats = job.collect(getattr(pool, "deadline_s", None))
        asm.stats.update(stats)
        collected = {**{k: v for k, v in collected.items() if k not in pending}, **done}  # a late one: skipped
        report_teacher_failures(pool, job.reasons)  # one line per step
    if pool is not None:
        asm.stats.update(pool.stats())
    scores = {k: v for k, v in collected.items() if v is not None}
    if not scores:
        return {}
    packed = next((v for v in scores.values() if isinstance(v, TeacherTopK)), None)
    if packed is None:
        scores = {k: fit_rows(k, v, int(r.completion_ids.shape[0])) for k, v in scores.items()}
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
