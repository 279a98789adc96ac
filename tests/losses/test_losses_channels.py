"""The built-in loss channels: registration, the composer, skipping, chunked == materialised, TAID resume."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from click.testing import CliRunner

import composer_plugins
from composer_plugins.core.cli import load_commands
from composer_plugins.losses import functional as LF
from composer_plugins.losses.base import ChannelComposer, LossChannel
from composer_plugins.losses.distill import HintDistillChannel
from composer_plugins.losses.policy import CHANNEL_EPSILONS, DPPOChannel, PolicyLossChannel
from composer_plugins.losses.preference import ReplayPreferenceChannel

torch.set_num_threads(1)

BUILTINS = ["bnpo", "cispo", "dapo", "dppo", "dr_grpo", "grpo", "gspo", "hint_distill", "replay_dpo", "replay_simpo"]


def test_every_builtin_channel_is_listed_with_a_one_line_description():
    r = CliRunner().invoke(load_commands(), ["list", "losses", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = {d["name"]: d for d in json.loads(r.output)}
    for name in BUILTINS:
        assert name in rows, f"{name} not listed"
        desc = rows[name]["description"]
        assert desc and "\n" not in desc and len(desc) <= 70, (name, desc)
        assert rows[name]["distribution"] == "composer-plugins"
    table = CliRunner().invoke(load_commands(), ["list", "losses"], catch_exceptions=False).output
    assert all(any(line.startswith(n + " ") for line in table.splitlines()) for n in BUILTINS)


def test_registry_builds_each_channel_with_its_preset():
    for lt in LF.POLICY_LOSS_TYPES:
        ch = composer_plugins.build("losses", lt)
        assert isinstance(ch, PolicyLossChannel) and ch.name == lt and ch.loss_type == lt
        assert (ch.epsilon_low, ch.epsilon_high) == CHANNEL_EPSILONS[lt]
    assert isinstance(composer_plugins.build("losses", "dppo"), DPPOChannel)
    hd = composer_plugins.build("losses", "hint_distill", criterion="taid", total_steps=5)
    assert isinstance(hd, HintDistillChannel) and hd.scheduler is not None and hd.needs_teacher
    assert composer_plugins.build("losses", "replay_simpo").method == "simpo"
    assert composer_plugins.build("losses", "replay_dpo").needs_reference


# ------------------------------------------------------------------------------------------------
# a shared toy batch
# ------------------------------------------------------------------------------------------------
B, T, H, V = 3, 6, 8, 23


def toy(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_(True)
    hidden = torch.randn(B, T, H, generator=g).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:] = 0
    mask[2] = 0  # an empty completion
    batch = {
        "completion_ids": ids,
        "completion_mask": mask,
        "advantages": torch.randn(B, generator=g),
        "inference_logprobs": -torch.rand(B, T, generator=g) * 3,
        "ref_logprobs": -torch.rand(B, T, generator=g) * 3,
        "old_logprobs": -torch.rand(B, T, generator=g) * 3,
        "hint_mask": torch.rand(B, T, generator=g) > 0.4,
        "teacher_hidden": torch.randn(B, T, H, generator=g),
        "chosen_logps": -torch.rand(4, generator=g) * 20,
        "rejected_logps": -torch.rand(4, generator=g) * 20,
        "ref_chosen_logps": -torch.rand(4, generator=g) * 20,
        "ref_rejected_logps": -torch.rand(4, generator=g) * 20,
        "chosen_lengths": torch.randint(1, 20, (4,), generator=g),
        "rejected_lengths": torch.randint(1, 20, (4,), generator=g),
    }
    return w, hidden, batch


@pytest.mark.parametrize("name", [*LF.POLICY_LOSS_TYPES, "dppo"])
def test_policy_channels_hidden_state_path_equals_logprob_path(name):
    w, hidden, batch = toy(1)
    kw = {"beta": 0.05} if name == "grpo" else {}
    ch = composer_plugins.build("losses", name, **kw)
    logprobs = LF.selective_log_softmax(hidden @ w.T, batch["completion_ids"])
    loss_a, m_a = ch({**batch, "logprobs": logprobs})
    loss_b, m_b = ch({**batch, "logprobs": None, "hidden_states": hidden, "lm_head_weight": w})
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad(loss_a, [hidden, w])
    gb = torch.autograd.grad(loss_b, [hidden, w])
    for x, y in zip(gb, ga, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    assert set(m_a) == set(m_b)
    if name != "dppo":  # the channel is exactly the functional loss with its preset epsilons
        lo, hi = CHANNEL_EPSILONS[name]
        ref = LF.policy_loss(
            logprobs,
            batch["old_logprobs"],
            batch["advantages"],
            batch["completion_mask"],
            name,
            lo,
            hi,
            beta=kw.get("beta", 0.0),
            ref_logprobs=batch["ref_logprobs"],
        )
        torch.testing.assert_close(loss_a, ref.loss)


def test_hidden_state_path_is_finite_when_padding_holds_extreme_old_logprobs():
    w, hidden, batch = toy(9)
    off = batch["completion_mask"] == 0
    old = batch["old_logprobs"].masked_fill(off, -1e4)  # exp(0 - (-1e4)) would overflow to inf
    inf_lp = batch["inference_logprobs"].masked_fill(off, -1e4)
    outs = {"hidden_states": hidden, "lm_head_weight": w}
    for ch in (PolicyLossChannel(loss_type="dapo"), DPPOChannel()):
        loss, _ = ch({**batch, "old_logprobs": old, "inference_logprobs": inf_lp, **outs})
        assert torch.isfinite(loss)
        (g,) = torch.autograd.grad(loss, hidden)
        assert torch.isfinite(g).all()


def test_dppo_channel_normalisation():
    w, hidden, batch = toy(2)
    lp = LF.selective_log_softmax(hidden @ w.T, batch["completion_ids"])
    raw = LF.dppo_kl_loss(lp, batch["inference_logprobs"], batch["advantages"], batch["completion_mask"].bool())
    n = batch["completion_mask"].sum()
    for norm, div in (("tokens", n), ("sequences", B), ("none", 1)):
        loss, _ = DPPOChannel(normalize=norm)({**batch, "logprobs": lp})
        torch.testing.assert_close(loss, raw.loss / div)
    loss, _ = DPPOChannel()({**batch, "num_items_in_batch": torch.tensor(100), "logprobs": lp})
    torch.testing.assert_close(loss, raw.loss / 100)


def test_dppo_channel_drops_zero_weight_tokens_from_mask_and_divisor():
    """PRIME-RL routes the RL loss with ``rl_mask = mask & (rl_w != 0)`` and divides by that mask's count."""
    w, hidden, batch = toy(3)
    lp = LF.selective_log_softmax(hidden @ w.T, batch["completion_ids"])
    mask = batch["completion_mask"].bool()
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)) + 0.5
    weights[:, ::2] = 0.0  # every other token carries no RL weight
    rl_mask = mask & (weights != 0)
    assert 0 < rl_mask.sum() < mask.sum()
    want = LF.dppo_kl_loss(lp, batch["inference_logprobs"], batch["advantages"], rl_mask, loss_weights=weights)
    loss, metrics = DPPOChannel()({**batch, "loss_weights": weights, "logprobs": lp})
    torch.testing.assert_close(loss, want.loss / rl_mask.sum())
    assert int(metrics["tokens"]) == int(rl_mask.sum())
    for k in ("is_masked", "unmasked_mismatch_kl"):
        torch.testing.assert_close(metrics[k], want.metrics[k])
    # all weights zero: nothing to learn from, a zero loss (not a division by the unweighted count)
    zero, _ = DPPOChannel()({**batch, "loss_weights": torch.zeros_like(weights), "logprobs": lp})
    assert float(zero.detach()) == 0.0


@pytest.mark.parametrize("criterion", ["jsd", "taid", "entropy_opd"])
@pytest.mark.parametrize("grad_mode", ["recompute", "precompute"])
def test_hint_distill_chunked_equals_materialised_and_teacher_gets_no_grad(criterion, grad_mode):
    w, hidden, batch = toy(3)
    t_hidden = batch["teacher_hidden"].clone().requires_grad_(True)
    kw = {"total_steps": 10, "auto_step": False} if criterion == "taid" else {}
    ch = HintDistillChannel(criterion=criterion, beta=0.3, temperature=1.2, chunk_size=2, grad_mode=grad_mode, **kw)
    loss_c, m_c = ch({**batch, "student_hidden": hidden, "teacher_hidden": t_hidden, "lm_head_weight": w})
    loss_m, m_m = ch({**batch, "student_logits": hidden @ w.T, "teacher_logits": t_hidden @ w.T})
    assert m_c["chunked"] == 1.0 and m_m["chunked"] == 0.0
    torch.testing.assert_close(loss_c, loss_m, rtol=1e-5, atol=1e-6)
    gc = torch.autograd.grad(loss_c, [hidden, w, t_hidden], allow_unused=True)
    gm = torch.autograd.grad(loss_m, [hidden, w, t_hidden], allow_unused=True)
    for x, y in zip(gc[:2], gm[:2], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)
    assert gc[2] is None and gm[2] is None  # no gradient ever reaches the teacher
    # only hinted tokens matter: gradient is zero on every other position
    assert gc[0][~batch["hint_mask"]].abs().max() == 0
    assert float(m_c["tokens"]) == float(batch["hint_mask"].sum())
    for k in m_m:
        if k != "chunked":
            assert float(m_c[k]) == pytest.approx(float(m_m[k]), rel=1e-5, abs=1e-6), k
    if criterion == "entropy_opd":
        assert {"teacher_entropy", "high_entropy", "reverse_kl", "forward_kl"} <= set(m_c)
    # the same loss as the functional API on the masked tokens
    mask = batch["hint_mask"]
    zs, zt = hidden @ w.T, (batch["teacher_hidden"] @ w.T)
    ref = {
        "jsd": lambda: LF.generalized_jsd(zs, zt, mask, beta=0.3, temperature=1.2),
        "taid": lambda: LF.taid_loss(zs / 1.2, zt / 1.2, mask, 0.4),  # the channel's temperature, every criterion
        "entropy_opd": lambda: LF.entropy_aware_opd(zs, zt, mask, temperature=1.2),
    }[criterion]()
    torch.testing.assert_close(loss_m, ref, rtol=1e-5, atol=1e-6)


def test_hint_distill_empty_mask_reports_empty_not_a_value():
    w, hidden, batch = toy(4)
    ch = HintDistillChannel()
    loss, m = ch({**batch, "hint_mask": torch.zeros(B, T), "student_hidden": hidden, "lm_head_weight": w})
    assert m["empty"] == 1.0 and float(m["tokens"]) == 0
    loss.backward()  # still a valid graph
    assert float(loss.detach()) == 0.0


def test_taid_channel_steps_schedule_and_resumes_exactly_through_composer_state_dict():
    def make():
        return ChannelComposer([HintDistillChannel(criterion="taid", total_steps=8, alpha=0.3, label="hint")])

    w, hidden, batch = toy(5)
    outs = {"student_hidden": hidden.detach(), "teacher_hidden": batch["teacher_hidden"], "lm_head_weight": w.detach()}
    # vary the loss from step to step by scaling the student hidden states
    steps = [{**outs, "student_hidden": outs["student_hidden"] * (1 + 0.2 * i)} for i in range(8)]
    a = make()
    ts = []
    for i, o in enumerate(steps[:4]):
        _, m = a({**batch, "global_step": i, **o})
        ts.append(float(m["hint/taid_t"]))
    assert ts[0] == ts[1] == pytest.approx(0.4)  # first call only records the loss
    assert ts[3] > 0.4
    state = {k: v.clone() for k, v in a.state_dict().items()}
    assert {"channels.0.scheduler.t", "channels.0.scheduler.prev_loss", "channels.0.scheduler.momentum"} <= set(state)
    b = make()
    b.load_state_dict(state)
    for i, o in enumerate(steps[4:], start=4):
        la, ma = a({**batch, "global_step": i, **o})
        lb, mb = b({**batch, "global_step": i, **o})
        assert torch.equal(la, lb) and ma["hint/taid_t"] == mb["hint/taid_t"]
    # eval mode does not step
    b.eval()
    before = b["hint"].scheduler.value  # type: ignore[union-attr]
    b({**batch, "global_step": 7, **steps[0]})
    assert b["hint"].scheduler.value == before  # type: ignore[union-attr]


def test_replay_channels():
    _, _, batch = toy(6)
    loss, m = ReplayPreferenceChannel(method="dpo", beta=0.2)(batch)
    want = LF.dpo_loss(
        batch["chosen_logps"], batch["rejected_logps"], batch["ref_chosen_logps"], batch["ref_rejected_logps"], beta=0.2
    )
    torch.testing.assert_close(loss, want.loss)
    assert "rewards/accuracies" in m
    # simpo from sums + lengths == simpo from averages
    sim = ReplayPreferenceChannel(method="simpo")
    avg = {
        "chosen_avg_logps": batch["chosen_logps"] / batch["chosen_lengths"],
        "rejected_avg_logps": batch["rejected_logps"] / batch["rejected_lengths"],
    }
    l1, _ = sim(batch)
    l2, _ = sim(avg)
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(l2, LF.simpo_loss(avg["chosen_avg_logps"], avg["rejected_avg_logps"]).loss)
    assert sim.missing_inputs({"chosen_logps": batch["chosen_logps"]}) == [
        "chosen_avg_logps+rejected_avg_logps|chosen_logps+rejected_logps+chosen_lengths+rejected_lengths"
    ]


# ------------------------------------------------------------------------------------------------
# the composer
# ------------------------------------------------------------------------------------------------
def test_composer_sums_weighted_losses_and_reports_skips():
    w, hidden, batch = toy(7)
    lp = LF.selective_log_softmax(hidden @ w.T, batch["completion_ids"])
    comp = ChannelComposer.from_specs(
        [
            {"name": "dapo", "weight": 1.0},
            {"name": "grpo", "weight": 0.5, "beta": 0.1, "label": "grpo_kl"},
            {"name": "hint_distill", "weight": 0.25, "criterion": "jsd"},
            {"name": "replay_dpo", "weight": 2.0},
            {"name": "dppo", "weight": 0.0},
        ]
    )
    assert comp.names == ["dapo", "grpo_kl", "hint_distill", "replay_dpo", "dppo"]
    assert comp.needs_teacher and comp.needs_reference
    outs = {"logprobs": lp, "student_hidden": hidden, "lm_head_weight": w}
    # 1) no replay pairs, no ref log-probs: those channels are skipped, and say why
    partial = {k: v for k, v in batch.items() if k not in ("chosen_logps", "ref_logprobs")}
    total, m = comp({**partial, **outs})
    assert m["replay_dpo/skipped"] == 1.0 and "chosen_logps" in m["replay_dpo/missing"]
    assert m["grpo_kl/skipped"] == 1.0 and m["grpo_kl/missing"] == "ref_logprobs"
    assert m["dppo/skipped"] == 1.0  # weight 0
    assert "replay_dpo/loss" not in m and "grpo_kl/loss" not in m
    expect = m["dapo/loss"] + 0.25 * m["hint_distill/loss"]
    torch.testing.assert_close(total.detach(), expect)
    assert m["dapo/skipped"] == 0.0 and "dapo/clip_ratio/high_mean" in m
    # 2) everything present
    total, m = comp({**batch, **outs})
    expect = m["dapo/loss"] + 0.5 * m["grpo_kl/loss"] + 0.25 * m["hint_distill/loss"] + 2.0 * m["replay_dpo/loss"]
    torch.testing.assert_close(total.detach(), expect)
    total.backward()
    assert hidden.grad is not None and w.grad is not None
    # 3) nothing present -> zero total without grad and every channel reported skipped
    total, m = comp({})
    assert float(total) == 0.0 and not total.requires_grad
    assert all(m[f"{n}/skipped"] == 1.0 for n in comp.names)


def test_hint_channel_reports_missing_alternatives():
    ch = HintDistillChannel()
    assert ch.missing_inputs({"hint_mask": torch.ones(1, 1)}) == [
        "student_hidden+teacher_hidden+lm_head_weight|student_logits+teacher_logits"
    ]
    assert ch.missing_inputs({"student_logits": torch.zeros(1), "teacher_logits": torch.zeros(1)}) == ["hint_mask"]


def test_example_focal_plugin_still_works_with_the_extended_base(discovery):
    focal = composer_plugins.build("losses", "focal_pg", gamma=1.0)
    assert isinstance(focal, LossChannel)
    w, hidden, batch = toy(8)
    lp = LF.selective_log_softmax(hidden @ w.T, batch["completion_ids"])
    comp = ChannelComposer([focal, composer_plugins.build("losses", "dapo")])
    total, m = comp({**batch, "logprobs": lp})
    assert m["focal_pg/skipped"] == 0.0 and torch.isfinite(total)
    _, m = comp({"advantages": batch["advantages"]})
    assert m["focal_pg/missing"] == "logprobs,completion_mask"


def test_the_composer_hands_each_channel_the_one_inputs_mapping_it_was_given():
    """One mapping per call, passed through as is: no second dict, no copy, no merge."""
    seen = []

    class Reads(LossChannel):
        requires = ("logprobs",)

        def forward(self, inputs):
            seen.append(inputs)
            return inputs["logprobs"].sum() * 0 + float(len(inputs)), {}

    inputs = {"logprobs": torch.zeros(2, 3), "completion_mask": None}
    comp = ChannelComposer([Reads(name="a"), Reads(name="b", weight=2.0)])
    total, m = comp(inputs)
    assert [x is inputs for x in seen] == [True, True]
    assert float(total) == 6.0 and m["a/skipped"] == 0.0 and m["b/skipped"] == 0.0
    # a None value counts as absent, for the composer's check and for LossChannel.get alike
    assert Reads().missing_inputs({"logprobs": None}) == ["logprobs"]
    assert LossChannel.get("completion_mask", inputs, default=7) == 7
    with pytest.raises(TypeError):  # the default is keyword-only: a stale get(key, outputs, batch) is refused
        LossChannel.get("logprobs", inputs, {})


def test_a_channel_written_for_two_mappings_is_adapted_once_then_refused_where_it_is_defined(monkeypatch):
    """Plugin API 1 (``forward(model_outputs, batch)``): served through an adapter in 0.2.x with one
    ``DeprecationWarning`` naming its file:line; refused there once the adapter is removed (0.3.0)."""
    from composer_plugins.losses import base

    def make():
        class TwoDicts(LossChannel):
            requires = ("logprobs",)

            def forward(self, model_outputs, batch):
                return model_outputs["logprobs"].sum() * batch["scale"], {}

        return TwoDicts

    old = make()
    line = old.forward.__code__.co_firstlineno
    with pytest.warns(
        DeprecationWarning, match=rf"test_losses_channels.py:{line}: .*TwoDicts.forward\(model_outputs, batch\)"
    ):
        comp = ChannelComposer([old()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ChannelComposer([old()])  # once per class
        loss, _ = comp({"logprobs": torch.ones(2, 3), "scale": 2.0})
    assert float(loss) == 12.0
    monkeypatch.setattr(base, "adapters_served", lambda: False)
    refused = make()
    with pytest.raises(
        TypeError,
        match=rf"test_losses_channels.py:{line}: .*TwoDicts.forward\(model_outputs, batch\).*forward\(self, inputs\)",
    ):
        ChannelComposer([refused()])


def test_an_adapted_two_mapping_channel_reads_with_the_0_1_get_signature():
    """0.1's documented ``self.get(key, model_outputs, batch, default=None)`` reads the one mapping; a channel
    with its own ``get`` keeps it; new-form channels keep the keyword-only default."""

    class Old(LossChannel):
        requires = ("logprobs",)

        def forward(self, model_outputs, batch):
            scale = self.get("scale", model_outputs, batch, 3.0) + self.get("bias", model_outputs, batch, default=1.0)
            return self.get("logprobs", model_outputs, batch).sum() * scale, {}

    class OwnGet(LossChannel):
        def get(self, key, a, b):
            return 5.0

        def forward(self, model_outputs, batch):
            return torch.tensor(self.get("x", model_outputs, batch)), {}

    with pytest.warns(DeprecationWarning, match="Old.forward"):
        comp = ChannelComposer([Old(name="a")])
    assert float(comp({"logprobs": torch.ones(2), "bias": 2.0})[0]) == 10.0  # (3 + 2) * 2
    with pytest.warns(DeprecationWarning, match="OwnGet.forward"):
        assert float(ChannelComposer([OwnGet()])({})[0]) == 5.0
    with pytest.raises(TypeError):
        LossChannel.get("logprobs", {}, {})


def test_channel_constructor_validation():
    with pytest.raises(ValueError, match="unknown loss_type"):
        PolicyLossChannel(loss_type="ppo")
    with pytest.raises(ValueError, match="criterion"):
        HintDistillChannel(criterion="kl")
    with pytest.raises(ValueError, match="method"):
        ReplayPreferenceChannel(method="kto")
    with pytest.raises(ValueError, match="share the name"):
        ChannelComposer([PolicyLossChannel(loss_type="dapo"), PolicyLossChannel(loss_type="dapo")])


def test_an_optional_input_is_declared_beside_an_empty_alternative():
    """docs/losses.md "Optional inputs": ``input_options = (("old_logprobs",), ())`` asks the assembler for the
    input (the first group is built) and never skips the channel without it; ``self.get`` reads ``None`` then."""

    class Ratio(LossChannel):
        requires = ("logprobs",)
        input_options = (("old_logprobs",), ())

        def forward(self, inputs):
            old = self.get("old_logprobs", inputs)
            lp = inputs["logprobs"]
            return (lp - (lp.detach() if old is None else old)).exp().mean(), {"had_old": float(old is not None)}

    comp = ChannelComposer([Ratio(name="ratio")])
    assert comp.required_inputs() == ("logprobs", "old_logprobs")
    lp = torch.zeros(2, 3)
    _, m = comp({"logprobs": lp})
    assert m["ratio/skipped"] == 0.0 and m["ratio/had_old"] == 0.0
    loss, m = comp({"logprobs": lp, "old_logprobs": torch.full((2, 3), -1.0)})
    assert m["ratio/had_old"] == 1.0 and abs(float(loss) - math.e) < 1e-6
