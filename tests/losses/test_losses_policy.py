"""GRPO-family losses and advantages against TRL 1.16 (called directly where possible).

``policy_loss`` is compared with ``trl.GRPOTrainer._compute_loss`` itself, run on a minimal
object that carries only the attributes that method reads (no model, no accelerator). Advantages
are compared with an independent restatement of TRL's ``_generate_and_score_completions`` /
``RLOOTrainer`` code and with hand-computed values.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd as trl_nanstd

from composer_plugins.losses import functional as LF

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------
# TRL reference: GRPOTrainer._compute_loss on a minimal object
# ------------------------------------------------------------------------------------------------
def trl_compute_loss(
    logprobs,
    old,
    adv,
    mask,
    loss_type,
    eps_low,
    eps_high,
    level,
    beta,
    ref,
    max_len,
    bias_corr=True,
    delta=None,
    num_items=None,
):
    trainer = types.SimpleNamespace()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None)
    trainer.top_entropy_quantile = 1.0
    trainer.off_policy_mask_threshold = None
    trainer.importance_sampling_level = level
    trainer.beta = beta
    trainer.args = types.SimpleNamespace(use_bias_correction_kl=bias_corr, delta=delta, steps_per_generation=1)
    trainer.loss_type = loss_type
    trainer.epsilon_low, trainer.epsilon_high = eps_low, eps_high
    trainer.use_vllm = False
    trainer.vllm_importance_sampling_correction = False
    trainer.model = types.SimpleNamespace(training=True)
    trainer.current_gradient_accumulation_steps = 1
    trainer.max_completion_length = max_len
    trainer.accelerator = types.SimpleNamespace(
        num_processes=1, gather=lambda x: x, reduce=lambda x, reduction="sum": x, gather_for_metrics=lambda x: x
    )
    trainer._entropy_bonus_enabled = False
    trainer.aux_loss_enabled = False
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    b, t = logprobs.shape
    inputs = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "num_items_in_batch": mask.sum() if num_items is None else torch.as_tensor(num_items),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


def _random_case(b, t, adv_kind, empty_row, seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    mask[:, 0] = 1
    if empty_row:
        mask[min(1, b - 1)] = 0
    logprobs = (-torch.rand(b, t, generator=g) * 3).requires_grad_(True)
    old = logprobs.detach() + torch.randn(b, t, generator=g) * 0.3
    ref = logprobs.detach() + torch.randn(b, t, generator=g) * 0.2
    if adv_kind == "zero":
        adv = torch.zeros(b)
    elif adv_kind == "extreme":
        adv = torch.tensor([1e4, -1e4, 3e3, -5e3, 0.0, 1e-8][:b] + [1e4] * max(0, b - 6))
    else:
        adv = torch.randn(b, generator=g)
    return logprobs, old, ref, adv, mask


CASES = [
    # (loss_type, level, beta, bias_corr)
    ("grpo", "token", 0.0, True),
    ("grpo", "sequence", 0.04, True),
    ("bnpo", "token", 0.04, False),
    ("bnpo", "sequence", 0.0, True),
    ("dr_grpo", "token", 0.04, True),
    ("dr_grpo", "sequence", 0.0, True),
    ("dapo", "token", 0.0, True),
    ("dapo", "token", 0.04, True),
    ("dapo", "sequence", 0.04, False),
    ("cispo", "token", 0.0, True),
    ("cispo", "sequence", 0.04, True),
]


@pytest.mark.parametrize("loss_type,level,beta,bias_corr", CASES)
@pytest.mark.parametrize("adv_kind", ["random", "zero", "extreme"])
@pytest.mark.parametrize("shape,empty_row", [((4, 7), True), ((3, 1), False), ((6, 13), True)])
def test_policy_loss_matches_trl_compute_loss(loss_type, level, beta, bias_corr, adv_kind, shape, empty_row):
    b, t = shape
    logprobs, old, ref, adv, mask = _random_case(b, t, adv_kind, empty_row, seed=b * 100 + t)
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    max_len = t + 3
    ref_arg = ref if beta else None
    want, want_m = trl_compute_loss(
        logprobs, old, adv, mask, loss_type, 0.2, eps_high, level, beta, ref_arg, max_len, bias_corr=bias_corr
    )
    got, got_m = LF.policy_loss(
        logprobs,
        old,
        adv,
        mask,
        loss_type,
        0.2,
        eps_high,
        level,
        beta,
        ref_arg,
        max_len,
        use_bias_correction_kl=bias_corr,
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (g_want,) = torch.autograd.grad(want, logprobs)
    (g_got,) = torch.autograd.grad(got, logprobs)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-7)
    for k, v in want_m.items():
        if k == "entropy":
            continue
        assert k in got_m, k
        if isinstance(v, float) and math.isnan(v):
            assert math.isnan(float(got_m[k]))
        else:
            assert float(got_m[k]) == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_gspo_is_sequence_level_grpo_and_delta_and_num_items_match_trl():
    logprobs, old, _, adv, mask = _random_case(5, 9, "random", True, seed=7)
    want, _ = trl_compute_loss(logprobs, old, adv, mask, "grpo", 3e-4, 4e-4, "sequence", 0.0, None, 9)
    got = LF.policy_loss(logprobs, old, adv, mask, "gspo", 3e-4, 4e-4).loss
    torch.testing.assert_close(got, want)
    # two-sided clipping (INTELLECT-2 delta)
    want, _ = trl_compute_loss(logprobs, old, adv, mask, "bnpo", 0.2, 0.2, "token", 0.0, None, 9, delta=1.1)
    got = LF.policy_loss(logprobs, old, adv, mask, "bnpo", delta=1.1).loss
    torch.testing.assert_close(got, want)
    # DAPO with a global token count (gradient accumulation across micro-batches)
    want, _ = trl_compute_loss(logprobs, old, adv, mask, "dapo", 0.2, 0.2, "token", 0.0, None, 9, num_items=97)
    got = LF.policy_loss(logprobs, old, adv, mask, "dapo", num_items_in_batch=97).loss
    torch.testing.assert_close(got, want)


def test_old_logprobs_none_means_on_policy_and_advantage_per_token():
    logprobs, _, _, adv, mask = _random_case(3, 5, "random", False, seed=3)
    want, _ = trl_compute_loss(logprobs, None, adv, mask, "dapo", 0.2, 0.2, "token", 0.0, None, 5)
    got = LF.policy_loss(logprobs, None, adv, mask, "dapo").loss
    torch.testing.assert_close(got, want)
    # on-policy: ratio == 1, so the loss is -mean(A) over tokens
    expect = -(adv.unsqueeze(1) * mask).sum() / mask.sum()
    torch.testing.assert_close(got, expect)
    # (B, T) advantages broadcast identically
    adv_bt = adv.unsqueeze(1).expand(3, 5).contiguous()
    torch.testing.assert_close(
        LF.policy_loss(logprobs, None, adv_bt, mask, "grpo").loss,
        LF.policy_loss(logprobs, None, adv, mask, "grpo").loss,
    )


def test_kl_estimators_restated():
    lp = torch.randn(2, 4)
    ref = torch.randn(2, 4)
    torch.testing.assert_close(LF.kl_estimate(lp, ref, "k1"), lp - ref)
    torch.testing.assert_close(LF.kl_estimate(lp, ref, "k2"), 0.5 * (lp - ref) ** 2)
    torch.testing.assert_close(LF.kl_estimate(lp, ref, "k3"), (ref - lp).exp() - (ref - lp) - 1)
    # k1 / k2 enter the loss as beta * KL * ratio (bias correction), on-policy ratio == 1
    mask = torch.ones(2, 4)
    adv = torch.zeros(2)
    for est in ("k1", "k2"):
        out = LF.policy_loss(lp, None, adv, mask, "bnpo", beta=0.5, ref_logprobs=ref, kl_estimator=est)
        torch.testing.assert_close(out.loss, 0.5 * LF.kl_estimate(lp, ref, est).mean())


def test_policy_loss_shape_errors_are_explicit():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mask shape"):
        LF.policy_loss(lp, None, torch.zeros(2), torch.ones(2, 4))
    with pytest.raises(ValueError, match="advantages shape"):
        LF.policy_loss(lp, None, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="ref_logprobs"):
        LF.policy_loss(lp, None, torch.zeros(2), torch.ones(2, 3), beta=0.1)
    with pytest.raises(ValueError, match="unknown loss_type"):
        LF.policy_loss(lp, None, torch.zeros(2), torch.ones(2, 3), "ppo")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# advantages
# ------------------------------------------------------------------------------------------------
def restated_grpo_advantages(rewards, g, scale):
    """TRL GRPOTrainer (sum_then_normalize), restated: nan-aware group mean, nanstd, /(std+1e-4), nan -> 0."""
    grouped = rewards.view(-1, g)
    mean = torch.nanmean(grouped, 1).repeat_interleave(g)
    if scale == "batch":
        std = trl_nanstd(rewards).expand_as(rewards)
    else:
        std = trl_nanstd(grouped, dim=1).repeat_interleave(g) if g > 1 else torch.zeros_like(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def restated_rloo(rewards, g, normalize):
    grouped = rewards.view(-1, g)
    cnt = (~torch.isnan(grouped)).sum(1, keepdim=True)
    tot = torch.nansum(grouped, 1, keepdim=True)
    adv = rewards - ((tot - grouped) / (cnt - 1)).view(-1)
    if normalize:
        adv = (adv - torch.nanmean(adv)) / (trl_nanstd(adv) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_group_advantages_match_trl_restatement(scale, g):
    r = torch.randn(4 * g)
    r[1] = float("nan")  # unscorable
    if g > 1:
        r[g : 2 * g] = float("nan")  # a whole unscorable group
    got = LF.group_advantages(r, g, scale)
    torch.testing.assert_close(got, restated_grpo_advantages(r, g, scale))
    assert got[1] == 0.0
    assert torch.isfinite(got).all()


def test_group_advantages_none_rewards_and_hand_values():
    adv = LF.group_advantages([1.0, 0.0, None, 1.0], 4)
    # scorable group {1, 0, 1}: mean 2/3, std (Bessel) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    expect = [(1 - 2 / 3) / (std + 1e-4), (0 - 2 / 3) / (std + 1e-4), 0.0, (1 - 2 / 3) / (std + 1e-4)]
    torch.testing.assert_close(adv, torch.tensor(expect))
    # identical rewards -> zero advantage (std 0 -> 0/1e-4 = 0)
    assert LF.group_advantages([0.5, 0.5], 2).abs().max() == 0
    # single scorable completion in its group -> advantage 0
    assert LF.group_advantages([2.0, None], 2).tolist() == [0.0, 0.0]


def test_group_advantages_multiple_reward_functions():
    per_func = [[1.0, None], [None, None], [0.0, 2.0], [1.0, 1.0]]
    w = [1.0, 0.5]
    got = LF.group_advantages(per_func, 2, "none", reward_weights=w)
    # row sums: 1.0, unscorable, 1.0, 1.5 -> group0 mean over {1.0} = 1 ; group1 mean 1.25
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, 0.25]))


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages_match_trl_restatement(normalize):
    r = torch.randn(12)
    r[5] = float("nan")
    got = LF.group_advantages(r, 4, "batch" if normalize else None, estimator="rloo")
    torch.testing.assert_close(got, restated_rloo(r, 4, normalize))
    # hand value: group [a,b,c,d] -> a - mean(b,c,d)
    torch.testing.assert_close(
        LF.rloo_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), 4),
        torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 2.0]),
    )
    with pytest.raises(ValueError, match="not defined for RLOO"):
        LF.group_advantages(r, 4, "group", estimator="rloo")


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="whole number of groups"):
        LF.group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="unknown scale"):
        LF.group_advantages(torch.zeros(4), 2, "global")  # type: ignore[arg-type]


def test_rows_correct_routes_only_the_correct_rows_to_the_policy_gradient():
    """SRPO's routing: with ``rows: correct`` the failed rows' tokens leave the policy-gradient loss."""
    from composer_plugins.losses.policy import PolicyLossChannel

    torch.manual_seed(0)
    B, T = 4, 5
    logps = torch.randn(B, T, requires_grad=True)
    batch = {
        "old_logprobs": logps.detach() - 0.1,
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]),
        "completion_mask": torch.ones(B, T),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
    }
    srpo = PolicyLossChannel(loss_type="grpo", rows="correct")
    assert "rewards" in srpo.required_inputs()
    loss, _ = srpo({**batch, "logprobs": logps})
    by_hand, _ = PolicyLossChannel(loss_type="grpo")(
        {**batch, "completion_mask": torch.tensor([[1.0], [0.0], [1.0], [0.0]]).expand(B, T), "logprobs": logps}
    )
    assert torch.allclose(loss, by_hand)
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad[[1, 3]].abs().sum() == 0 and grad[[0, 2]].abs().sum() > 0
    everyone, _ = PolicyLossChannel(loss_type="grpo")({**batch, "logprobs": logps})
    assert not torch.allclose(loss, everyone)
    with pytest.raises(ValueError, match="rows"):
        PolicyLossChannel(rows="failed")
