"""Top-k distillation with a tail bucket and the distillation IS clip (SDPO, Hübotter et al. 2026).

* against a restatement of SDPO's ``compute_self_distillation_loss`` (lasgroup/SDPO,
  ``verl/trainer/ppo/core_algos.py``: top-k log-probs from the student's logits, the teacher gathered
  at the student's indices, ``add_tail``, ``F.kl_div`` α-interpolation, ``is_clip``, token mean);
* equal to the full-vocabulary loss when ``K = V``, for every criterion;
* the chunked hidden-state path equal to the materialised-logits path, values and gradients;
* the closed-form gradient of the top-k kernel equal to autograd of its plain form.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from composer_plugins.kernels.divergences import TopKTailKernel, make_kernel, with_topk
from composer_plugins.losses.distill import HintDistillChannel

torch.set_num_threads(1)

B, T, V, H = 3, 5, 31, 6
CRITERIA = [
    ("jsd", {"beta": 0.0}),
    ("jsd", {"beta": 0.5}),
    ("jsd", {"beta": 1.0}),
    ("jsd", {"beta": 0.3, "temperature": 0.7}),
    ("taid", {"t_start": 0.4, "auto_step": False}),
    ("entropy_opd", {"entropy_threshold": 1.5}),
    ("entropy_opd", {"entropy_threshold": 1.5, "fkl_topk": 4, "temperature": 1.3}),
]


# ------------------------------------------------------------------------------------------------
# SDPO's formula, restated in plain torch from logits as its actor and loss do it
# ------------------------------------------------------------------------------------------------
def sdpo_self_distillation_loss(
    student_logits,
    teacher_logits,
    responses,
    response_mask,
    *,
    alpha,
    topk,
    temperature=1.0,
    is_clip=None,
    old_log_probs=None,
):
    """SDPO's top-k + tail α-KL distillation loss (``full_logit_distillation``, ``distillation_add_tail``).

    Actor (``_forward_micro_batch``): logits divided by the temperature; the student's
    ``torch.topk(logits, k)``; top-k log-probs ``topk_logits - logsumexp(logits)``; the teacher's
    logits gathered at the student's indices, same normalisation. Loss: a tail bucket
    ``log(-expm1(clamp(logsumexp(top-k), max=-1e-7)))`` on each side; ``alpha == 0``:
    ``kl_div(student, teacher)``, ``alpha == 1``: ``kl_div(teacher, student)``, else
    ``lerp(KL(s‖m), KL(t‖m), alpha)`` with ``m = log((1-alpha) s + alpha t)``; summed over the
    buckets; times ``min(exp(clamp(lp - lp_old, ±20)), is_clip)`` (detached) when ``is_clip``;
    token mean over the mask.
    """
    s_logits = student_logits / temperature
    t_logits = teacher_logits / temperature
    log_probs = torch.log_softmax(s_logits, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    top_s, idx = torch.topk(s_logits, topk, dim=-1)
    s_top = top_s - torch.logsumexp(s_logits, -1, keepdim=True)
    t_top = torch.gather(t_logits, -1, idx) - torch.logsumexp(t_logits, -1, keepdim=True)

    def add_tail(lp):
        log_s = torch.clamp(torch.logsumexp(lp, -1, keepdim=True), max=-1e-7)
        return torch.cat([lp, torch.log(-torch.expm1(log_s))], -1)

    s, t = add_tail(s_top), add_tail(t_top)
    if alpha == 0.0:
        kl = F.kl_div(s, t, reduction="none", log_target=True)
    elif alpha == 1.0:
        kl = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        a = torch.tensor(alpha, dtype=s.dtype)
        m = torch.logsumexp(torch.stack([s + torch.log(1 - a), t + torch.log(a)]), dim=0)
        kl = torch.lerp(
            F.kl_div(m, s, reduction="none", log_target=True), F.kl_div(m, t, reduction="none", log_target=True), a
        )
    per_token = kl.sum(-1)
    if is_clip is not None:
        neg_kl = torch.clamp((log_probs - old_log_probs).detach(), min=-20.0, max=20.0)
        per_token = per_token * torch.exp(neg_kl).clamp(max=is_clip)
    mask = response_mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _tensors(seed=0, dtype=torch.float64, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, T, H, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    th = (torch.randn(B, T, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    ids = torch.randint(V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    old_noise = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8
    return h, th, w, ids, mask, old_noise


def _channel(criterion, params, **kw):
    return HintDistillChannel(criterion=criterion, kernels="torch", **params, **kw)


def _run(ch, h, th, w, mask, path, batch_extra=None, outputs_extra=None):
    """The channel's loss on the hidden-state (chunked) or logits (materialised) path."""
    outputs = dict(outputs_extra or {})
    if path == "hidden":
        outputs.update(student_hidden=h, teacher_hidden=th, lm_head_weight=w)
    else:
        outputs.update(student_logits=h @ w.T, teacher_logits=(th @ w.T).detach())
    batch = {"hint_mask": mask.float(), **(batch_extra or {})}
    return ch({**batch, **outputs})


def _grads(loss, h, w):
    return torch.autograd.grad(loss, (h, w))


# ------------------------------------------------------------------------------------------------
# SDPO parity
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 0.25])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("is_clip", [None, 1.3])
def test_topk_tail_matches_sdpo_formula_loss_and_grads(alpha, temperature, path, is_clip):
    k = 7
    h, th, w, ids, mask, old_noise = _tensors(seed=1)
    logits = h @ w.T
    logp = torch.log_softmax(logits / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = (logp.detach() + old_noise) if is_clip is not None else None
    ref = sdpo_self_distillation_loss(
        logits,
        (th @ w.T).detach(),
        ids,
        mask,
        alpha=alpha,
        topk=k,
        temperature=temperature,
        is_clip=is_clip,
        old_log_probs=old,
    )
    ref_g = _grads(ref, h, w)

    ch = _channel("jsd", {"beta": alpha, "temperature": temperature}, topk=k, is_clip=is_clip, chunk_size=4)
    extra = {} if is_clip is None else {"old_logprobs": old}
    out_extra = {} if is_clip is None else {"logprobs": logp}
    loss, metrics = _run(ch, h, th, w, mask, path, extra, out_extra)
    got_g = _grads(loss, h, w)
    torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-11)
    for a, b in zip(got_g, ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)
    assert metrics["chunked"] == (1.0 if path == "hidden" else 0.0)
    if is_clip is not None:  # the noise pushes some ratios past the cap
        assert 0.0 < float(metrics["is_clipped"]) < 1.0
        assert float(metrics["is_weight"]) <= is_clip


def test_sdpo_restatement_is_the_generalised_jsd_on_the_buckets():
    """α in SDPO and β here are the same parameter: α=0 forward KL(t‖s), α=1 reverse KL(s‖t)."""
    h, th, w, ids, mask, _ = _tensors(seed=2, scale=0.4)  # no probability below SDPO's 1e-7 tail floor
    s, t = h.detach() @ w.detach().T, th @ w.detach().T
    assert min(float(torch.log_softmax(s, -1).min()), float(torch.log_softmax(t, -1).min())) > -16
    for alpha in (0.0, 1.0):
        got = sdpo_self_distillation_loss(s, t, ids, mask, alpha=alpha, topk=V - 1)
        ks, kt = torch.log_softmax(s[mask], -1), torch.log_softmax(t[mask], -1)
        # with K = V - 1 the tail is the one token left out: the bucket distributions are the full ones
        full = (kt.exp() * (kt - ks)).sum(-1) if alpha == 0.0 else (ks.exp() * (ks - kt)).sum(-1)
        torch.testing.assert_close(got, full.mean(), rtol=1e-8, atol=1e-10)


# ------------------------------------------------------------------------------------------------
# K = V equals the full-vocabulary loss
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("criterion,params", CRITERIA)
@pytest.mark.parametrize("path", ["hidden", "logits"])
@pytest.mark.parametrize("k", [V, V + 5])
def test_topk_equal_to_vocab_is_the_full_vocabulary_loss(criterion, params, path, k):
    h, th, w, _, mask, _ = _tensors(seed=3)
    full, _ = _run(_channel(criterion, params, chunk_size=4), h, th, w, mask, path)
    g_full = _grads(full, h, w)
    top, _ = _run(_channel(criterion, params, chunk_size=4, topk=k), h, th, w, mask, path)
    g_top = _grads(top, h, w)
    torch.testing.assert_close(top, full, rtol=1e-9, atol=1e-11)
    for a, b in zip(g_top, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("criterion,params", CRITERIA)
def test_topk_below_vocab_differs_from_full_but_tail_keeps_the_mass(criterion, params):
    h, th, w, _, mask, _ = _tensors(seed=4)
    full, _ = _run(_channel(criterion, params), h, th, w, mask, "hidden")
    top, _ = _run(_channel(criterion, params, topk=3), h, th, w, mask, "hidden")
    assert torch.isfinite(top) and not torch.allclose(top, full)
    ker = _channel(criterion, params, topk=3).kernel()
    assert isinstance(ker, TopKTailKernel) and ker.name == criterion
    bs, bt = ker._buckets(h.detach()[mask] @ w.detach().T, th[mask] @ w.detach().T)
    assert bs.shape[-1] == 4
    torch.testing.assert_close(bs.exp().sum(-1), torch.ones(bs.shape[0], dtype=bs.dtype))
    torch.testing.assert_close(bt.exp().sum(-1), torch.ones(bt.shape[0], dtype=bt.dtype))


# ------------------------------------------------------------------------------------------------
# chunked (hidden states) == materialised logits, top-k and IS weights included
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("criterion,params", CRITERIA)
@pytest.mark.parametrize("grad_mode", ["precompute", "recompute"])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunked_topk_equals_materialised_topk(criterion, params, grad_mode, chunk):
    h, th, w, ids, mask, noise = _tensors(seed=5)
    logp = torch.log_softmax(h @ w.T, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    kw = {"topk": 6, "is_clip": 1.5}
    extra, out_extra = {"old_logprobs": logp.detach() + noise}, {"logprobs": logp}
    ch = _channel(criterion, params, chunk_size=chunk, grad_mode=grad_mode, **kw)
    loss_c, m_c = _run(ch, h, th, w, mask, "hidden", extra, out_extra)
    g_c = _grads(loss_c, h, w)
    loss_m, m_m = _run(_channel(criterion, params, **kw), h, th, w, mask, "logits", extra, out_extra)
    g_m = _grads(loss_m, h, w)
    assert m_c["chunked"] == 1.0 and m_m["chunked"] == 0.0  # two paths, not one path twice
    torch.testing.assert_close(loss_c, loss_m, rtol=1e-9, atol=1e-11)
    for a, b in zip(g_c, g_m, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)
    for key in ("is_ratio", "is_weight", "is_clipped", *(("teacher_entropy",) if criterion == "entropy_opd" else ())):
        torch.testing.assert_close(torch.as_tensor(m_c[key]).double(), torch.as_tensor(m_m[key]).double())


def test_chunked_topk_float32_close_to_float64():
    h, th, w, _, mask, _ = _tensors(seed=6)
    ch = _channel("jsd", {"beta": 0.5}, topk=5, chunk_size=4)
    l64, _ = _run(ch, h, th, w, mask, "hidden")
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    l32, _ = _run(ch, h32, th.float(), w32, mask, "hidden")
    assert l32.dtype == torch.float32
    torch.testing.assert_close(l32.double(), l64.detach(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# kernel: closed-form gradient == autograd of the plain form, incl. a saturated tail
# ------------------------------------------------------------------------------------------------
KERNELS = [
    ("jsd", {"beta": 0.0}),
    ("jsd", {"beta": 0.5}),
    ("jsd", {"beta": 1.0}),
    ("taid", {"t": 0.4}),
    ("entropy_opd", {"entropy_threshold": 0.5}),
    ("entropy_opd", {"entropy_threshold": 0.5, "top_k": 2}),
]


@pytest.mark.parametrize(
    "criterion,params,temperature",
    [(c, p, 1.0) for c, p in KERNELS] + [(c, p, 1.7) for c, p in KERNELS if c != "taid"],  # taid has no temperature
)
def test_topk_kernel_closed_form_gradient_equals_autograd(criterion, params, temperature):
    g = torch.Generator().manual_seed(7)
    zs = torch.randn(6, V, generator=g, dtype=torch.float64) * 2
    zt = torch.randn(6, V, generator=g, dtype=torch.float64) * 2
    zs[0, 3] = 60.0  # the top-k holds all but ~e^-50 of the student's mass: the tail is floored
    zt[1, :] = -5.0
    zt[1, 0] = 40.0
    go = torch.rand(6, generator=g, dtype=torch.float64) + 0.5
    ker = with_topk(make_kernel(criterion, **params), 4, temperature)
    z = zs.clone().requires_grad_()
    v = ker.value(z, zt)
    (g_auto,) = torch.autograd.grad(v, z, go)
    zs0, zt0 = zs.clone(), zt.clone()
    v2, g2 = ker.value_and_grad(zs, zt, go)
    assert torch.equal(zs, zs0) and torch.equal(zt, zt0)  # value_and_grad leaves its inputs alone
    assert torch.isfinite(v2).all() and torch.isfinite(g2).all()
    torch.testing.assert_close(v2, v.detach(), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(g2, g_auto, rtol=1e-7, atol=1e-10)


def test_with_topk_is_identity_without_k_and_validates():
    base = make_kernel("jsd", beta=0.5)
    assert with_topk(base, None) is base
    with pytest.raises(ValueError, match="topk must be >= 1"):
        with_topk(base, 0)


# ------------------------------------------------------------------------------------------------
# IS clip
# ------------------------------------------------------------------------------------------------
def test_is_clip_on_policy_ratio_is_one_and_loss_unchanged():
    h, th, w, ids, mask, _ = _tensors(seed=8)
    logp = torch.log_softmax(h @ w.T, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    plain, _ = _run(_channel("jsd", {}, topk=5), h, th, w, mask, "hidden")
    for extra in ({"old_logprobs": logp.detach()}, {"inference_logprobs": logp.detach()}, {}):
        loss, m = _run(_channel("jsd", {}, topk=5, is_clip=2.0), h, th, w, mask, "hidden", extra, {"logprobs": logp})
        torch.testing.assert_close(loss, plain, rtol=0, atol=0)
        assert float(m["is_ratio"]) == 1.0 and float(m["is_weight"]) == 1.0 and float(m["is_clipped"]) == 0.0


def test_is_clip_weights_hinted_rows_by_the_clipped_detached_ratio():
    """``hint_rows`` picks the hinted rows out of the batch's log-probs; the sampler's log-probs win over old ones."""
    h, th, w, _, mask, _ = _tensors(seed=9)
    full_b = 5
    rows = torch.tensor([4, 0, 2])
    g = torch.Generator().manual_seed(10)
    lp_all = torch.randn(full_b, T, generator=g, dtype=torch.float64).requires_grad_()
    behaviour = lp_all.detach() + torch.randn(full_b, T, generator=g, dtype=torch.float64)
    ch = _channel("jsd", {"beta": 0.5}, is_clip=1.2, chunk_size=2)
    batch = {"hint_rows": rows, "inference_logprobs": behaviour, "old_logprobs": lp_all.detach() + 5}
    loss, m = _run(ch, h, th, w, mask, "hidden", batch, {"logprobs": lp_all})
    ratio = torch.exp(lp_all.detach()[rows] - behaviour[rows])
    wts = ratio.clamp(max=1.2)
    per = make_kernel("jsd", beta=0.5).value(h[mask] @ w.T, th[mask] @ w.detach().T)
    want = (per * wts[mask]).sum() / mask.sum()
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-11)
    assert torch.autograd.grad(loss, lp_all, allow_unused=True)[0] is None  # the ratio is detached
    torch.testing.assert_close(torch.as_tensor(m["is_ratio"]).double(), ratio[mask].mean())
    torch.testing.assert_close(torch.as_tensor(m["is_clipped"]).double(), (ratio[mask] > 1.2).double().mean())


def test_is_clip_and_topk_validation_and_missing_logprobs():
    with pytest.raises(ValueError, match="topk must be an integer >= 1"):
        HintDistillChannel(topk=0)
    with pytest.raises(ValueError, match="topk must be an integer >= 1"):
        HintDistillChannel(topk=2.5)
    with pytest.raises(ValueError, match="is_clip must be > 0"):
        HintDistillChannel(is_clip=0)
    h, th, w, _, mask, _ = _tensors(seed=11)
    with pytest.raises(ValueError, match="needs the current policy's per-token 'logprobs'"):
        _run(_channel("jsd", {}, is_clip=2.0), h, th, w, mask, "hidden")
    with pytest.raises(ValueError, match="must match hint_mask"):
        _run(_channel("jsd", {}, is_clip=2.0), h, th, w, mask, "hidden", {}, {"logprobs": torch.zeros(B, T + 1)})
    assert "topk=100, is_clip=2.0" in repr(HintDistillChannel(topk=100, is_clip=2))


def test_topk_and_is_clip_from_channel_specs():
    from composer_plugins.losses.base import ChannelComposer

    comp = ChannelComposer.from_specs([{"name": "hint_distill", "topk": 100, "is_clip": 2}])
    ch = comp["hint_distill"]
    assert isinstance(ch, HintDistillChannel) and ch.topk == 100 and ch.is_clip == 2.0
    assert isinstance(ch.kernel(), TopKTailKernel) and not ch._use_liger(torch.zeros(1))


def test_top_k_is_the_deprecated_name_of_fkl_topk():
    """One top-k name in the hint channel (``topk``); the entropy-OPD teacher top-k is ``fkl_topk``."""
    with pytest.warns(DeprecationWarning, match="top_k is deprecated, write fkl_topk"):
        old = HintDistillChannel(criterion="entropy_opd", top_k=3)
    new = HintDistillChannel(criterion="entropy_opd", fkl_topk=3)
    assert old.fkl_topk == new.fkl_topk == 3 and not hasattr(old, "top_k")
    assert old.kernel().__dict__ == new.kernel().__dict__
    with pytest.raises(ValueError, match="give fkl_topk only"):
        HintDistillChannel(top_k=3, fkl_topk=3)
