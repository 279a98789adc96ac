"""The training step's fused log-probs: when every active channel reading ``logprobs`` declares ``row_separable``
(the GRPO family, DPPO), the assembler's log-prob builder forms their LM-head gradients in the forward pass
(:func:`~composer_plugins.kernels.fused.fused_logprobs`); the composed loss and every parameter's gradient equal
the generic path's. A channel that reads ``logprobs`` without declaring it keeps the generic path."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from composer_plugins.losses import functional as fused
from composer_plugins.losses.base import ChannelComposer, LossChannel
from composer_plugins.losses.policy import DPPOChannel, PolicyLossChannel
from composer_plugins.models.tiny import TinyModelConfig, make_model_config
from composer_plugins.training.step.assemble import StepPolicy, assemble_inputs
from composer_plugins.training.step.record import StepRecord


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    tiny = TinyModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    return Qwen2ForCausalLM(make_model_config(tiny, vocab_size=48, pad_id=0, bos_id=1, eos_id=2)).double()


def _record(old: bool) -> StepRecord:
    g = torch.Generator().manual_seed(3)
    rows, width = 4, 6
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    extra = {"old_logprobs": -torch.rand(rows, width, generator=g, dtype=torch.float64) * 4 * mask} if old else {}
    return StepRecord(
        tasks=[{"prompt": "p"}],
        prompts=["p"] * rows,
        completions=["c"] * rows,
        prompt_ids=torch.randint(3, 48, (rows, 3), generator=g),
        prompt_mask=torch.ones(rows, 3, dtype=torch.long),
        completion_ids=torch.randint(3, 48, (rows, width), generator=g),
        completion_mask=mask,
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64),
        num_generations=rows,
        ref_logprobs=-torch.rand(rows, width, generator=g, dtype=torch.float64) * 3 * mask,
        **extra,
    )


def _step(model, channels, record, monkeypatch, separable: bool):
    calls = []
    real = fused.fused_logprobs
    monkeypatch.setattr(fused, "fused_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    for ch in channels:
        ch.row_separable = separable and type(ch).row_separable
    model.zero_grad()
    composer = ChannelComposer(channels)
    policy = StepPolicy(model=model, tokenizer=None, temperature=0.8, chunk_size=7)
    inputs, _ = assemble_inputs(record, composer, policy)
    loss, _ = composer(inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], len(calls)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the saved gradients are used, no recompute
@pytest.mark.parametrize("old", [True, False], ids=["old_logprobs", "on_policy"])
def test_the_step_uses_the_fused_path_with_the_generic_paths_loss_and_gradients(model, monkeypatch, old):
    def channels():
        return [
            PolicyLossChannel(loss_type="gspo", weight=0.5),
            PolicyLossChannel(loss_type="dapo", beta=0.1, name="dapo_kl"),
            DPPOChannel(weight=0.3),
        ]

    rec = _record(old)
    loss_f, grads_f, n_fused = _step(model, channels(), rec, monkeypatch, True)
    loss_g, grads_g, n_generic = _step(model, channels(), rec, monkeypatch, False)
    assert (n_fused, n_generic) == (1, 0)
    torch.testing.assert_close(loss_f, loss_g, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads_f, grads_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    assert sum(float(a.abs().sum()) for a in grads_f) > 0


class SquaredSum(LossChannel):
    """Reads ``logprobs`` without declaring ``row_separable`` (its loss is not a sum over rows)."""

    requires: ClassVar[tuple[str, ...]] = ("logprobs", "completion_mask")

    def forward(self, inputs):
        return (inputs["logprobs"] * inputs["completion_mask"]).sum() ** 2 * 1e-3, {}


def test_a_channel_that_does_not_declare_separability_keeps_the_generic_path(model, monkeypatch):
    rec = _record(True)
    chans = [PolicyLossChannel(loss_type="grpo"), SquaredSum(name="sq")]
    loss, grads, n = _step(model, chans, rec, monkeypatch, True)
    assert n == 0
    assert torch.isfinite(loss) and sum(float(g.abs().sum()) for g in grads) > 0
