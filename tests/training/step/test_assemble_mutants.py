"""The input builders (``training/step/input_builders.py``, assembled by ``training/step/assemble.py``) checked value by
value on a tiny Llama.

Written against the mutants that survived ``python -m benchmarks.mutation --only training/assemble``: each
builder's output is compared with the same quantity computed here directly (the model's log-probs and
hidden states through ``models.logprobs``, the importance ratio, the margin statistic), so a wrong
operator, a swapped condition or a dropped scale in a builder changes a number these tests read.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from composer_plugins.losses.base import ChannelComposer, LossChannel
from composer_plugins.models.generation import tokenize_completions, tokenize_prompts
from composer_plugins.models.logprobs import completion_hidden, completion_logprobs_no_grad, lm_head_weight
from composer_plugins.training.step.assemble import (
    Assembly,
    MissingInputError,
    Needs,
    StepPolicy,
    assemble_inputs,
    input_builders,
)
from composer_plugins.training.step.experience import ExperienceMaker
from composer_plugins.training.step.input_builders import _margin_stat, _sampled_teacher_logprobs
from composer_plugins.training.step.record import StepMeta, StepRecord

ROWS, P, C = 4, 3, 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A two-layer Llama with random weights and a BPE tokenizer (the testing kit's, built in seconds)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from composer_plugins.testing.teacher_data import build_tiny_chat_model

    torch.set_num_threads(1)
    d = build_tiny_chat_model(tmp_path_factory.mktemp("tiny"), vocab_size=300, hidden_size=16, layers=1)
    tok = AutoTokenizer.from_pretrained(d)
    model = LlamaForCausalLM.from_pretrained(d).float()
    torch.manual_seed(1)
    with torch.no_grad():  # weights spread enough that log-probs and margins are far from 0
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    ref = LlamaForCausalLM.from_pretrained(d).float()
    return SimpleNamespace(model=model, ref=ref, tok=tok)


def _record(tiny, **kw) -> StepRecord:
    g = torch.Generator().manual_seed(0)
    V = tiny.model.config.vocab_size
    mask = torch.ones(ROWS, C, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 4:] = 0
    return StepRecord(
        tasks=[{"prompt": "p"}],
        prompts=["p"] * ROWS,
        completions=["c"] * ROWS,
        prompt_ids=torch.randint(3, V, (ROWS, P), generator=g),
        prompt_mask=torch.ones(ROWS, P, dtype=torch.long),
        completion_ids=torch.randint(3, V, (ROWS, C), generator=g),
        completion_mask=mask,
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        num_generations=2,
        **kw,
    )


class Reads(LossChannel):
    """A channel that reads the given inputs and contributes nothing (the test reads what it was handed)."""

    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *names: str, weight: float = 1.0, name: str = "reads") -> None:
        super().__init__(weight=weight, name=name)
        self.requires = tuple(names)  # type: ignore[misc]

    def forward(self, inputs):
        return torch.zeros(()), {}


def _direct_logprobs(model, rec, T=1.0, mask=None):
    return completion_logprobs_no_grad(
        model,
        rec.prompt_ids,
        rec.prompt_mask,
        rec.completion_ids,
        rec.completion_mask if mask is None else mask,
        temperature=T,
        micro_batch_size=None,
    )


def test_record_fields_and_the_policys_log_probs_at_the_temperature(tiny):
    rec = _record(tiny)
    pol = StepPolicy(tiny.model, tiny.tok, temperature=0.7)
    meta = StepMeta(step=7, total_steps=11)
    inputs, stats = assemble_inputs(rec, ChannelComposer([Reads("logprobs")]), pol, meta=meta)
    assert inputs["completion_mask"].dtype == torch.float32 and torch.equal(
        inputs["completion_mask"].long(), rec.completion_mask
    )
    assert inputs["global_step"] == 7 and inputs["total_steps"] == 11 and inputs["num_generations"] == 2
    assert inputs["rewards"] is rec.rewards and inputs["advantages"] is rec.advantages
    want = _direct_logprobs(tiny.model, rec, 0.7)
    assert inputs["logprobs"].requires_grad
    torch.testing.assert_close(inputs["logprobs"].detach(), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want, _direct_logprobs(tiny.model, rec, 1.0))  # the temperature matters here
    # on-policy: the sampling-time log-probs are this forward's, detached; HF generate sampled them
    assert torch.equal(inputs["old_logprobs"], inputs["logprobs"].detach()) and not inputs["old_logprobs"].requires_grad
    assert inputs["inference_logprobs"] is inputs["old_logprobs"]
    assert "importance_sampling_ratio" not in inputs and "is_ratio" not in stats


def test_old_log_probs_without_the_policy_forward_are_the_experience_makers_no_grad_ones(tiny):
    rec = _record(tiny)
    pol = StepPolicy(tiny.model, tiny.tok)
    with pytest.raises(MissingInputError, match=r"old_logprobs.*make\(old_logprobs=True\)"):
        assemble_inputs(rec, ChannelComposer([Reads("old_logprobs")]), pol)  # the assembler computes no no-grad field
    maker = ExperienceMaker(policy=tiny.model, tokenizer=tiny.tok, advantage_kwargs={})
    old = maker.logprobs(tiny.model, rec)
    torch.testing.assert_close(old, _direct_logprobs(tiny.model, rec), atol=1e-5, rtol=1e-5)
    inputs, _ = assemble_inputs(rec.replace(old_logprobs=old), ChannelComposer([Reads("old_logprobs")]), pol)
    assert inputs.get("logprobs") is None and inputs["old_logprobs"] is old


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_importance_sampling_ratio_and_its_statistic(tiny, mode):
    from composer_plugins.losses.functional import importance_sampling_correction

    rec = _record(tiny)
    old = _direct_logprobs(tiny.model, rec)
    sampling = old - 0.3 * torch.arange(ROWS * C, dtype=torch.float32).reshape(ROWS, C) / (ROWS * C)
    rec = rec.replace(old_logprobs=old, sampling_logprobs=sampling)
    pol = StepPolicy(tiny.model, tiny.tok, importance_sampling=(mode, 1.2, 0.5))
    inputs, stats = assemble_inputs(rec, ChannelComposer([Reads("logprobs")]), pol)
    assert inputs["old_logprobs"] is old and inputs["inference_logprobs"] is sampling
    ratio = importance_sampling_correction(old, sampling, rec.completion_mask, mode, 1.2, 0.5)
    torch.testing.assert_close(inputs["importance_sampling_ratio"], ratio)
    m = rec.completion_mask.float()
    want = float((ratio.expand_as(m) * m).sum() / m.sum())
    assert not math.isclose(want, 1.0, abs_tol=1e-3)
    assert stats["is_ratio"] == pytest.approx(want, rel=1e-6)
    # mode "off" (or none): the server's log-probs are passed on, no correction is made
    for off in (("off", 2.0, None), None):
        inputs, stats = assemble_inputs(
            rec, ChannelComposer([Reads("logprobs")]), StepPolicy(tiny.model, tiny.tok, importance_sampling=off)
        )
        assert "importance_sampling_ratio" not in inputs and "is_ratio" not in stats
        assert inputs["inference_logprobs"] is sampling


def test_reference_log_probs_are_the_records_made_by_the_experience_maker(tiny):
    from composer_plugins.models.generation import Rollout

    base = _record(tiny)
    ro = Rollout(
        base.prompt_ids,
        base.prompt_mask,
        base.completion_ids,
        base.completion_mask,
        list(base.completions),
        list(base.prompts),
        torch.zeros(ROWS, dtype=torch.long),
        2,
    )
    maker = ExperienceMaker(policy=tiny.model, tokenizer=tiny.tok, reference=tiny.ref, temperature=0.8)
    rec = maker.make(base.tasks, ro, base.rewards, advantages=base.advantages)
    composer = ChannelComposer([Reads("ref_logprobs")])
    inputs, _ = assemble_inputs(rec, composer, StepPolicy(tiny.model, tiny.tok, temperature=0.8))
    torch.testing.assert_close(inputs["ref_logprobs"], _direct_logprobs(tiny.ref, rec, 0.8))
    assert inputs["ref_logprobs"] is rec.ref_logprobs
    with pytest.raises(MissingInputError, match=r"'reads' reads the input 'ref_logprobs'.*reference model"):
        assemble_inputs(base, composer, StepPolicy(tiny.model, tiny.tok, reference=tiny.ref))


def _hinted(tiny):
    return _record(tiny, hint_contexts=[None, "What is 3 + 4?", None, "What is 12 * 9? The answer"])


@pytest.mark.parametrize("T", [1.0, 0.5])
def test_hint_inputs_are_the_hinted_rows_own_hidden_states_and_the_sampling_temperature(tiny, T):
    rec = _hinted(tiny)
    pol = StepPolicy(tiny.model, tiny.tok, temperature=T, max_context_length=6, teacher_margin=True)
    inputs, stats = assemble_inputs(rec, ChannelComposer([Reads("logprobs", "student_hidden")]), pol)
    idx = torch.tensor([1, 3])
    assert torch.equal(inputs["hint_rows"], idx)
    c_ids, c_mask = rec.completion_ids[idx], rec.completion_mask[idx]
    h_ids, h_mask = tokenize_prompts(tiny.tok, rec.hinted_contexts, 6)
    assert h_ids.shape[1] == 6  # the longer context was cut from the left
    with torch.no_grad():
        teacher = completion_hidden(tiny.model, h_ids, h_mask, c_ids, c_mask)
        student = completion_hidden(tiny.model, rec.prompt_ids[idx], rec.prompt_mask[idx], c_ids, c_mask)
    # the models' own hidden states: the channel divides the logits by the temperature, nobody before it
    torch.testing.assert_close(inputs["teacher_hidden"], teacher, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inputs["student_hidden"].detach(), student, atol=1e-5, rtol=1e-5)
    assert inputs["sampling_temperature"] == T
    assert inputs["student_hidden"].requires_grad and not inputs["teacher_hidden"].requires_grad
    assert inputs["lm_head_weight"] is lm_head_weight(tiny.model)
    assert torch.equal(inputs["hint_mask"], c_mask.float())
    assert stats["hint/rows"] == 2.0 and stats["hint/fraction"] == 0.5
    # the margin: mean over hinted tokens of teacher − student log-probs of the sampled tokens
    t_lp = completion_logprobs_no_grad(tiny.model, h_ids, h_mask, c_ids, c_mask, temperature=T)
    s_lp = completion_logprobs_no_grad(
        tiny.model, rec.prompt_ids[idx], rec.prompt_mask[idx], c_ids, c_mask, temperature=T
    )
    want = float(((t_lp - s_lp) * c_mask).sum() / c_mask.sum())
    assert abs(want) > 1e-3 and stats["hint/teacher_margin"] == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_hint_inputs_without_the_policy_forward_and_with_an_ema_teacher(tiny):
    rec = _hinted(tiny)
    idx = torch.tensor([1, 3])
    c_ids, c_mask = rec.completion_ids[idx], rec.completion_mask[idx]
    calls = []

    def ema(h_ids, h_mask, ids, mask, att, mb):
        calls.append((h_ids.shape, ids.shape))
        return torch.full((2, C, 16), 0.25), torch.ones(tiny.model.config.vocab_size, 16)

    pol = StepPolicy(tiny.model, tiny.tok, teacher=ema, temperature=2.0)
    inputs, _ = assemble_inputs(rec, ChannelComposer([Reads("student_hidden")]), pol)
    assert len(calls) == 1 and calls[0][1] == (2, C)
    torch.testing.assert_close(inputs["teacher_hidden"], torch.full((2, C, 16), 0.25))  # as the EMA gave it
    assert torch.equal(inputs["teacher_lm_head_weight"], torch.ones(tiny.model.config.vocab_size, 16))
    with torch.no_grad():
        student = completion_hidden(tiny.model, rec.prompt_ids[idx], rec.prompt_mask[idx], c_ids, c_mask)
    torch.testing.assert_close(inputs["student_hidden"].detach(), student, atol=1e-5, rtol=1e-5)
    assert inputs["sampling_temperature"] == 2.0


@pytest.mark.parametrize(
    ("criterion", "channel_t", "sampling_t"),
    [
        ("jsd", 0.7, 0.7),
        ("jsd", None, 0.7),
        ("jsd", 0.7, 1.0),
        ("jsd", 1.5, 0.7),
        ("taid", None, 0.7),
        ("taid", 0.7, 0.7),
    ],
)
def test_a_hint_distill_step_applies_the_temperature_once(tiny, criterion, channel_t, sampling_t):
    """The assembled hint-distill loss equals a float64 restatement with the logits divided by the temperature
    once: the channel's ``temperature``, else (``None``) the rollout's sampling temperature."""
    from composer_plugins.losses.distill import HintDistillChannel

    rec = _hinted(tiny)
    pol = StepPolicy(tiny.model, tiny.tok, temperature=sampling_t, max_context_length=6)
    ch = HintDistillChannel(criterion=criterion, beta=0.5, temperature=channel_t, kernels="torch").eval()
    loss, metrics = ChannelComposer([ch])(assemble_inputs(rec, ChannelComposer([ch]), pol)[0])
    assert metrics["hint_distill/skipped"] == 0.0
    idx = torch.tensor([1, 3])
    c_ids, c_mask = rec.completion_ids[idx], rec.completion_mask[idx]
    h_ids, h_mask = tokenize_prompts(tiny.tok, rec.hinted_contexts, 6)
    with torch.no_grad():
        hs = completion_hidden(tiny.model, rec.prompt_ids[idx], rec.prompt_mask[idx], c_ids, c_mask).double()
        ht = completion_hidden(tiny.model, h_ids, h_mask, c_ids, c_mask).double()
    w = lm_head_weight(tiny.model).detach().double()
    tau = sampling_t if channel_t is None else channel_t
    keep = c_mask.bool()
    want = _restated(criterion, (hs @ w.T)[keep], (ht @ w.T)[keep], tau)
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-5)
    if sampling_t != 1.0:  # the temperature applied twice (the assembler's, then the channel's) reads apart
        twice = _restated(criterion, (hs @ w.T)[keep], (ht @ w.T)[keep], tau * sampling_t)
        assert abs(float(twice) - float(want)) > 1e-3 * abs(float(want))


def _restated(criterion: str, zs: torch.Tensor, zt: torch.Tensor, tau: float) -> torch.Tensor:
    """The token mean of the divergence of ``softmax(z / tau)``'s, in float64 (TAID at its starting t = 0.4)."""
    zs, zt = zs / tau, zt / tau
    s, t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    if criterion == "jsd":
        m = torch.log(0.5 * s.exp() + 0.5 * t.exp())
        per = 0.5 * (t.exp() * (t - m)).sum(-1) + 0.5 * (s.exp() * (s - m)).sum(-1)
    else:  # the cross-entropy of the interpolated target against the student
        per = -(torch.softmax(0.6 * zs + 0.4 * zt, -1) * s).sum(-1)
    return per.mean()


def test_no_hinted_row_reports_zeros_and_no_margin(tiny):
    inputs, stats = assemble_inputs(
        _record(tiny), ChannelComposer([Reads("student_hidden")]), StepPolicy(tiny.model, tiny.tok)
    )
    assert "student_hidden" not in inputs
    assert stats == {"hint/rows": 0.0, "hint/fraction": 0.0}
    rec = _record(tiny, extras={"hint_tokens_in_batch": 4.0})  # other ranks hinted: this rank's share is 0
    pol = StepPolicy(tiny.model, tiny.tok, teacher_margin=True)
    _, stats = assemble_inputs(rec, ChannelComposer([Reads("student_hidden")]), pol)
    assert stats["hint/teacher_margin"] == 0.0


def test_each_hint_kinds_share_of_the_rows_is_reported(tiny):
    rec = _record(
        tiny,
        hint_contexts=[None, "What is 3 + 4?", "Think again", "What is 12 * 9? The answer"],
        hint_kinds=[None, "".join(["feed", "back"]), "retry", "".join(["feed", "back"])],  # equal, not one object
    )
    _, stats = assemble_inputs(rec, ChannelComposer([Reads("student_hidden")]), StepPolicy(tiny.model, tiny.tok))
    assert stats["hint/rows"] == 3.0 and stats["hint/fraction"] == 0.75
    assert stats["hint/fraction/feedback"] == 0.5 and stats["hint/fraction/retry"] == 0.25
    assert not any(k.startswith("hint/fraction/") and k.endswith("None") for k in stats)


def test_step_policy_defaults_and_the_pair_inputs():
    from composer_plugins.training.assemble import PAIR_INPUTS

    pol = StepPolicy(None, None)
    assert pol.teacher_margin is False and pol.max_context_length == 256
    assert {"chosen_logps", "rejected_logps", "chosen_lengths"} <= set(PAIR_INPUTS)


def test_the_teacher_margin_without_the_policys_log_probs_and_without_a_hinted_row(tiny):
    rec = _hinted(tiny)
    pol = StepPolicy(tiny.model, tiny.tok, max_context_length=6, teacher_margin=True)
    _, with_lp = assemble_inputs(rec, ChannelComposer([Reads("logprobs", "student_hidden")]), pol)
    _, without = assemble_inputs(rec, ChannelComposer([Reads("student_hidden")]), pol)  # from the hidden states
    assert without["hint/teacher_margin"] == pytest.approx(with_lp["hint/teacher_margin"], rel=1e-4, abs=1e-5)
    _, none = assemble_inputs(_record(tiny), ChannelComposer([Reads("student_hidden")]), pol)
    assert "hint/teacher_margin" not in none  # no hinted token anywhere: no margin


def test_margin_stat_divides_by_the_batchs_tokens_when_given():
    assert _margin_stat(6.0, 3.0, None) == {"hint/teacher_margin": 2.0}
    assert _margin_stat(6.0, 3.0, 4) == {"hint/teacher_margin": 1.5}
    assert _margin_stat(0.0, 0.0, None) == {} and _margin_stat(1.0, 2.0, 0) == {}
    assert _margin_stat(2.0, 1.0, None) == {"hint/teacher_margin": 2.0}  # one hinted token is enough
    assert _margin_stat(2.0, 3.0, 0.5) == {"hint/teacher_margin": 4.0}


def test_hint_teacher_logprobs_replace_only_the_hinted_rows(tiny):
    rec = _hinted(tiny)
    old = _direct_logprobs(tiny.model, rec)
    rec = rec.replace(old_logprobs=old)
    pol = StepPolicy(tiny.model, tiny.tok, temperature=0.9, max_context_length=64)
    inputs, _ = assemble_inputs(rec, ChannelComposer([Reads("hint_teacher_logprobs")]), pol)
    got = inputs["hint_teacher_logprobs"]
    idx = torch.tensor([1, 3])
    h_ids, h_mask = tokenize_prompts(tiny.tok, rec.hinted_contexts, 64)
    want = completion_logprobs_no_grad(
        tiny.model, h_ids, h_mask, rec.completion_ids[idx], rec.completion_mask[idx], temperature=0.9
    )
    torch.testing.assert_close(got[idx], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[[0, 2]], old[[0, 2]]) and torch.equal(rec.old_logprobs, old)  # a copy, not the record's
    rec = rec.replace(hint_contexts=())
    inputs, _ = assemble_inputs(rec, ChannelComposer([Reads("hint_teacher_logprobs")]), pol)
    assert inputs["hint_teacher_logprobs"] is None


def test_pair_inputs_sum_average_and_the_reference(tiny):
    rec = _record(tiny)
    pairs = [
        {"prompt": "What is 2 + 2?", "chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5 #### 5"},
        {"prompt": "What is 7 * 8?", "chosen": "56", "rejected": "7 * 8 = 54"},
    ]
    meta = StepMeta(pairs=pairs)  # the step's pairs are per-step meta, not a record field
    pol = StepPolicy(tiny.model, tiny.tok, reference=tiny.ref, pair_prompt_length=4, pair_max_length=6)
    inputs, _ = assemble_inputs(rec, ChannelComposer([Reads("chosen_logps", "ref_chosen_logps")]), pol, meta=meta)
    prompts = [p["prompt"] for p in pairs] * 2
    comps = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    p_ids, p_mask = tokenize_prompts(tiny.tok, prompts, 4)
    c_ids, c_mask = tokenize_completions(tiny.tok, comps, 6)
    assert p_ids.shape[1] == 4 and c_ids.shape[1] == 6
    lp = completion_logprobs_no_grad(tiny.model, p_ids, p_mask, c_ids, c_mask)
    seq, n = (lp * c_mask).sum(-1), c_mask.sum(-1).float()
    assert inputs["chosen_logps"].requires_grad
    torch.testing.assert_close(inputs["chosen_logps"].detach(), seq[:2], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(inputs["rejected_logps"].detach(), seq[2:], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(inputs["chosen_avg_logps"].detach(), seq[:2] / n[:2], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(inputs["rejected_avg_logps"].detach(), seq[2:] / n[2:], atol=1e-4, rtol=1e-5)
    assert inputs["chosen_lengths"].tolist() == n[:2].tolist() and inputs["rejected_lengths"].tolist() == n[2:].tolist()
    ref = completion_logprobs_no_grad(tiny.ref, p_ids, p_mask, c_ids, c_mask)
    ref_seq = (ref * c_mask).sum(-1)
    torch.testing.assert_close(inputs["ref_chosen_logps"], ref_seq[:2], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(inputs["ref_rejected_logps"], ref_seq[2:], atol=1e-4, rtol=1e-5)
    # without a channel reading the reference's, no reference forward
    inputs, _ = assemble_inputs(rec, ChannelComposer([Reads("chosen_logps")]), pol, meta=meta)
    assert "ref_chosen_logps" not in inputs
    inputs, _ = assemble_inputs(rec, ChannelComposer([Reads("chosen_logps")]), pol)
    assert "chosen_logps" not in inputs


def test_cached_pair_references_are_each_pairs_own_in_every_batch(tiny):
    from composer_plugins.training.input_builders import PAIR_REF_KEYS, cache_pair_references

    pairs = [
        {"prompt": "What is 2 + 2?", "chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5 #### 5"},
        {"prompt": "What is 7 * 8?", "chosen": "56", "rejected": "7 * 8 = 54"},
        {"prompt": "What is 9 - 3?", "chosen": "6", "rejected": "9 - 3 = 5"},
    ]
    pol = StepPolicy(tiny.model, tiny.tok, reference=tiny.ref, pair_prompt_length=4, pair_max_length=6)
    cached = cache_pair_references(pol, pairs, batch=2)  # batches of 2 and 1
    for x, c in zip(pairs, cached, strict=True):
        p_ids, p_mask = tokenize_prompts(tiny.tok, [x["prompt"]] * 2, 4)
        c_ids, c_mask = tokenize_completions(tiny.tok, [x["chosen"], x["rejected"]], 6)
        ref = (completion_logprobs_no_grad(tiny.ref, p_ids, p_mask, c_ids, c_mask) * c_mask).sum(-1)
        assert {k: c[k] for k in x} == x
        assert c[PAIR_REF_KEYS[0]] == pytest.approx(float(ref[0]), abs=1e-4)
        assert c[PAIR_REF_KEYS[1]] == pytest.approx(float(ref[1]), abs=1e-4)


def test_hidden_states_share_the_log_prob_forward(tiny):
    rec = _record(tiny)
    pol = StepPolicy(tiny.model, tiny.tok)
    inputs, _ = assemble_inputs(rec, ChannelComposer([Reads("hidden_states")]), pol)
    with torch.no_grad():
        want = completion_hidden(tiny.model, rec.prompt_ids, rec.prompt_mask, rec.completion_ids, rec.completion_mask)
    torch.testing.assert_close(inputs["hidden_states"].detach(), want, atol=1e-5, rtol=1e-5)
    assert inputs["lm_head_weight"] is lm_head_weight(tiny.model)
    # with log-probs read too, one forward makes both (the hidden states are the log-prob builder's)
    calls = []
    hook = tiny.model.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        inputs, _ = assemble_inputs(rec, ChannelComposer([Reads("logprobs", "hidden_states")]), pol)
    finally:
        hook.remove()
    assert len(calls) == 1
    torch.testing.assert_close(inputs["hidden_states"].detach(), want, atol=1e-5, rtol=1e-5)


def _score(sampled, mask):
    return SimpleNamespace(sampled=torch.tensor(sampled), mask=torch.tensor(mask))


def test_sampled_teacher_logprobs_average_probabilities_and_fall_back_to_the_policy():
    N, C2 = 3, 4
    rec = StepRecord(
        tasks=[],
        prompts=[],
        completions=[],
        prompt_ids=torch.zeros(N, 1, dtype=torch.long),
        prompt_mask=torch.ones(N, 1),
        completion_ids=torch.zeros(N, C2, dtype=torch.long),
        completion_mask=torch.ones(N, C2),
        rewards=torch.zeros(N),
        advantages=torch.zeros(N),
    )
    own = torch.full((N, C2), -3.0)
    asm = Assembly(rec, StepPolicy(None, None), ("teacher_logprobs",), values={"logprobs": own})
    la, lb = math.log(0.5), math.log(0.1)
    scores = {
        # row 0: two teachers on token 0 (mean of probabilities), one on token 1; a NaN one is left out
        "a": [_score([la, la, float("nan"), 0.0, 0.0, 0.0], [1, 1, 1, 1, 1, 1]), None, _score([la], [0])],
        "b": [_score([lb, float("nan"), lb, lb], [1, 0, 0, 0]), SimpleNamespace(sampled=None, mask=None)],
    }
    got = _sampled_teacher_logprobs(asm, scores)
    assert got.dtype == torch.float32 and got.shape == (N, C2)
    assert got[0, 0].item() == pytest.approx(math.log(0.3), rel=1e-6)
    assert got[0, 1].item() == pytest.approx(la, rel=1e-6)
    assert got[0, 2].item() == -3.0  # NaN from a, masked for b: nobody scored it
    assert got[0, 3].item() == pytest.approx(0.0, abs=1e-6)  # a scored log 1; b's entry is off its mask
    assert got[1].tolist() == [-3.0] * C2 and got[2].tolist() == [-3.0] * C2
    # nobody scored anything: None
    assert _sampled_teacher_logprobs(asm, {"a": [_score([la], [0])], "b": "not rows"}) is None
    # a tiny probability is floored at 1e-30, not -inf
    got = _sampled_teacher_logprobs(asm, {"a": [_score([-1000.0], [1])]})
    assert got[0, 0].item() == pytest.approx(math.log(1e-30), rel=1e-5)
    # without the policy's log-probs the fall-back is 0
    asm = Assembly(rec, StepPolicy(None, None), ("teacher_logprobs",))  # no builders: nothing runs
    got = _sampled_teacher_logprobs(asm, {"a": [_score([la], [1])]})
    assert got[0, 1].item() == 0.0 and got[0, 0].item() == pytest.approx(la)


def test_the_assembly_runs_each_builder_once_and_builds_companions():
    calls = []

    def both(asm):
        calls.append(1)
        return {"m_a": 1, "m_b": 2}

    table = {**input_builders(), "m_a": both, "m_b": both}  # one builder under two names
    rec = _plain()
    inputs, _ = assemble_inputs(rec, Needs("m_a", "m_b"), StepPolicy(None, None), builders=table)
    assert calls == [1] and inputs["m_a"] == 1 and inputs["m_b"] == 2
    asm = Assembly(rec, StepPolicy(None, None), ("m_a",), builders=table)
    assert asm.wants("m_a") and not asm.wants("m_b") and asm.get("nothing_builds_this") is None
    assert asm.device == rec.completion_ids.device
    # given inputs that are None do not count as given
    inputs, _ = assemble_inputs(rec, Needs("m_a"), StepPolicy(None, None), given={"m_a": None}, builders=table)
    assert inputs["m_a"] == 1
    # the log-prob companions come with a given "logprobs"
    lp = torch.zeros(2, 3)
    inputs, _ = assemble_inputs(rec, Needs("logprobs"), StepPolicy(None, None), given={"logprobs": lp})
    assert torch.equal(inputs["old_logprobs"], lp) and inputs["inference_logprobs"] is inputs["old_logprobs"]
    # the builders a registry holds: the built-ins, one entry per input name
    assert input_builders()["hint_mask"] is input_builders()["student_hidden"]


def test_micro_batch_rows_follow_the_concatenated_length():
    seen = []
    pol = StepPolicy(None, None, rows_per_micro_batch=lambda n: seen.append(n) or 3)
    assert pol.micro_batch(torch.zeros(2, 4), torch.zeros(2, 6)) == 3 and seen == [10]
    assert StepPolicy(None, None).micro_batch(torch.zeros(2, 4)) is None


def test_missing_input_message_names_only_active_readers_and_the_closest_input():
    a = Reads("advantage", name="reader")
    off = Reads("advantage", name="off", weight=0.0)
    with pytest.raises(MissingInputError) as e:
        assemble_inputs(_plain(), ChannelComposer([a, off]), StepPolicy(None, None))
    msg = str(e.value)
    assert "loss channel 'reader' reads the input 'advantage'" in msg and "'off'" not in msg
    assert "Did you mean: 'advantages'" in msg and "Inputs with a builder: " in msg

    class Ascended(Reads):
        allows_negative_weight = True

    neg = Ascended("advantage", name="ascended", weight=-0.5)  # a live channel too, though its weight is < 0
    with pytest.raises(MissingInputError, match="loss channel 'ascended' reads the input 'advantage'"):
        assemble_inputs(_plain(), ChannelComposer([neg]), StepPolicy(None, None))


def _plain() -> StepRecord:
    return StepRecord(
        tasks=[],
        prompts=[],
        completions=[],
        prompt_ids=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1),
        completion_ids=torch.zeros(2, 3, dtype=torch.long),
        completion_mask=torch.ones(2, 3),
        rewards=torch.zeros(2),
        advantages=torch.zeros(2),
    )


def test_teacher_scores_are_handed_over_with_the_scored_fraction():
    from composer_plugins.kernels.teacher_topk import TeacherTopK

    present = torch.tensor([[[1, 0, 1]], [[0, 0, 1]]], dtype=torch.bool)  # (B, N, T): 2 of the 5 tokens scored
    packed = TeacherTopK(torch.zeros(2, 1, 3, 2, dtype=torch.long), torch.full((2, 1, 3, 2), -1.0), present, ("a",))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rec = _plain().replace(completion_mask=mask, teacher_scores={"a": packed, "b": None})
    inputs, stats = assemble_inputs(rec, Needs("teacher_scores"), StepPolicy(None, None))
    assert inputs["teacher_scores"] is packed
    assert stats["teacher/scored_fraction"] == pytest.approx(2 / 5)
    one = rec.replace(completion_mask=torch.tensor([[0, 0, 1], [0, 0, 0]]))  # one completion token, scored
    _, stats = assemble_inputs(one, Needs("teacher_scores"), StepPolicy(None, None))
    assert stats["teacher/scored_fraction"] == 1.0
    rec = rec.replace(teacher_scores={"b": None})
    inputs, _ = assemble_inputs(rec, Needs("teacher_scores"), StepPolicy(None, None))
    assert "teacher_scores" not in inputs


def test_is_ratio_over_one_token_and_over_none(tiny):
    from composer_plugins.losses.functional import importance_sampling_correction

    mask = torch.zeros(ROWS, C, dtype=torch.long)
    mask[1, 2] = 1
    rec = _record(tiny).replace(
        completion_mask=mask, old_logprobs=torch.zeros(ROWS, C), sampling_logprobs=torch.full((ROWS, C), -0.5)
    )
    pol = StepPolicy(tiny.model, tiny.tok, importance_sampling=("token_truncate", 3.0, None))
    _, stats = assemble_inputs(rec, ChannelComposer([Reads("old_logprobs")]), pol)
    ratio = importance_sampling_correction(rec.old_logprobs, rec.sampling_logprobs, rec.completion_mask)
    assert stats["is_ratio"] == pytest.approx(float(ratio[1, 2])) and float(ratio[1, 2]) > 1.5
    rec = rec.replace(completion_mask=torch.zeros(ROWS, C, dtype=torch.long))
    _, stats = assemble_inputs(rec, ChannelComposer([Reads("old_logprobs")]), pol)
    assert stats["is_ratio"] == 0.0
