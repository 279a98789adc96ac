"""Tests for the losses-group survivors a fresh mutation seed found (issue 51): each asserts the behaviour the
mutant changed, from a formula written here (not from the code under test)."""

from __future__ import annotations

import math

import pytest
import torch

from composer_plugins.losses import functional as LF
from composer_plugins.losses.base import ChannelComposer
from composer_plugins.losses.correction import importance_sampling_correction
from composer_plugins.losses.distill import HintDistillChannel
from composer_plugins.losses.policy import PolicyLossChannel

torch.set_num_threads(1)


def test_entropy_aware_opd_is_the_reverse_kl_plus_the_gated_forward_kl_by_hand():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    t = torch.randn(2, 3, 7, generator=g, dtype=torch.float64) * 0.3  # high-entropy teacher at some tokens
    t[0, 0] *= 20  # a confident teacher token: no forward-KL term there
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    rkl = (ls.exp() * (ls - lt)).sum(-1)
    fkl = (lt.exp() * (lt - ls)).sum(-1)
    ent = -(lt.exp() * lt).sum(-1)
    want = (rkl + 0.5 * (ent > 1.5).double() * fkl)[mask].mean()
    got = LF.entropy_aware_opd(s, t, mask, entropy_threshold=1.5, fkl_weight=0.5)
    assert bool((ent > 1.5).any()) and bool((ent <= 1.5).any())
    assert float(got) > 0
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_needs_teacher_only_for_a_live_channel_that_needs_one():
    grpo, hint = PolicyLossChannel(loss_type="grpo", name="grpo"), HintDistillChannel(weight=0.0, name="hint")
    assert not ChannelComposer([grpo, hint]).needs_teacher  # the teacher channel is off
    assert not ChannelComposer([grpo]).needs_teacher
    assert ChannelComposer([grpo, HintDistillChannel(weight=0.5, name="hint")]).needs_teacher


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask", "token_truncate"])
def test_importance_sampling_ignores_padding_in_the_sequence_sum(mode):
    lp = torch.tensor([[-1.0, -1.2, -3.0, -4.0]])
    samp = torch.tensor([[-1.1, -1.0, -9.0, -0.5]])  # the padded positions differ a lot
    mask = torch.tensor([[1, 1, 0, 0]])
    got = importance_sampling_correction(lp, samp, mask, mode=mode, clip_max=10.0, clip_min=0.0)
    if mode.startswith("sequence"):
        assert got.shape == (1, 1)
        assert math.isclose(float(got), math.exp(0.1 - 0.2), rel_tol=1e-6)
    else:
        want = torch.tensor([[math.exp(0.1), math.exp(-0.2), 1.0, 1.0]])
        torch.testing.assert_close(got, want)


def test_dr_grpo_divides_by_the_max_completion_length_given_or_the_inputs():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], requires_grad=True)
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    inputs = {"logprobs": lp, "old_logprobs": lp.detach(), "advantages": adv, "completion_mask": mask}
    # at ratio 1 the per-token loss is -A: the sum over the mask is -(2·1 - 3·0.5) = -0.5
    mine = PolicyLossChannel(loss_type="dr_grpo", max_completion_length=10, name="p")(inputs)[0]
    assert math.isclose(float(mine), -0.5 / (2 * 10), rel_tol=1e-6)
    theirs = PolicyLossChannel(loss_type="dr_grpo", name="p")({**inputs, "max_completion_length": 5})[0]
    assert math.isclose(float(theirs), -0.5 / (2 * 5), rel_tol=1e-6)
    neither = PolicyLossChannel(loss_type="dr_grpo", name="p")(inputs)[0]
    assert math.isclose(float(neither), -0.5 / (2 * 3), rel_tol=1e-6)


def test_group_advantages_takes_the_rloo_branch_only_for_rloo():
    r = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    grpo = LF.group_advantages(r, 3, estimator="grpo", scale="none")
    torch.testing.assert_close(grpo, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))
    rloo = LF.group_advantages(r, 3, estimator="rloo")
    torch.testing.assert_close(rloo, torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="unknown estimator 'ppo'; valid: 'grpo', 'rloo'"):
        LF.group_advantages(r, 3, estimator="ppo")  # type: ignore[arg-type]


# --- issue 67: survivors of seed 6262 (benchmarks/README.md, "Mutation testing") ---


@pytest.mark.parametrize("path", ["hidden_states", "completion_logits"])
def test_each_teacher_reports_the_rows_it_missed_and_the_share_of_tokens_it_scored(path):
    """Two teachers over 2 rows of 5 tokens (row 1's last two masked): ``b`` scored nothing of row 1 and 2
    tokens of row 0; ``a`` everything but one token of row 0. Counted here from the masks."""
    from composer_plugins.kernels.teacher_topk import TeacherTopK
    from composer_plugins.losses.teacher_distill import TeacherDistillChannel

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    t = torch.log_softmax(torch.randn(2, 2, 5, 13, generator=g, dtype=torch.float64), -1).topk(3, -1)
    present = torch.ones(2, 2, 5, dtype=torch.bool)
    present[0, 0, 4] = False  # a: all of row 0 but token 4
    present[0, 1, 2:] = False  # b: tokens 0-1 of row 0 ...
    present[1, 1] = False  # ... and nothing of row 1
    scores = TeacherTopK(t.indices.clone(), t.values.clone(), present, ("a", "b"))
    h = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    w = torch.randn(13, 4, generator=g, dtype=torch.float64)
    outputs = {"hidden_states": h, "lm_head_weight": w} if path == "hidden_states" else {"completion_logits": h @ w.T}
    _, m = TeacherDistillChannel()({"teacher_scores": scores, "completion_mask": mask, **outputs})
    assert m["absent/b"] == 0.5 and "absent/a" not in m  # b missed one of the two rows
    assert m["scored/a"] == pytest.approx(7 / 8) and m["scored/b"] == pytest.approx(2 / 8)


@pytest.mark.parametrize("loss_type", ["sppo_hard", "simple", "t", "bco_pair", "aot"])
def test_an_unknown_loss_type_is_refused_not_taken_for_the_one_it_sorts_beside(loss_type):
    x = torch.tensor([-1.0, -2.0])
    with pytest.raises(ValueError, match=rf"unknown DPO loss_type '{loss_type}'"):
        LF.dpo_loss(x, x - 1, x, x, loss_type=loss_type)
    with pytest.raises(ValueError, match=rf"unknown SimPO loss_type '{loss_type}'"):
        LF.simpo_loss(x, x - 1, loss_type=loss_type)


# --- issue 67: survivors of seed 6701 ---


def test_several_reward_functions_without_weights_sum_each_rows_columns():
    from composer_plugins.losses.advantages import group_advantages

    rows = [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]]  # 4 rows, 2 reward functions: totals 1, 0, 2, 1
    got = group_advantages(rows, group_size=2, scale="none")
    assert got.tolist() == [0.5, -0.5, 0.5, -0.5]


def test_a_batch_of_two_rewards_is_scaled_by_its_standard_deviation():
    from composer_plugins.losses.advantages import group_advantages

    got = group_advantages([0.0, 2.0], group_size=2, scale="batch", eps=0.0)
    sd = math.sqrt(((0.0 - 1.0) ** 2 + (2.0 - 1.0) ** 2) / (2 - 1))  # Bessel-corrected, as TRL's nanstd
    torch.testing.assert_close(got, torch.tensor([-1.0 / sd, 1.0 / sd]))


def test_a_policy_channel_with_beta_1_reads_the_reference_and_adds_its_kl():
    g = torch.Generator().manual_seed(0)
    lp, ref = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    inputs = {"logprobs": lp, "ref_logprobs": ref, "advantages": torch.zeros(2), "completion_mask": torch.ones(2, 3)}
    loss, _ = PolicyLossChannel(loss_type="bnpo", beta=1.0)(inputs)
    k3 = ((ref - lp).exp() - (ref - lp) - 1).mean()  # zero advantages: the loss is beta * KL (k3 by default)
    torch.testing.assert_close(loss, k3)


def test_teacher_distill_spec_and_deadline_checks():
    from composer_plugins.losses.teacher_distill import TeacherDistillChannel

    assert TeacherDistillChannel.check_spec({"teachers": [{"kind": "causal_lm", "id": "big"}]}) is None
    assert TeacherDistillChannel.check_spec({"teachers": ({"kind": "causal_lm", "id": "big"},)}) is None
    assert TeacherDistillChannel.check_spec({"teachers": []})[0] == "teachers"
    assert TeacherDistillChannel.check_spec({"teachers": "big"})[0] == "teachers"
    assert TeacherDistillChannel(deadline_s=0.5) is not None  # under a second is a deadline too
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="deadline_s must be > 0 seconds"):
            TeacherDistillChannel(deadline_s=bad)


def test_teacher_distill_reports_which_path_it_took():
    from composer_plugins.kernels.teacher_topk import TeacherTopK
    from composer_plugins.losses.teacher_distill import TeacherDistillChannel

    g = torch.Generator().manual_seed(1)
    t = torch.log_softmax(torch.randn(1, 1, 3, 7, generator=g, dtype=torch.float64), -1).topk(2, -1)
    scores = TeacherTopK(t.indices.clone(), t.values.clone(), torch.ones(1, 1, 3, dtype=torch.bool), ("a",))
    h = torch.randn(1, 3, 4, generator=g, dtype=torch.float64)
    w = torch.randn(7, 4, generator=g, dtype=torch.float64)
    base = {"teacher_scores": scores, "completion_mask": torch.ones(1, 3, dtype=torch.bool)}
    _, m = TeacherDistillChannel()({**base, "hidden_states": h, "lm_head_weight": w})
    assert m["chunked"] == 1.0
    _, m = TeacherDistillChannel()({**base, "completion_logits": h @ w.T})
    assert m["chunked"] == 0.0


def test_a_negative_kl_coefficient_without_reference_log_probs_is_refused():
    lp = torch.randn(2, 3)
    with pytest.raises(ValueError, match="beta != 0 needs ref_logprobs"):
        LF.policy_loss(lp, None, torch.zeros(2), torch.ones(2, 3), beta=-0.1)


# --- issue 67: survivors of seed 6712 ---


def test_the_hint_is_weight_statistic_is_the_mean_clipped_ratio_by_hand():
    lp = torch.tensor([[0.0, -1.0, -2.0]])
    old = torch.tensor([[-0.5, -1.0, -1.0]])  # ratios e^0.5, 1, e^-1
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    w, m = HintDistillChannel(is_clip=1.5).importance_weights(mask, {"logprobs": lp, "old_logprobs": old})
    want = (1.5 + 1.0 + math.exp(-1.0)) / 3  # e^0.5 = 1.65 clipped to 1.5
    assert float(m["is_weight"]) == pytest.approx(want) and 0 < want < 1.5
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.0, math.exp(-1.0)]]))


def test_hint_distill_refuses_a_jsd_beta_outside_0_1():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
            HintDistillChannel(criterion="jsd", beta=bad)
    assert HintDistillChannel(criterion="jsd", beta=0.0) is not None


def test_an_unknown_kl_estimator_is_refused():
    lp = torch.zeros(1, 2)
    for bad in ("k4", "kl"):
        with pytest.raises(ValueError, match="unknown KL estimator"):
            LF.kl_estimate(lp, lp, bad)


def test_dpo_replay_takes_ipo_and_simpo_replay_does_not():
    from composer_plugins.losses.preference import ReplayPreferenceChannel

    assert ReplayPreferenceChannel(method="dpo", loss_type="ipo").loss_type == "ipo"
    with pytest.raises(ValueError, match="unknown simpo loss_type 'ipo'"):
        ReplayPreferenceChannel(method="simpo", loss_type="ipo")


# --- issue 67: survivors of seed 6721 ---


def test_hint_distill_refuses_a_non_positive_sampling_temperature_and_a_zero_chunk():
    ch = HintDistillChannel()
    assert ch.distill_temperature({"sampling_temperature": 0.5}) == 0.5
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="sampling_temperature must be > 0"):
            ch.distill_temperature({"sampling_temperature": bad})
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        HintDistillChannel(chunk_size=0)


def test_dppo_refuses_advantages_of_neither_shape():
    lp = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"advantages shape \(3,\) must be \(B,\) or equal"):
        LF.dppo_kl_loss(lp, lp, torch.zeros(3), torch.ones(2, 4))


def test_a_channel_taking_its_inputs_as_star_args_keeps_the_contract():
    from composer_plugins.losses.base import LossChannel, check_contract

    class StarArgs(LossChannel):
        def forward(self, *args):
            return args[0]["x"].sum(), {}

    check_contract(StarArgs)  # one mapping, passed positionally: no adapter, no error
    assert "_api1_forward" not in vars(StarArgs) and StarArgs.contract_problem() is None


def test_a_policy_channel_names_its_rows_only_when_not_all():
    assert "rows='correct'" in repr(PolicyLossChannel(rows="correct"))
    assert "rows=" not in repr(PolicyLossChannel()) and "beta=0.0" in repr(PolicyLossChannel())
