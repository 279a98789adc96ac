"""Distillation divergences: TRL's GKD JSD (called directly), TAID and entropy-aware OPD restatements,
and the chunked hidden-state paths against the materialised ones (values and gradients)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.gkd import GKDTrainer
from trl.trainer.utils import selective_log_softmax as trl_selective_log_softmax

from composer_plugins.kernels.divergences import EntropyOPDKernel, JSDKernel, TAIDKernel
from composer_plugins.losses import functional as LF

torch.set_num_threads(1)


def _mask(b, t, seed, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, t, generator=g) > 0.35
    if empty_row and b > 1:
        m[1] = False
    return m


# ------------------------------------------------------------------------------------------------
# generalized JSD vs TRL GKDTrainer.generalized_jsd_loss
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
@pytest.mark.parametrize("use_mask", [True, False])
def test_generalized_jsd_matches_trl_values_and_grads(beta, temperature, reduction, use_mask):
    b, t, v = 3, 5, 17
    s = (torch.randn(b, t, v) * 3).requires_grad_(True)
    te = torch.randn(b, t, v) * 3
    mask = _mask(b, t, seed=int(beta * 10) + t) if use_mask else None
    labels = torch.where(mask, 1, -100) if mask is not None else None
    want = GKDTrainer.generalized_jsd_loss(s, te, labels, beta=beta, temperature=temperature, reduction=reduction)
    got = LF.generalized_jsd(s, te, mask, beta=beta, temperature=temperature, reduction=reduction)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)
    (gw,) = torch.autograd.grad(want, s)
    (gg,) = torch.autograd.grad(got, s)
    torch.testing.assert_close(gg, gw, rtol=2e-5, atol=1e-7)


def test_generalized_jsd_all_masked_and_token_reduction():
    s = torch.randn(2, 3, 7, requires_grad=True)
    te = torch.randn(2, 3, 7)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    labels = torch.full((2, 3), -100)
    got = LF.generalized_jsd(s, te, empty)
    want = GKDTrainer.generalized_jsd_loss(s, te, labels)
    assert float(got.detach()) == float(want.detach()) == 0.0
    got.backward()  # valid grad path, all zeros
    assert s.grad is not None and s.grad.abs().max() == 0
    # token reduction: per-token divergences, zero off-mask; sums back to "sum"
    m = _mask(2, 3, seed=1, empty_row=False)
    per_tok = LF.generalized_jsd(s, te, m, beta=0.3, reduction="token")
    assert per_tok.shape == (2, 3) and (per_tok[~m] == 0).all()
    torch.testing.assert_close(per_tok.sum(), LF.generalized_jsd(s, te, m, beta=0.3, reduction="sum"))


def test_generalized_jsd_extremes_are_finite_and_symmetric_limits():
    s = torch.randn(4, 9) * 30  # very peaked distributions
    te = torch.randn(4, 9) * 30
    for beta in (0.0, 0.5, 1.0):
        v = LF.generalized_jsd(s, te, beta=beta)
        assert torch.isfinite(v)
    # beta=0 forward KL(teacher||student); beta=1 reverse KL(student||teacher)
    ls, lt = s.log_softmax(-1), te.log_softmax(-1)
    torch.testing.assert_close(LF.generalized_jsd(s, te, beta=0.0), (lt.exp() * (lt - ls)).sum() / 4)
    torch.testing.assert_close(LF.generalized_jsd(s, te, beta=1.0), (ls.exp() * (ls - lt)).sum() / 4)
    # identical distributions -> 0
    assert float(LF.generalized_jsd(s, s.clone(), beta=0.5)) == pytest.approx(0.0, abs=1e-5)


# ------------------------------------------------------------------------------------------------
# chunked paths == materialised paths (values and gradients)
# ------------------------------------------------------------------------------------------------
def _hidden_case(b, t, h, v, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(b, t, h, generator=g, dtype=dtype).requires_grad_(True)
    ht = torch.randn(b, t, h, generator=g, dtype=dtype)
    w = (torch.randn(v, h, generator=g, dtype=dtype) * 0.7).requires_grad_(True)
    return hs, ht, w


KERNELS = [
    ("jsd", {"beta": 0.0, "temperature": 1.0}),
    ("jsd", {"beta": 0.5, "temperature": 1.3}),
    ("jsd", {"beta": 1.0, "temperature": 0.8}),
    ("taid", {"t": 0.4}),
    ("taid", {"t": 1.0}),
    ("entropy_opd", {"entropy_threshold": 1.5, "fkl_weight": 1.0, "top_k": None, "temperature": 1.0}),
    ("entropy_opd", {"entropy_threshold": 0.5, "fkl_weight": 0.5, "top_k": 3, "temperature": 1.2}),
]


def _materialised(name, params, zs, zt, mask):
    if name == "jsd":
        return LF.generalized_jsd(zs, zt, mask, **params)
    if name == "taid":
        return LF.taid_loss(zs, zt, mask, params["t"])
    return LF.entropy_aware_opd(zs, zt, mask, **params)


def _chunked(name, params, hs, ht, w, mask, chunk, grad_mode="recompute"):
    kw = {"chunk_size": chunk, "grad_mode": grad_mode}
    if name == "jsd":
        return LF.chunked_generalized_jsd(hs, ht, w, mask, **kw, **params)
    if name == "taid":
        return LF.chunked_taid_loss(hs, ht, w, mask, params["t"], **kw)
    return LF.chunked_entropy_aware_opd(hs, ht, w, mask, **kw, **params)


@pytest.mark.parametrize("name,params", KERNELS)
@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("grad_mode", ["recompute", "precompute"])
def test_chunked_distill_equals_materialised(name, params, chunk, grad_mode):
    b, t, h, v = 3, 7, 6, 29
    hs, ht, w = _hidden_case(b, t, h, v, seed=chunk)
    mask = _mask(b, t, seed=chunk + 5)
    ref = _materialised(name, params, hs @ w.T, (ht @ w.T).detach(), mask)
    got = _chunked(name, params, hs, ht, w, mask, chunk, grad_mode)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    g_ref = torch.autograd.grad(ref, [hs, w])
    g_got = torch.autograd.grad(got, [hs, w])
    for a, c in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)
    # rows outside the mask get exactly zero gradient
    assert g_got[0][~mask].abs().max() == 0


@pytest.mark.parametrize("name,params", [k for k in KERNELS if k[0] != "taid"])
def test_chunked_distill_gradcheck_float64(name, params):
    """Finite differences (TAID excluded: its target stops the gradient through the student by design)."""
    hs, ht, w = _hidden_case(2, 3, 4, 7, seed=3, dtype=torch.float64)
    wt = torch.randn(7, 4, dtype=torch.float64)  # separate teacher head, so perturbing w leaves the teacher fixed
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)

    def fn(h, weight):
        return LF.chunked_distill(h, ht, weight, _kernel(name, params), mask, teacher_lm_head_weight=wt, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (hs, w))


def _kernel(name, params):
    return {"jsd": JSDKernel, "taid": TAIDKernel, "entropy_opd": EntropyOPDKernel}[name](**params)


@pytest.mark.parametrize("name,params", KERNELS)
def test_analytic_kernel_gradients_equal_autograd(name, params):
    zs = torch.randn(6, 11, dtype=torch.float64) * 2
    zt = torch.randn(6, 11, dtype=torch.float64) * 2
    go = torch.randn(6, dtype=torch.float64)
    k = _kernel(name, params)
    z = zs.clone().requires_grad_(True)
    val = k.value(z, zt)
    (g_auto,) = torch.autograd.grad(val, z, go)
    v2, g_ana = k.value_and_grad(zs, zt, go)
    torch.testing.assert_close(v2, val.detach())
    torch.testing.assert_close(g_ana, g_auto)


def test_lean_kernel_compute_matches_reference_values_stats_and_inf_handling():
    zs = torch.randn(5, 13, dtype=torch.float64) * 2
    zt = torch.randn(5, 13, dtype=torch.float64) * 2
    for name, params in KERNELS:
        k = _kernel(name, params)
        val, g, st = k.compute(zs.clone(), zt.clone(), None, with_stats=True)
        assert g is None
        torch.testing.assert_close(val, k.value(zs, zt))
        torch.testing.assert_close(st, k.stats(zs, zt))
    # TAID drops the terms at -inf student logits, like upstream; gradients still match autograd
    zs_inf = zs.clone()
    zs_inf[0, :4] = -math.inf
    k = TAIDKernel(t=0.5)
    z = zs_inf.clone().requires_grad_(True)
    ref = k.value(z, zt)
    go = torch.rand(5, dtype=torch.float64)
    (g_ref,) = torch.autograd.grad(ref, z, go)
    val, g = k.value_and_grad(zs_inf, zt, go)
    torch.testing.assert_close(val, ref.detach())
    torch.testing.assert_close(g, g_ref)


def test_chunked_reductions_and_no_mask_and_teacher_head():
    hs, ht, w = _hidden_case(2, 4, 5, 13, seed=11)
    wt = torch.randn(13, 5)
    zs, zt = hs @ w.T, (ht @ wt.T)
    for red in ("batchmean", "sum", "mean", "token"):
        ref = LF.generalized_jsd(zs, zt, None, beta=0.3, reduction=red)
        got = LF.chunked_generalized_jsd(
            hs, ht, w, None, beta=0.3, reduction=red, chunk_size=3, teacher_lm_head_weight=wt
        )
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # an all-empty mask gives 0 with a gradient path
    out = LF.chunked_generalized_jsd(hs, ht, w, torch.zeros(2, 4, dtype=torch.bool))
    out.backward()
    assert float(out.detach()) == 0.0 and hs.grad is not None and hs.grad.abs().max() == 0


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_precompute_mode_scales_with_upstream_gradient_and_skips_work_without_grad(reduction):
    hs, ht, w = _hidden_case(2, 5, 4, 11, seed=12)
    mask = _mask(2, 5, seed=2)
    kw = {"beta": 0.2, "reduction": reduction, "chunk_size": 2}
    a = LF.chunked_generalized_jsd(hs, ht, w, mask, grad_mode="precompute", **kw)
    b = LF.chunked_generalized_jsd(hs, ht, w, mask, grad_mode="recompute", **kw)
    torch.testing.assert_close(a, b)
    # the loss is used inside a larger expression: gradients still equal (grad_output is applied in backward)
    ga = torch.autograd.grad(3.5 * a + a**2, [hs, w])
    gb = torch.autograd.grad(3.5 * b + b**2, [hs, w])
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        c = LF.chunked_generalized_jsd(hs, ht, w, mask, grad_mode="precompute", **kw)
    torch.testing.assert_close(c, b.detach())
    with pytest.raises(ValueError, match="scalar reduction"):
        LF.chunked_generalized_jsd(hs, ht, w, mask, grad_mode="precompute", reduction="token")
    d = LF.chunked_generalized_jsd(hs, ht, w, mask, grad_mode="precompute", **kw)
    d.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        d.backward()


def test_chunked_shape_errors():
    hs, ht, w = _hidden_case(2, 4, 5, 13, seed=1)
    with pytest.raises(ValueError, match="teacher_hidden shape"):
        LF.chunked_generalized_jsd(hs, ht[:, :3], w)
    with pytest.raises(ValueError, match="hidden size"):
        LF.chunked_generalized_jsd(hs, ht, w[:, :4])
    with pytest.raises(ValueError, match="mask shape"):
        LF.chunked_generalized_jsd(hs, ht, w, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="ids shape"):
        LF.chunked_logprobs(hs, w, torch.zeros(2, 3, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# log-probs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_logprobs_equal_trl_selective_log_softmax(temperature, chunk):
    hs, _, w = _hidden_case(3, 6, 5, 31, seed=chunk)
    ids = torch.randint(0, 31, (3, 6))
    logits = hs @ w.T
    trl = trl_selective_log_softmax(logits, ids, temperature=temperature)
    ours = LF.selective_log_softmax(logits, ids, temperature=temperature)
    got, ent = LF.chunked_logprobs(hs, w, ids, chunk_size=chunk, temperature=temperature, return_entropy=True)
    torch.testing.assert_close(ours, trl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, trl, rtol=1e-5, atol=1e-6)
    p = (logits / temperature).softmax(-1)
    torch.testing.assert_close(ent, -(p * p.clamp_min(1e-30).log()).sum(-1), rtol=1e-4, atol=1e-5)
    weights = torch.randn(3, 6)
    g_ref = torch.autograd.grad((trl * weights).sum(), [hs, w])
    g_got = torch.autograd.grad((got * weights).sum(), [hs, w])
    for a, c in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)


def test_chunked_logprobs_mask_and_gradcheck():
    hs, _, w = _hidden_case(2, 3, 4, 7, seed=2, dtype=torch.float64)
    ids = torch.randint(0, 7, (2, 3))
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    out = LF.chunked_logprobs(hs, w, ids, mask=mask, chunk_size=2)
    assert (out[~mask] == 0).all()
    torch.testing.assert_close(out[mask], LF.selective_log_softmax(hs @ w.T, ids)[mask])
    assert torch.autograd.gradcheck(
        lambda h, ww: LF.chunked_logprobs(h, ww, ids, mask=mask, chunk_size=2, temperature=0.8), (hs, w)
    )


# ------------------------------------------------------------------------------------------------
# TAID
# ------------------------------------------------------------------------------------------------
def upstream_taid_compute_loss(logits, teacher_logits, mask, t):
    """SakanaAI/TAID TAID.compute_loss + forward_kl, restated."""
    p_t = (1 - t) * logits.detach() + t * teacher_logits
    p_t = F.softmax(p_t, dim=-1, dtype=torch.float32)
    student_logprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    inf_mask = torch.isinf(logits)
    prod = torch.masked_fill(p_t * student_logprobs, inf_mask, 0)
    x = torch.sum(prod, dim=-1).view(-1)
    return -torch.sum(x * mask.view(-1), dim=0) / torch.sum(mask.view(-1), dim=0)


@pytest.mark.parametrize("t", [0.0, 0.4, 0.77, 1.0])
def test_taid_loss_matches_upstream(t):
    s = torch.randn(3, 5, 19, requires_grad=True)
    te = torch.randn(3, 5, 19)
    s_inf = s.detach().clone()
    s_inf[0, 0, :3] = -math.inf  # masked vocabulary entries, as upstream handles them
    mask = _mask(3, 5, seed=4).float()
    # (at t=1 upstream computes 0·(-inf) = NaN in the target for -inf logits; we match it, so skip that case)
    for student in (s, s_inf.requires_grad_(True)) if t < 1.0 else (s,):
        want = upstream_taid_compute_loss(student, te, mask, torch.tensor(t))
        got = LF.taid_loss(student, te, mask, t)
        torch.testing.assert_close(got, want)
        (gw,) = torch.autograd.grad(want, student)
        (gg,) = torch.autograd.grad(got, student)
        torch.testing.assert_close(gg, gw)
    assert float(LF.taid_loss(s, te, torch.zeros(3, 5), t).detach()) == 0.0  # upstream would give NaN


class UpstreamTAIDSchedule:
    """SakanaAI/TAID TAID.update_t, restated on CPU."""

    def __init__(self, t_start=0.4, t_end=1.0, alpha=5e-4, beta=0.99, disable_adaptive=False):
        self.t_start, self.t_end, self.alpha, self.beta, self.disable_adaptive = (
            t_start,
            t_end,
            alpha,
            beta,
            (disable_adaptive),
        )
        self.t = torch.tensor(t_start, dtype=torch.float32)
        self.prev_loss = torch.tensor(float("inf"), dtype=torch.float32)
        self.momentum = torch.zeros([], dtype=torch.float32)

    def update_t(self, loss, global_step, num_train_steps):
        if torch.isinf(self.prev_loss):
            self.prev_loss = loss
            return None
        relative_change = (self.prev_loss - loss) / (self.prev_loss + 1e-15)
        self.momentum = self.beta * self.momentum + (1 - self.beta) * relative_change
        adaptive_delta = torch.sigmoid(self.momentum)
        progress = global_step / num_train_steps
        t_target = self.t_start + (self.t_end - self.t_start) * progress
        delta_t = self.alpha * adaptive_delta * (1 - self.t)
        t = min(self.t_end, max(t_target, self.t + delta_t)) if not self.disable_adaptive else t_target
        if not isinstance(t, torch.Tensor):
            t = torch.tensor(t, dtype=self.t.dtype)
        self.t = t
        self.prev_loss = loss
        return delta_t


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("alpha", [5e-4, 0.2])
def test_taid_scheduler_matches_upstream_and_resumes_exactly(adaptive, alpha):
    total = 40
    losses = [torch.tensor(3.0 * math.exp(-i / 10) + 0.1 * math.sin(i), dtype=torch.float32) for i in range(total)]
    up = UpstreamTAIDSchedule(alpha=alpha, disable_adaptive=not adaptive)
    ours = LF.TAIDScheduler(alpha=alpha, adaptive=adaptive, total_steps=total)
    for step, loss in enumerate(losses):
        up.update_t(loss, step, total)
        ours.step(loss, global_step=step)
        assert float(ours.t) == pytest.approx(float(up.t), abs=1e-7), step
        assert float(ours.momentum) == pytest.approx(float(up.momentum), abs=1e-7)
    assert 0.4 <= ours.value <= 1.0
    # exact resume: run 15 steps, save, restore into a fresh scheduler, continue (internal step counter)
    a = LF.TAIDScheduler(alpha=alpha, adaptive=adaptive, total_steps=total)
    for loss in losses[:15]:
        a.step(loss)
    state = {k: v.clone() for k, v in a.state_dict().items()}
    b = LF.TAIDScheduler(alpha=alpha, adaptive=adaptive, total_steps=total)
    b.load_state_dict(state)
    for loss in losses[15:]:
        a.step(loss)
        b.step(loss)
        assert torch.equal(a.t, b.t) and torch.equal(a.momentum, b.momentum)
    assert int(b.num_steps) == total


def test_taid_scheduler_validation_and_nonfinite_fallback():
    with pytest.raises(ValueError, match="t_start"):
        LF.TAIDScheduler(t_start=1.0)
    s = LF.TAIDScheduler(total_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        LF.TAIDScheduler().step(1.0)
    s.step(2.0)
    s.step(float("nan"), global_step=5)  # deterministic fallback: t = max(t, target) = 0.7
    assert s.value == pytest.approx(0.7)
    assert torch.isfinite(s.momentum) and float(s.prev_loss) == 2.0
    s.step(1.5, global_step=6)
    assert math.isfinite(s.value) and s.value >= 0.76 - 1e-6


# ------------------------------------------------------------------------------------------------
# entropy-aware OPD
# ------------------------------------------------------------------------------------------------
def restated_entropy_opd(s, te, mask, tau_h, alpha, top_k, temperature):
    ls = F.log_softmax(s / temperature, -1)
    lt = F.log_softmax(te / temperature, -1)
    ent = -(lt.exp() * lt).sum(-1)
    rkl = F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)  # KL(student || teacher)
    if top_k is None:
        fkl = F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
    else:
        vals, idx = lt.topk(top_k, -1)
        q = vals.softmax(-1)
        fkl = (q * (q.log() - ls.gather(-1, idx))).sum(-1)
    per = rkl + alpha * (ent > tau_h).float() * fkl
    return per[mask].sum() / mask.sum().clamp(min=1)


@pytest.mark.parametrize("top_k", [None, 1, 4])
@pytest.mark.parametrize("tau_h", [0.0, 1.5, 100.0])
def test_entropy_aware_opd_matches_restatement(top_k, tau_h):
    s = torch.randn(3, 6, 21, requires_grad=True)
    te = torch.randn(3, 6, 21) * torch.linspace(0.1, 4, 6).view(1, 6, 1)  # mix of flat and peaked teachers
    mask = _mask(3, 6, seed=9)
    want = restated_entropy_opd(s, te, mask, tau_h, 0.7, top_k, 1.1)
    got = LF.entropy_aware_opd(s, te, mask, entropy_threshold=tau_h, fkl_weight=0.7, top_k=top_k, temperature=1.1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(got, s)[0], torch.autograd.grad(want, s)[0], rtol=1e-5, atol=1e-7)
    if tau_h == 100.0:  # no token is high-entropy: plain reverse-KL OPD == JSD(beta=1)
        torch.testing.assert_close(got, LF.generalized_jsd(s, te, mask, beta=1.0, temperature=1.1))


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_liger_fused_jsd_matches_the_chunked_kernel(beta, temperature):
    """kernels='liger' (Liger-Kernel's fused linear JSD, eager on CPU) = the project's chunked jsd: loss and grads.

    In float64, so the comparison is of the formulas, not of fp32 summation order.
    """
    from composer_plugins.losses.distill import HintDistillChannel

    g = torch.Generator().manual_seed(0)
    V, H, B, T = 3001, 16, 3, 9
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_(True)
    s_hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).requires_grad_(True)
    t_hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    out = {}
    for kernels in ("torch", "liger"):
        ch = HintDistillChannel(criterion="jsd", beta=beta, temperature=temperature, kernels=kernels)
        weight.grad = s_hidden.grad = None
        loss, metrics = ch(
            {"student_hidden": s_hidden, "teacher_hidden": t_hidden, "lm_head_weight": weight, "hint_mask": mask}
        )
        loss.backward()
        assert metrics.get("liger", 0.0) == (1.0 if kernels == "liger" else 0.0)
        out[kernels] = (loss.detach(), weight.grad.clone(), s_hidden.grad.clone())
    # Liger accumulates the loss in a float32 scalar; its gradients stay in float64
    torch.testing.assert_close(out["liger"][0].double(), out["torch"][0], rtol=1e-6, atol=1e-7)
    for a, b in zip(out["liger"][1:], out["torch"][1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_liger_kernels_reject_other_criteria_and_auto_stays_on_cpu():
    from composer_plugins.losses.distill import HintDistillChannel

    with pytest.raises(ValueError, match="jsd criterion only"):
        HintDistillChannel(criterion="taid", kernels="liger")
    with pytest.raises(ValueError, match="valid: auto, torch, liger"):
        HintDistillChannel(kernels="triton")
    ch = HintDistillChannel(criterion="jsd")  # auto: Liger only for CUDA tensors
    assert not ch._use_liger(torch.zeros(2, 3))
