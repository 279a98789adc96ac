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
    loss, m = ch({"completion_logits": p.log().view(1, 1, 5)}, {"teacher_scores": scores,
                                                                 "completion_mask": torch.ones(1, 1)})  # fmt: skip
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
    scores = TeacherTopK(ids.unsqueeze(0).transpose(1, 2), lps.unsqueeze(0).transpose(1, 2).double(),
                         present.unsqueeze(0).transpose(1, 2))  # fmt: skip
    mask = torch.ones(1, 4)
    _, m = TeacherDistillChannel(min_agree=3)({"hidden_states": h, "lm_head_weight": w},
                                              {"teacher_scores": scores, "completion_mask": mask})  # fmt: skip
    assert m["tokens"] == 1.0 and m["coverage"] == 0.25


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
    scores = TeacherTopK(torch.zeros(2, 3, 7, 20, dtype=torch.long), torch.zeros(2, 3, 7, 20),
                         torch.ones(2, 3, 7, dtype=torch.bool))  # fmt: skip
    assert scores.nbytes == 2 * 3 * 7 * (20 * 8 + 20 * 4 + 1)


def test_composer_skips_and_reports_without_teacher_scores():
    h, w, mask, _ = _leaves()
    comp = ChannelComposer.from_specs([{"name": "teacher_distill", "weight": 0.5}])
    loss, m = comp({"hidden_states": h, "lm_head_weight": w}, {"completion_mask": mask.float()})
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
