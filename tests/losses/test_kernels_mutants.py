"""Kernel paths the mutation run (``python -m benchmarks.mutation --only kernels``) found unchecked.

* ``chunked_distill``: the gradient-in-forward path (``grad_mode="precompute"``) against the recompute path for
  every scalar reduction, with and without a mask and per-token weights — on 3-D hidden states, where
  ``batchmean`` without a mask divides by the batch size;
* ``chunked_teacher_distill`` with per-token weights against the materialised reference (loss and gradients);
* the located shape errors name the shape they expect.
"""

from __future__ import annotations

import pytest
import torch

from composer_plugins.kernels.chunked import chunked_distill
from composer_plugins.kernels.divergences import JSDKernel, TeacherTopKKernel
from composer_plugins.kernels.teacher_topk import TeacherTopK, chunked_teacher_distill, teacher_distill_reference

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _keep_the_global_rng():
    """These tests leave torch's global RNG as they found it (tests after them draw from it unseeded)."""
    with torch.random.fork_rng(devices=[]):
        yield


B, T, V, H = 3, 4, 11, 5


def _leaves(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, T, H, generator=g, dtype=torch.float64).requires_grad_()
    ht = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 2:] = False
    mask[2, 1:] = False
    tw = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    return hs, ht, w, mask, tw


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_precompute_equals_recompute_for_every_scalar_reduction(reduction, masked, weighted):
    hs, ht, w, mask, tw = _leaves()
    kw = {
        "mask": mask if masked else None,
        "reduction": reduction,
        "chunk_size": 3,
        "token_weight": tw if weighted else None,
    }
    ker = JSDKernel(beta=0.3, temperature=1.3)
    a = chunked_distill(hs, ht, w, ker, grad_mode="recompute", **kw)
    ga = torch.autograd.grad(a, (hs, w))
    b = chunked_distill(hs, ht, w, ker, grad_mode="precompute", **kw)
    gb = torch.autograd.grad(b, (hs, w))
    torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    for x, y in zip(gb, ga, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)
    # and against the per-token values reduced here
    per = chunked_distill(hs.detach(), ht, w.detach(), ker, mask=kw["mask"], reduction="token", chunk_size=3)
    if weighted:
        per = per * tw
    if masked:
        per = per * mask
    n = int(mask.sum()) if masked else B * T
    want = {"batchmean": per.sum() / (n if masked else B), "sum": per.sum(), "mean": per.sum() / (n * V)}[reduction]
    torch.testing.assert_close(a.detach(), want, rtol=1e-10, atol=1e-12)


def test_shape_errors_name_the_expected_shape():
    hs, ht, w, mask, tw = _leaves()
    ker = JSDKernel(beta=0.5)
    with pytest.raises(ValueError, match=r"student_hidden\.shape\[:-1\] = \(3, 4\)"):
        chunked_distill(hs, ht, w, ker, mask=mask[:, :2])
    with pytest.raises(
        ValueError, match=r"token_weight shape \(3, 2\) must equal student_hidden\.shape\[:-1\] = \(3, 4\)"
    ):
        chunked_distill(hs, ht, w, ker, token_weight=tw[:, :2])


def _scores(seed: int = 3, N: int = 2, K: int = 3):
    g = torch.Generator().manual_seed(seed)
    t = torch.log_softmax(torch.randn(B, N, T, V, generator=g, dtype=torch.float64) * 2, -1)
    top = t.topk(K, -1)
    present = torch.ones(B, N, T, dtype=torch.bool)
    present[1, 1, :2] = False
    return TeacherTopK(top.indices, top.values, present, tuple("ab"[:N]))


@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "jsd"])
def test_teacher_distill_token_weights_equal_the_materialised_reference(divergence):
    hs, _, w, mask, tw = _leaves(1)
    scores = _scores()
    ker = TeacherTopKKernel(divergence, 0.4, 1.1)
    for kw in ({"token_weight": tw}, {"token_weight": tw, "denominator": 7.0}):
        out = chunked_teacher_distill(hs, w, scores, mask, ker, chunk_size=2, **kw)
        gh, gw = torch.autograd.grad(out.loss, (hs, w))
        ref = teacher_distill_reference(hs @ w.T, scores, mask, ker, **kw)
        rh, rw = torch.autograd.grad(ref.loss, (hs, w))
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(gh, rh, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(gw, rw, rtol=1e-8, atol=1e-10)
    # weights matter: doubling them doubles the loss and its gradient, zero weights give zero
    one = chunked_teacher_distill(hs, w, scores, mask, ker, chunk_size=2)
    two = chunked_teacher_distill(hs, w, scores, mask, ker, chunk_size=2, token_weight=torch.full((B, T), 2.0))
    torch.testing.assert_close(two.loss, 2 * one.loss, rtol=1e-10, atol=1e-12)
    g1 = torch.autograd.grad(one.loss, hs)[0]
    g2 = torch.autograd.grad(two.loss, hs)[0]
    torch.testing.assert_close(g2, 2 * g1, rtol=1e-9, atol=1e-12)
    zero = chunked_teacher_distill(hs, w, scores, mask, ker, chunk_size=2, token_weight=torch.zeros(B, T))
    assert float(zero.loss.detach()) == 0.0 and not torch.autograd.grad(zero.loss, hs)[0].any()


@pytest.mark.parametrize("temperature", [2.0, 0.5])
def test_chunked_logprobs_and_entropy_at_a_temperature(temperature):
    from composer_plugins.kernels.chunked import chunked_logprobs

    hs, _, w, _, _ = _leaves(2)
    ids = torch.randint(V, (B, T), generator=torch.Generator().manual_seed(5))
    lp, ent = chunked_logprobs(hs, w, ids, chunk_size=3, temperature=temperature, return_entropy=True)
    ref = torch.log_softmax((hs @ w.T) / temperature, -1)
    torch.testing.assert_close(lp, ref.gather(-1, ids.unsqueeze(-1)).squeeze(-1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), rtol=1e-10, atol=1e-12)
    g = torch.autograd.grad(lp.sum(), hs)[0]
    rg = torch.autograd.grad(ref.gather(-1, ids.unsqueeze(-1)).sum(), hs)[0]
    torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-11)


def test_sampled_token_divergence_values_and_gradients_are_the_two_way_formula():
    from composer_plugins.kernels.teacher_topk import sampled_token_divergence

    s = torch.log(torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)).requires_grad_()
    t = torch.log(torch.tensor([0.6, 0.4, 0.3], dtype=torch.float64))
    got = sampled_token_divergence(s, t, TeacherTopKKernel("reverse_kl"))
    p, q = s.exp(), t.exp()
    want = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    (g,) = torch.autograd.grad(got.sum(), s)
    (rg,) = torch.autograd.grad(want.sum(), s)
    assert rg.abs().min() > 1e-3
    torch.testing.assert_close(g, rg, rtol=1e-8, atol=1e-10)


def test_teacher_log_probs_are_floored_at_log_1e_30():
    import math

    from composer_plugins.kernels.teacher_topk import merge_teachers

    ids = torch.tensor([[[1, 2]]])
    lps = torch.tensor([[[math.log(0.5), -1000.0]]], dtype=torch.float64)
    _, lt, valid = merge_teachers(ids, lps, torch.ones(1, 1, dtype=torch.bool), torch.tensor([1.0]), 5)
    assert bool(valid.all())
    assert float(lt[0, 1]) == pytest.approx(math.log(1e-30), rel=1e-6)


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd", "reverse_kl"])
def test_teacher_topk_gradient_has_no_tail_term_where_the_student_tail_is_floored(divergence):
    """A row whose student mass on the teacher's ids rounds to 1 has its tail floored (no gradient through
    it) although the row still has a tail bucket; the fused gradient equals autograd's on ``value``."""
    import math

    g = torch.Generator().manual_seed(3)
    n, k = 3, 2
    zs = torch.randn(n, V, generator=g, dtype=torch.float64)
    ids = torch.tensor([[1, 4], [0, 7], [2, 9]])
    zs[0, ids[0]] = 40.0  # row 0: p(ids) = 1 - ~1e-16, tail floored, has a tail (k < V)
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.25, 0.25, 0.5]], dtype=torch.float64)
    lt = probs.log()
    valid = torch.ones(n, k, dtype=torch.bool)
    ker = TeacherTopKKernel(divergence, 0.4)
    leaf = zs.clone().requires_grad_()
    ref = ker.value(leaf, ids, lt, valid)
    (want,) = torch.autograd.grad(ref.sum(), leaf)
    val, grad, _ = ker.compute(zs.clone(), ids, lt, valid, grad_out=torch.ones(n, dtype=torch.float64))
    torch.testing.assert_close(val, ref.detach(), rtol=1e-10, atol=1e-12)
    assert math.isfinite(float(grad.abs().max())) and float(grad[0].abs().max()) < 1.0
    torch.testing.assert_close(grad, want, rtol=1e-8, atol=1e-10)


def test_chunked_logprobs_rejects_a_mask_of_another_shape():
    from composer_plugins.kernels.chunked import chunked_logprobs

    hs, _, w, _, _ = _leaves(2)
    ids = torch.zeros(B, T, dtype=torch.long)
    for shape in ((B, T - 2), (B, T + 1), (B - 1, T), (B * T,)):
        with pytest.raises(ValueError, match=rf"mask shape \({', '.join(map(str, shape))},?\) must equal ids shape"):
            chunked_logprobs(hs, w, ids, mask=torch.ones(shape, dtype=torch.bool), chunk_size=3)


def test_teacher_topk_from_rows_puts_the_scores_on_the_device_asked_for():
    from types import SimpleNamespace

    row = SimpleNamespace(
        token_ids=torch.tensor([[1, 2], [3, 4]]), logprobs=torch.full((2, 2), -1.0), mask=torch.tensor([True, False])
    )
    here = TeacherTopK.from_rows({"a": [row, None]}, 3)
    assert {here.ids.device.type, here.logprobs.device.type, here.mask.device.type} == {"cpu"}
    there = TeacherTopK.from_rows({"a": [row, None]}, 3, device="meta")
    assert {there.ids.device.type, there.logprobs.device.type, there.mask.device.type} == {"meta"}
    assert there.ids.shape == (2, 1, 3, 2) and there.mask.shape == (2, 1, 3)
    assert here.ids[0, 0, :2].tolist() == [[1, 2], [3, 4]] and here.mask[0, 0].tolist() == [True, False, False]
    assert not here.mask[1].any()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_teacher_topk_kernel_takes_every_beta_of_the_closed_interval(beta):
    """β = 0 (forward KL) and β = 1 (reverse KL) are the JSD's ends, both valid."""
    assert TeacherTopKKernel("jsd", beta).beta == beta


@pytest.mark.parametrize("beta", [-0.1, 1.1])
def test_teacher_topk_kernel_refuses_a_beta_outside_zero_one(beta):
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        TeacherTopKKernel("jsd", beta)


# --- issue 67: survivors of seed 6702 ---


def test_a_device_other_than_cuda_gets_the_cpu_chunk_rule_without_asking_cuda():
    from composer_plugins.kernels.chunked import auto_chunk_size

    for dev in ("cpu", "meta"):  # "meta" sorts after "cuda": it is still not a CUDA device
        rows = auto_chunk_size(151_936, torch.device(dev))
        assert rows == 96, (dev, rows)  # 2**24 logits // V = 110 rows, down to a multiple of 16


def test_the_default_jsd_is_the_symmetric_one_by_hand():
    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g, dtype=torch.float64)
    p, q = zs.softmax(-1), zt.softmax(-1)
    m = 0.5 * p + 0.5 * q
    want = 0.5 * (q * (q / m).log()).sum(-1) + 0.5 * (p * (p / m).log()).sum(-1)
    torch.testing.assert_close(JSDKernel().value(zs, zt), want)
    torch.testing.assert_close(JSDKernel().compute(zs, zt)[0], want)


# --- issue 67: survivors of seed 6713 ---


def test_a_sampled_token_stream_scores_finite_log_probs_and_minus_inf_only():
    from composer_plugins.kernels.teacher_topk import sampled_token_scored

    t = torch.tensor([0.0, -1.0, float("-inf"), float("nan"), float("inf"), 0.5])
    assert sampled_token_scored(t).tolist() == [True, True, True, False, False, False]


def test_chunked_teacher_distill_refuses_hidden_states_shorter_than_the_mask():
    scores = TeacherTopK(
        torch.zeros(2, 1, 5, 2, dtype=torch.long), torch.full((2, 1, 5, 2), -1.0), torch.ones(2, 1, 5, dtype=torch.bool)
    )
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"hidden \(2, 4, 3\) must be \(B, T, H\) with \(B, T\) = mask \(2, 5\)"):
        chunked_teacher_distill(torch.randn(2, 4, 3), torch.randn(7, 3), scores, mask, TeacherTopKKernel())


def test_teacher_topk_from_rows_keeps_every_token_of_a_row_with_fewer_entries_than_tokens():
    from types import SimpleNamespace

    row = SimpleNamespace(  # 3 tokens, 2 entries each
        token_ids=torch.tensor([[1, 2], [3, 4], [5, 6]]), logprobs=torch.full((3, 2), -1.0), mask=torch.ones(3).bool()
    )
    packed = TeacherTopK.from_rows({"a": [row]}, 5)
    assert packed.ids[0, 0, :3].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert packed.mask[0, 0].tolist() == [True, True, True, False, False]


@pytest.mark.parametrize("tau", [0.5, 2.0])
def test_taid_computes_its_value_at_every_temperature(tau):
    from composer_plugins.kernels.divergences import TAIDKernel

    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(3, 6, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g, dtype=torch.float64)
    k = TAIDKernel(t=0.3, temperature=tau)
    torch.testing.assert_close(k.compute(zs.clone(), zt.clone())[0], k.value(zs, zt))
