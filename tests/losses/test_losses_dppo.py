"""PRIME-RL's DPPO+KL loss against a per-sample restatement of upstream ``default_loss_fn``.

prime-rl is not on PyPI; the reference below restates ``default_loss_fn`` of
``src/prime_rl/trainer/rl/loss.py`` (PrimeIntellect-ai/prime-rl @ 559b44772e471d1538537b8805cc77f3824a5e64)
exactly as upstream runs it: one 1-D sequence at a time, per-sample sum, metrics per sample.
"""

from __future__ import annotations

import pytest
import torch

from composer_plugins.losses import functional as LF

torch.set_num_threads(1)


def upstream_default_loss_fn(trainer_lp, inference_lp, advantages, loss_mask, low, high, adv_tau, kl_tau, weights):
    """One sample, as upstream (1-D tensors, per-token advantages)."""
    log_r = trainer_lp - inference_lp
    r = torch.exp(log_r)
    mismatch_kl = r - log_r - 1
    probs_diff = torch.exp(trainer_lp) - torch.exp(inference_lp)
    inv_high = probs_diff > high
    inv_low = probs_diff < -low
    pos = advantages > 0
    neg = advantages < 0
    is_masked = torch.where(pos, inv_high, inv_low)
    is_masked_high = pos & inv_high
    is_masked_low = neg & inv_low
    drop = loss_mask & is_masked
    keep = loss_mask & ~is_masked
    a = adv_tau * advantages
    per_token = -(keep * a * r) + kl_tau * (loss_mask * log_r**2)
    if weights is not None:
        per_token = per_token * weights

    def safe_mean(v, m):
        return v[m].sum() / torch.clamp_min(m.sum(), 1)

    metrics = {
        "masked_mismatch_kl": safe_mean(mismatch_kl, loss_mask & is_masked),
        "unmasked_mismatch_kl": safe_mean(mismatch_kl, keep),
        "is_masked": safe_mean(is_masked, loss_mask),
        "is_masked_low": safe_mean(is_masked_low, loss_mask),
        "is_masked_high": safe_mean(is_masked_high, loss_mask),
        "masked_advantage_positive": safe_mean(pos, drop),
        "masked_advantage_negative": safe_mean(neg, drop),
    }
    return per_token.sum(), metrics


def _case(b, t, adv_kind, seed):
    g = torch.Generator().manual_seed(seed)
    trainer = (-torch.rand(b, t, generator=g) * 2).requires_grad_(True)
    # large drifts so that both trust-region sides trigger
    inference = (trainer.detach() + torch.randn(b, t, generator=g) * 0.8).clamp(max=0.0)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[-1] = False  # an empty sample
    if adv_kind == "zero":
        adv = torch.zeros(b)
    elif adv_kind == "extreme":
        adv = torch.tensor([1e4, -1e4, 0.0, 1e-9, -3e3][:b])
    else:
        adv = torch.randn(b, generator=g)
    return trainer, inference, mask, adv


@pytest.mark.parametrize("adv_kind", ["random", "zero", "extreme"])
@pytest.mark.parametrize("params", [(0.2, 0.2, 1.0, 1e-3), (0.05, 0.3, 0.5, 0.1), (0.0, 0.0, 0.0, 1.0)])
@pytest.mark.parametrize("with_weights", [False, True])
def test_dppo_matches_upstream_per_sample_sum(adv_kind, params, with_weights):
    low, high, adv_tau, kl_tau = params
    b, t = 5, 11
    trainer, inference, mask, adv = _case(b, t, adv_kind, seed=len(adv_kind) * 31 + int(high * 100))
    weights = torch.rand(b, t, generator=torch.Generator().manual_seed(b * t)) if with_weights else None
    got = LF.dppo_kl_loss(trainer, inference, adv, mask, low, high, adv_tau, kl_tau, loss_weights=weights)

    total = trainer.sum() * 0.0
    per_sample_metrics = []
    for i in range(b):
        loss_i, m_i = upstream_default_loss_fn(
            trainer[i],
            inference[i],
            adv[i].expand(t),
            mask[i],
            low,
            high,
            adv_tau,
            kl_tau,
            None if weights is None else weights[i],
        )
        total = total + loss_i
        per_sample_metrics.append(m_i)
    torch.testing.assert_close(got.loss, total, rtol=1e-6, atol=1e-5)
    (g_got,) = torch.autograd.grad(got.loss, trainer)
    (g_want,) = torch.autograd.grad(total, trainer)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-6)
    # our metrics are token means over the whole batch; check them against the pooled definition
    log_r = (trainer - inference).detach()
    pd = trainer.detach().exp() - inference.exp()
    pos = adv.unsqueeze(1).expand(b, t) > 0
    is_masked = torch.where(pos, pd > high, pd < -low)
    pooled = (is_masked & mask).sum() / mask.sum().clamp(min=1)
    assert float(got.metrics["is_masked"]) == pytest.approx(float(pooled), abs=1e-6)
    mis = log_r.exp() - log_r - 1
    keep = mask & ~is_masked
    assert float(got.metrics["unmasked_mismatch_kl"]) == pytest.approx(
        float(mis[keep].sum() / keep.sum().clamp(min=1)), rel=1e-5, abs=1e-6
    )
    # with a single sample, pooled == upstream per-sample metrics exactly
    one = LF.dppo_kl_loss(trainer[:1], inference[:1], adv[:1], mask[:1], low, high, adv_tau, kl_tau)
    for k, v in per_sample_metrics[0].items():
        assert float(one.metrics[k]) == pytest.approx(float(v.detach()), rel=1e-5, abs=1e-6), k


def test_dppo_mask_is_conditioned_on_advantage_sign():
    # probability rose by 0.5 (> high) on token 0, fell by 0.5 (< -low) on token 1
    trainer = torch.log(torch.tensor([[0.9, 0.1]]))
    inference = torch.log(torch.tensor([[0.4, 0.6]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    pos = LF.dppo_kl_loss(trainer, inference, torch.tensor([1.0]), mask)
    neg = LF.dppo_kl_loss(trainer, inference, torch.tensor([-1.0]), mask)
    # positive advantage masks only the up-moved token; negative only the down-moved one
    assert float(pos.metrics["is_masked_high"]) == 0.5 and float(pos.metrics["is_masked_low"]) == 0.0
    assert float(neg.metrics["is_masked_low"]) == 0.5 and float(neg.metrics["is_masked_high"]) == 0.0
    # loss: only the kept token contributes the PG term
    r = (trainer - inference).exp()
    kl = ((trainer - inference) ** 2).sum() * 1e-3
    torch.testing.assert_close(pos.loss, -r[0, 1] + kl)
    torch.testing.assert_close(neg.loss, r[0, 0] + kl)


def test_dppo_per_token_advantages_and_1d_inputs():
    t = 9
    trainer = -torch.rand(t)
    inference = trainer + 0.3 * torch.randn(t)
    adv = torch.randn(t)
    mask = torch.rand(t) > 0.2
    got = LF.dppo_kl_loss(trainer, inference, adv, mask)
    want, _ = upstream_default_loss_fn(trainer, inference, adv, mask, 0.2, 0.2, 1.0, 1e-3, None)
    torch.testing.assert_close(got.loss, want)
    with pytest.raises(ValueError, match="advantages shape"):
        LF.dppo_kl_loss(trainer, inference, torch.zeros(3), mask)
