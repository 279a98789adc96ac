"""DPO (TRL 1.16 ``DPOTrainer`` loss branch) and SimPO (princeton-nlp/SimPO ``simpo_loss``) restatements.

TRL's DPO loss is computed inside ``DPOTrainer.compute_loss`` after a fused-LM-head model forward,
so it is not callable on its own; the reference below restates its ``reverse_kl`` branch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from composer_plugins.losses import functional as LF

torch.set_num_threads(1)


def trl_dpo(c, r, rc, rr, beta, loss_type, chosen_len=None, rejected_len=None, label_smoothing=0.0):
    chosen_lr, rejected_lr = c - rc, r - rr
    delta = chosen_lr - rejected_lr
    if loss_type == "sigmoid":
        if label_smoothing:  # original DPO repo's conservative DPO (TRL < 1.0 sigmoid)
            per = -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
        else:
            per = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        per = torch.relu(1 - beta * delta)
    else:
        ca = chosen_lr / (chosen_len.clamp(min=1.0) if chosen_len is not None else 1.0)
        ra = rejected_lr / (rejected_len.clamp(min=1.0) if rejected_len is not None else 1.0)
        per = (ca - ra - 1 / (2 * beta)) ** 2
    return per.mean(), beta * chosen_lr.detach(), beta * rejected_lr.detach()


def upstream_simpo(c, r, beta, gamma_beta_ratio, label_smoothing, loss_type):
    logits = (c - r) - gamma_beta_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    else:
        losses = torch.relu(1 - beta * logits)
    return losses.mean()


def _pairs(n, scale=20.0):
    c = (-torch.rand(n) * scale).requires_grad_(True)
    r = (-torch.rand(n) * scale).requires_grad_(True)
    return c, r, -torch.rand(n) * scale, -torch.rand(n) * scale


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("scale", [20.0, 1e4])
def test_dpo_matches_trl_restatement(loss_type, beta, label_smoothing, scale):
    c, r, rc, rr = _pairs(7, scale)
    lens = (torch.randint(0, 30, (7,)).float(), torch.randint(1, 30, (7,)).float())
    kw = {"chosen_lengths": lens[0], "rejected_lengths": lens[1]} if loss_type == "ipo" else {}
    want, wc, wr = trl_dpo(
        c,
        r,
        rc,
        rr,
        beta,
        loss_type,
        *(lens if loss_type == "ipo" else (None, None)),
        label_smoothing=label_smoothing if loss_type == "sigmoid" else 0.0,
    )
    got = LF.dpo_loss(
        c,
        r,
        rc,
        rr,
        beta,
        loss_type,  # type: ignore[arg-type]
        label_smoothing=label_smoothing if loss_type == "sigmoid" else 0.0,
        **kw,
    )
    torch.testing.assert_close(got.loss, want)
    assert torch.isfinite(got.loss)
    g_want = torch.autograd.grad(want, [c, r])
    g_got = torch.autograd.grad(got.loss, [c, r])
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b)
    assert float(got.metrics["rewards/chosen"]) == pytest.approx(float(wc.mean()))
    assert float(got.metrics["rewards/accuracies"]) == pytest.approx(float((wc > wr).float().mean()))
    assert float(got.metrics["rewards/margins"]) == pytest.approx(float((wc - wr).mean()), rel=1e-5)


def test_dpo_reference_cancels_and_hand_value():
    c = torch.tensor([-1.0])
    out = LF.dpo_loss(c, c - 2.0, c, c - 2.0, beta=0.1)
    assert float(out.loss) == pytest.approx(-F.logsigmoid(torch.tensor(0.0)).item())  # log 2
    out = LF.dpo_loss(torch.tensor([0.0]), torch.tensor([-10.0]), torch.tensor([0.0]), torch.tensor([0.0]), beta=0.1)
    assert float(out.loss) == pytest.approx(float(-F.logsigmoid(torch.tensor(1.0))))
    with pytest.raises(ValueError, match="shape"):
        LF.dpo_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2))


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge"])
@pytest.mark.parametrize("beta,gamma", [(2.0, 0.25), (10.0, 0.5)])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_matches_upstream(loss_type, beta, gamma, label_smoothing):
    c = (-torch.rand(9) * 3).requires_grad_(True)
    r = (-torch.rand(9) * 3).requires_grad_(True)
    want = upstream_simpo(c, r, beta, gamma, label_smoothing, loss_type)
    got = LF.simpo_loss(c, r, beta, gamma, label_smoothing, loss_type)  # type: ignore[arg-type]
    torch.testing.assert_close(got.loss, want)
    for a, b in zip(torch.autograd.grad(got.loss, [c, r]), torch.autograd.grad(want, [c, r]), strict=True):
        torch.testing.assert_close(a, b)
    assert float(got.metrics["rewards/chosen"]) == pytest.approx(float(beta * c.detach().mean()), rel=1e-5)
