"""The ``teacher_distill`` channel: on-policy distillation from N teachers' top-k log-probs.

* K = V and one teacher equals the plain full-vocabulary formula (reverse KL, forward KL, JSD):
  loss and gradients, chunked from hidden states;
* the chunked closed-form path equals the materialised path under autograd for K < V, three
  teachers, weights and ``min_agree``;
* the mixture and ``min_agree`` against hand-computed numbers;
* the channel through the composer (skipped and reported without teacher scores) and the
  loss-channel conformance checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from composer_plugins.kernels.divergences import TeacherTopKKernel
from composer_plugins.kernels.teacher_topk import (
    TeacherTopK,
    agreement_mask,
    chunked_teacher_distill,
    merge_teachers,
    teacher_distill_reference,
)
from composer_plugins.losses.base import ChannelComposer
from composer_plugins.losses.teacher_distill import TeacherDistillChannel

torch.set_num_threads(1)

B, T, V, H = 2, 5, 13, 4
DIVERGENCES = [("reverse_kl", 0.5), ("forward_kl", 0.5), ("jsd", 0.3)]


def _leaves(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    return h, w, mask, g


def _plain(s, t, divergence, beta):
    """The full-vocabulary formula from log-probs ``s`` (student) and ``t`` (teacher)."""
    if divergence == "reverse_kl":
        return (s.exp() * (s - t)).sum(-1)
    if divergence == "forward_kl":
        return (t.exp() * (t - s)).sum(-1)
    m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_k_equal_v_one_teacher_is_the_full_vocabulary_formula(divergence, beta, temperature):
    h, w, mask, g = _leaves()
    t = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2, -1)
    top = t.topk(V, -1)  # the teacher's whole vocabulary, in its own order
    scores = TeacherTopK(top.indices.unsqueeze(1), top.values.unsqueeze(1), mask.unsqueeze(1).clone(), ("a",))
    ker = TeacherTopKKernel(divergence, beta, temperature)
    out = chunked_teacher_distill(h, w, scores, mask, ker, chunk_size=3)
    gh, gw = torch.autograd.grad(out.loss, (h, w))
    s = torch.log_softmax((h @ w.T) / temperature, -1)
    ref = _plain(s, t, divergence, beta)[mask].mean()
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert out.tokens == int(mask.sum())
    torch.testing.assert_close(out.loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(gw, rw, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES)
@pytest.mark.parametrize("min_agree", [None, 2])
def test_chunked_equals_materialised_autograd_three_teachers(divergence, beta, min_agree):
    h, w, mask, g = _leaves(1)
    N, K = 3, 4
    t = torch.log_softmax(torch.randn(B, N, T, V, generator=g, dtype=torch.float64) * 2, -1)
    t[:, 1] = t[:, 0] + 0.01 * torch.randn(B, T, V, generator=g, dtype=torch.float64)  # teachers 0, 1 mostly agree
    t = torch.log_softmax(t, -1)
    top = t.topk(K, -1)
    present = torch.rand(B, N, T, generator=g) > 0.2
    scores = TeacherTopK(top.indices, top.values, present, ("a", "b", "c"))
    ker = TeacherTopKKernel(divergence, beta, 1.3)
    kw = {"weights": {"a": 1.0, "b": 2.0, "c": 0.5}, "min_agree": min_agree}
    out = chunked_teacher_distill(h, w, scores, mask, ker, chunk_size=2, **kw)
    gh, gw = torch.autograd.grad(out.loss, (h, w))
    ref = teacher_distill_reference(h @ w.T, scores, mask, ker, **kw)
    rh, rw = torch.autograd.grad(ref.loss, (h, w))
    assert out.tokens == ref.tokens > 0
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(gw, rw, rtol=1e-8, atol=1e-10)


def test_mixture_by_hand():
    """Two teachers over V = 5 with weights 3:1 (0.75, 0.25)."""
    #   teacher a: top-2 {1: 0.5, 2: 0.3}  (tail 0.2)
    #   teacher b: top-2 {2: 0.6, 4: 0.1}  (tail 0.3)
    # mixture: id1 .75·.5 = .375; id2 .75·.3 + .25·.6 = .375; id4 .25·.1 = .025; tail 1 - .775 = .225
    ids = torch.tensor([[[1, 2], [2, 4]]])
    lps = torch.tensor([[[0.5, 0.3], [0.6, 0.1]]], dtype=torch.float64).log()
    uid, lt, valid = merge_teachers(ids, lps, torch.ones(1, 2, dtype=torch.bool), torch.tensor([3.0, 1.0]), 5)
    got = {int(i): float(p) for i, p, v in zip(uid[0], lt[0, :-1].exp(), valid[0], strict=True) if v}
    assert got == pytest.approx({1: 0.375, 2: 0.375, 4: 0.025})
    assert float(lt[0, -1].exp()) == pytest.approx(0.225)
    # the loss at one token, student p = softmax(log [.1, .2, .3, .15, .25]): reverse KL on the buckets
    p = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float64)
    ps = {1: 0.2, 2: 0.3, 4: 0.25, "tail": 0.25}
    qs = {1: 0.375, 2: 0.375, 4: 0.025, "tail": 0.225}
    want = sum(ps[k] * math.log(ps[k] / qs[k]) for k in ps)
    scores = TeacherTopK(ids.view(1, 2, 1, 2), lps.view(1, 2, 1, 2), torch.ones(1, 2, 1, dtype=torch.bool))
    ch = TeacherDistillChannel(divergence="reverse_kl", weights={"teacher0": 3.0, "teacher1": 1.0})
    loss, m = ch(
        {"completion_logits": p.log().view(1, 1, 5), "teacher_scores": scores, "completion_mask": torch.ones(1, 1)}
    )
    assert float(loss) == pytest.approx(want, rel=1e-9)
    assert m["teacher_topk_mass"] == pytest.approx(0.775)
    assert m["student_topk_mass"] == pytest.approx(0.75)


def test_a_missing_teacher_renormalises_the_mixture():
    ids = torch.tensor([[[1, 2], [2, 4]]])
    lps = torch.tensor([[[0.5, 0.3], [0.6, 0.1]]]).log()
    present = torch.tensor([[False, True]])  # teacher a did not score this token: b alone
    uid, lt, valid = merge_teachers(ids, lps, present, torch.tensor([3.0, 1.0]), 5)
    got = {int(i): float(p) for i, p, v in zip(uid[0], lt[0, :-1].exp(), valid[0], strict=True) if v}
    assert got == pytest.approx({2: 0.6, 4: 0.1})
    assert float(lt[0, -1].exp()) == pytest.approx(0.3)


def test_min_agree_by_hand():
    # 3 teachers, 4 positions; top-1 ids per position:
    #   pos 0: 7, 7, 7 -> 3 agree    pos 1: 7, 8, 7 -> 2    pos 2: 1, 2, 3 -> 1
    #   pos 3: 5, 5, (absent) -> 2 among the present
    top1 = torch.tensor([[7, 7, 7], [7, 8, 7], [1, 2, 3], [5, 5, 5]])
    ids = torch.stack([top1, top1 + 100], -1)  # second entry never wins
    lps = torch.tensor([-0.1, -3.0]).expand(4, 3, 2)
    present = torch.ones(4, 3, dtype=torch.bool)
    present[3, 2] = False
    assert agreement_mask(ids, lps, present, 1).tolist() == [True, True, True, True]
    assert agreement_mask(ids, lps, present, 2).tolist() == [True, True, False, True]
    assert agreement_mask(ids, lps, present, 3).tolist() == [True, False, False, False]
    # through the channel: only the kept positions count
    h = torch.randn(1, 4, 3, dtype=torch.float64)
    w = torch.randn(200, 3, dtype=torch.float64)
    scores = TeacherTopK(
        ids.unsqueeze(0).transpose(1, 2),
        lps.unsqueeze(0).transpose(1, 2).double(),
        present.unsqueeze(0).transpose(1, 2),
    )
    mask = torch.ones(1, 4)
    _, m = TeacherDistillChannel(min_agree=3)(
        {"teacher_scores": scores, "completion_mask": mask, "hidden_states": h, "lm_head_weight": w}
    )
    assert m["tokens"] == 1.0 and m["coverage"] == 0.25
    _, m = TeacherDistillChannel(min_agree=2)(
        {"teacher_scores": scores, "completion_mask": mask, "hidden_states": h, "lm_head_weight": w}
    )
    assert m["tokens"] == 3.0 and m["coverage"] == 0.75  # position 2 (no two agree) is left out


def test_sampled_token_only_is_a_two_way_distribution():
    """PRIME-RL's ``teacher_logprobs`` (the teacher's log-prob of each sampled token): K = 1 plus the tail."""
    h, w, mask, g = _leaves(2)
    ids = torch.randint(V, (B, T), generator=g)
    tlp = torch.full((B, T), math.log(0.6), dtype=torch.float64)
    scores = TeacherTopK.from_sampled(ids, tlp, mask)
    out = chunked_teacher_distill(h, w, scores, mask, TeacherTopKKernel("reverse_kl"))
    p = torch.softmax(h @ w.T, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    want = (p * (p / 0.6).log() + (1 - p) * ((1 - p) / 0.4).log())[mask].mean()
    torch.testing.assert_close(out.loss, want)


def test_teacher_side_is_tokens_times_k():
    scores = TeacherTopK(
        torch.zeros(2, 3, 7, 20, dtype=torch.long), torch.zeros(2, 3, 7, 20), torch.ones(2, 3, 7, dtype=torch.bool)
    )
    assert scores.nbytes == 2 * 3 * 7 * (20 * 8 + 20 * 4 + 1)


def test_composer_skips_and_reports_without_teacher_scores():
    h, w, mask, _ = _leaves()
    comp = ChannelComposer.from_specs([{"name": "teacher_distill", "weight": 0.5}])
    loss, m = comp({"hidden_states": h, "lm_head_weight": w, "completion_mask": mask.float()})
    assert m["teacher_distill/skipped"] == 1.0 and "teacher_scores" in m["teacher_distill/missing"]
    assert float(loss) == 0.0


def test_bad_config_names_the_fix():
    with pytest.raises(ValueError, match="reverse_kl, forward_kl, jsd"):
        TeacherDistillChannel(divergence="kl")
    with pytest.raises(ValueError, match="min_agree"):
        TeacherDistillChannel(min_agree=0)
    with pytest.raises(ValueError, match="weights"):
        TeacherDistillChannel(weights={"a": -1})


def test_conformance():
    from composer_plugins.testing.conformance import check_loss

    check_loss("teacher_distill")
    check_loss("teacher_distill", divergence="jsd", beta=0.4, min_agree=1)


# ------------------------------------------------------------------------------------------------
# bad scores: non-finite log-probs, weight-0 and absent teachers, ids >= V, repeated ids
# ------------------------------------------------------------------------------------------------
PATHS = ["hidden_states", "completion_logits"]


def _channel(path, scores, mask, seed=3, **kw):
    """The channel's loss, metrics and gradient in the hidden states on ``path``."""
    h, w, _, _ = _leaves(seed)
    outputs = {"hidden_states": h, "lm_head_weight": w} if path == "hidden_states" else {"completion_logits": h @ w.T}
    loss, m = TeacherDistillChannel(**kw)({"teacher_scores": scores, "completion_mask": mask, **outputs})
    (grad,) = torch.autograd.grad(loss, h) if loss.requires_grad else (torch.zeros_like(h),)
    return loss, m, grad


def _two_teachers(seed=4, K=3):
    g = torch.Generator().manual_seed(seed)
    t = torch.log_softmax(torch.randn(B, 2, T, V, generator=g, dtype=torch.float64) * 2, -1)
    top = t.topk(K, -1)
    present = torch.ones(B, 2, T, dtype=torch.bool)
    return TeacherTopK(top.indices.clone(), top.values.clone(), present, ("a", "b"))


def _drop(scores, where):
    """The same scores with the entries at ``where`` (a bool of the ids' shape) absent (id -1)."""
    return TeacherTopK(torch.where(where, -1, scores.ids), scores.logprobs.clone(), scores.mask.clone(), scores.names)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES)
def test_nonfinite_teacher_entries_are_left_out_and_counted(path, divergence, beta):
    _, _, mask, _ = _leaves()
    scores = _two_teachers()
    bad = torch.zeros_like(scores.ids, dtype=torch.bool)
    bad[0, 0, 1, 0] = bad[1, 1, 2, 1] = bad[0, 1, 4, 2] = True
    dirty = TeacherTopK(scores.ids.clone(), scores.logprobs.clone(), scores.mask, scores.names)
    dirty.logprobs[0, 0, 1, 0] = math.nan
    dirty.logprobs[1, 1, 2, 1] = math.inf
    dirty.logprobs[0, 1, 4, 2] = math.nan
    dirty.logprobs[1, 0, 4, 0] = math.nan  # a masked-out completion token: left out, not counted
    kw = {"divergence": divergence, "beta": beta}
    loss, m, grad = _channel(path, dirty, mask, **kw)
    want, wm, wgrad = _channel(path, _drop(scores, bad), mask, **kw)
    assert torch.isfinite(loss) and bool(torch.isfinite(grad).all())
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, wgrad, rtol=1e-9, atol=1e-11)
    assert m["nonfinite"] == 3.0 and wm["nonfinite"] == 0.0
    assert m["tokens"] == wm["tokens"] == float(mask.sum())


@pytest.mark.parametrize("path", PATHS)
def test_a_teacher_whose_entries_are_all_nan_is_absent_there(path):
    _, _, mask, _ = _leaves()
    scores = TeacherTopK(
        _two_teachers().ids[:, :1],
        _two_teachers().logprobs[:, :1].clone(),
        torch.ones(B, 1, T, dtype=torch.bool),
        ("a",),
    )
    scores.logprobs[0, 0, 2] = math.nan  # every entry of the only teacher at one token
    loss, m, _ = _channel(path, scores, mask)
    assert torch.isfinite(loss) and m["tokens"] == float(mask.sum()) - 1 and m["nonfinite"] == 3.0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES)
def test_a_weight_zero_teacher_is_not_distilled(path, divergence, beta):
    _, _, mask, _ = _leaves()
    scores = _two_teachers()
    scores.mask[:, 0, 1:3] = False  # tokens 1, 2: only b (weight 0) scored them
    kw = {"divergence": divergence, "beta": beta}
    loss, m, grad = _channel(path, scores, mask, weights={"a": 1.0, "b": 0.0}, **kw)
    alone = TeacherTopK(scores.ids[:, :1], scores.logprobs[:, :1], scores.mask[:, :1], ("a",))
    want, wm, wgrad = _channel(path, alone, mask, **kw)
    assert m["tokens"] == wm["tokens"] == float(mask.sum()) - 4
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, wgrad, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("path", PATHS)
def test_one_teacher_branch_honours_weights(path):
    """Only ``other`` is in the batch and it weighs 0: nothing is distilled (the step goes on, loss 0)."""
    _, _, mask, _ = _leaves()
    s = _two_teachers()
    other = TeacherTopK(s.ids[:, 1:], s.logprobs[:, 1:], s.mask[:, 1:], ("other",))
    loss, m, grad = _channel(path, other, mask, weights={"strong": 1.0, "other": 0.0})
    assert float(loss) == 0.0 and m["tokens"] == 0.0 and m["empty"] == 1.0 and float(grad.abs().sum()) == 0.0
    assert m["absent/strong"] == 1.0 and m["teachers_absent"] == 1.0


@pytest.mark.parametrize("path", PATHS)
def test_weights_naming_an_absent_teacher_renormalise_over_those_present(path):
    """``strong`` missed its deadline: the step goes on over the teachers present, and the absence is reported."""
    _, _, mask, _ = _leaves()
    s = _two_teachers()
    other = TeacherTopK(s.ids[:, 1:], s.logprobs[:, 1:], s.mask[:, 1:], ("other",))
    loss, m, _ = _channel(path, other, mask, weights={"strong": 2.0, "other": 1.0})
    want, wm, _ = _channel(path, other, mask)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    assert m["tokens"] == wm["tokens"] == float(mask.sum())
    assert m["absent/strong"] == 1.0 and m["teachers_absent"] == 1.0 and wm["teachers_absent"] == 0.0
    # only the absent one weighs anything: nothing to distil, but no error either
    loss, m, _ = _channel(path, other, mask, weights={"strong": 1.0})
    assert float(loss) == 0.0 and m["tokens"] == 0.0 and m["absent/strong"] == 1.0


@pytest.mark.parametrize("path", PATHS)
def test_ids_at_or_above_the_vocabulary_are_absent(path):
    _, _, mask, _ = _leaves()
    s = _two_teachers()
    one = TeacherTopK(s.ids[:, :1].clone(), s.logprobs[:, :1].clone(), s.mask[:, :1].clone(), ("a",))
    oov = torch.zeros_like(one.ids, dtype=torch.bool)
    oov[0, 0, 3, :] = True  # every entry of token 3 of row 0 is >= V: that token is not distilled
    oov[1, 0, 0, 1] = True  # one entry: its mass goes to the tail
    dirty = TeacherTopK(torch.where(oov, V + 5, one.ids), one.logprobs, one.mask, one.names)
    loss, m, grad = _channel(path, dirty, mask)
    want, wm, wgrad = _channel(path, _drop(one, oov), mask)
    assert m["tokens"] == wm["tokens"] == float(mask.sum()) - 1
    assert m["out_of_vocab"] == float(one.ids.shape[-1] + 1)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, wgrad, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES)
def test_repeated_ids_merge_the_same_way_for_one_teacher_and_many(path, divergence, beta):
    """One teacher whose top-k repeats an id == the same teacher listed twice == its entries summed by hand."""
    _, _, mask, _ = _leaves()
    ids = torch.tensor([3, 3, 7, 1]).expand(B, 1, T, 4).clone()
    probs = torch.tensor([0.2, 0.1, 0.3, 0.15], dtype=torch.float64)
    lps = probs.log().expand(B, 1, T, 4).clone()
    one = TeacherTopK(ids, lps, torch.ones(B, 1, T, dtype=torch.bool), ("a",))
    twice = TeacherTopK(
        ids.repeat(1, 2, 1, 1), lps.repeat(1, 2, 1, 1), torch.ones(B, 2, T, dtype=torch.bool), ("a", "a2")
    )
    merged = TeacherTopK(
        torch.tensor([3, 7, 1, -1]).expand(B, 1, T, 4).clone(),
        torch.tensor([0.3, 0.3, 0.15, 1.0], dtype=torch.float64).log().expand(B, 1, T, 4).clone(),
        torch.ones(B, 1, T, dtype=torch.bool),
        ("a",),
    )
    kw = {"divergence": divergence, "beta": beta}
    l1, _, g1 = _channel(path, one, mask, **kw)
    l2, _, g2 = _channel(path, twice, mask, **kw)
    torch.testing.assert_close(g1, g2, rtol=1e-9, atol=1e-11)
    lm, _, gm = _channel(path, merged, mask, **kw)
    torch.testing.assert_close(l1, l2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(l1, lm, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g1, gm, rtol=1e-9, atol=1e-11)
    # the by-hand restatement at one token: buckets {3: .3, 7: .3, 1: .15, tail: .25}
    h, w, _, _ = _leaves(3)
    s = torch.log_softmax(h @ w.T, -1)[0, 0]
    ps = torch.stack([s[3].exp(), s[7].exp(), s[1].exp()])
    ps = torch.cat([ps, 1 - ps.sum(0, keepdim=True)])
    qs = torch.tensor([0.3, 0.3, 0.15, 0.25], dtype=torch.float64)
    per = _plain(ps.log(), qs.log(), divergence, beta)
    ker = TeacherTopKKernel(divergence, beta)
    first = TeacherTopK(ids[:1, :, :1], lps[:1, :, :1], torch.ones(1, 1, 1, dtype=torch.bool))
    ref = teacher_distill_reference((h @ w.T)[:1, :1], first, torch.ones(1, 1), ker)
    torch.testing.assert_close(ref.loss, per, rtol=1e-10, atol=1e-12)


def test_the_log_floor_reads_minus_inf_as_log_1e_30():
    """A teacher log-prob of -inf (probability 0) is read as log 1e-30: a finite loss, equal to passing log 1e-30."""
    _, _, mask, _ = _leaves()
    s = _two_teachers()
    a = TeacherTopK(s.ids[:, :1].clone(), s.logprobs[:, :1].clone(), s.mask[:, :1], ("a",))
    b = TeacherTopK(a.ids, a.logprobs.clone(), a.mask, ("a",))
    a.logprobs[..., -1] = -math.inf
    b.logprobs[..., -1] = math.log(1e-30)
    la, ma, _ = _channel("hidden_states", a, mask)
    lb, _, _ = _channel("hidden_states", b, mask)
    assert torch.isfinite(la) and ma["nonfinite"] == 0.0
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-14)


def test_teacher_tokens_counts_what_the_channel_distils():
    """The data-parallel denominator (``teacher_tokens``) follows the same rules as the channel: ids >= V, NaN
    entries and weight-0 teachers do not make a token distilled."""
    from composer_plugins.losses.teacher_distill import teacher_tokens

    _, _, mask, _ = _leaves()
    s = _two_teachers()
    s.mask[:, 0, 1:3] = False  # tokens 1, 2: only b
    s.ids[0, 0, 4] = V + 1  # row 0, token 4: a's entries all outside the vocabulary
    s.logprobs[1, 0, 0] = math.nan  # row 1, token 0: a's entries all NaN
    for weights in (None, {"a": 1.0, "b": 0.0}, {"a": 1.0, "b": 1.0}):
        _, m, _ = _channel("hidden_states", s, mask, weights=weights)
        assert float(teacher_tokens(s, mask, V, weights)) == m["tokens"], weights
    assert m["tokens"] == float(mask.sum())
    assert float(teacher_tokens(s, mask, V, {"a": 1.0, "b": 0.0})) == float(mask.sum()) - 4 - 1 - 1
