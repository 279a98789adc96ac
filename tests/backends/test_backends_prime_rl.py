"""PRIME-RL backend: the custom loss against PRIME-RL's per-sample contract (stand-ins; prime-rl is not on PyPI)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from composer_plugins_prime_rl import backend as P
from torch import Tensor

from composer_plugins.losses import functional as F

ROOT = Path(__file__).resolve().parents[2]


def _upstream_default_loss_fn():
    """PRIME-RL's ``default_loss_fn`` restated as upstream runs it (one 1-D sample), from tests/losses: the
    parity below compares the adapter with it, not with the project's own ``dppo_kl_loss`` that the adapter calls."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "losses"))
    try:
        from test_losses_dppo import upstream_default_loss_fn
    finally:
        sys.path.pop(0)
    return upstream_default_loss_fn


# Field layout of prime_rl.trainer.rl.loss.LossInputs / LossOutputs at commit 559b447 (read from the source).
UPSTREAM_INPUT_FIELDS = [
    ("trainer_logprobs", False),
    ("inference_logprobs", False),
    ("ref_logprobs", False),
    ("advantages", False),
    ("loss_mask", False),
    ("loss_weights", True),
]


@dataclass
class OldLossInputs:
    """LossInputs before PRIME-RL commit 0be5ac4 (the reference stream was called teacher_logprobs)."""

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    teacher_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor


def import_object(dotted_path: str):
    """PRIME-RL's ``prime_rl.utils.utils.import_object`` (how ``[trainer.loss] import_path`` is resolved)."""
    module_path, _, name = dotted_path.rpartition(".")
    return getattr(importlib.import_module(module_path), name)


def _sample(seed: int, n: int = 9, with_ref: bool = False, with_weights: bool = False):
    g = torch.Generator().manual_seed(seed)
    inference = -torch.rand(n, generator=g) * 3
    trainer = (inference + 0.4 * torch.randn(n, generator=g)).clamp(max=-1e-3).requires_grad_(True)
    adv = torch.full((n,), float(torch.randn(1, generator=g)))
    mask = torch.ones(n, dtype=torch.bool)
    mask[0] = False  # a prompt/observation token inside the sample
    ref = (inference + 0.3 * torch.randn(n, generator=g)).clamp(max=-1e-3) if with_ref else None
    w = torch.rand(n, generator=g) if with_weights else None
    return P.LossInputs(
        trainer_logprobs=trainer,
        inference_logprobs=inference,
        ref_logprobs=ref,
        advantages=adv,
        loss_mask=mask,
        loss_weights=w,
    )


def test_stand_ins_are_structurally_identical_to_prime_rl():
    if P.USING_PRIME_RL:  # the real classes are in use: compare them to the layout we implemented from
        pass
    fields = dataclasses.fields(P.LossInputs)
    assert [(f.name, f.default is None) for f in fields] == UPSTREAM_INPUT_FIELDS
    assert [f.name for f in dataclasses.fields(P.LossOutputs)] == ["loss", "metrics"]
    assert P.PRIME_RL_COMMIT in (P.__doc__ or "")  # the docstring cites the commit the interface was read from


@pytest.mark.parametrize("with_weights", [False, True])
def test_default_equals_prime_rls_default_loss_per_sample(with_weights):
    upstream = _upstream_default_loss_fn()
    for seed in range(6):
        s = _sample(seed, with_ref=seed % 2 == 0, with_weights=with_weights)
        out = P.loss_fn(s)  # the extra channels are off by default
        # PRIME-RL's DefaultLossConfig defaults: dppo_mask_low = dppo_mask_high = 0.2, adv_tau 1, kl_tau 1e-3
        ref_loss, ref_metrics = upstream(
            s.trainer_logprobs, s.inference_logprobs, s.advantages, s.loss_mask, 0.2, 0.2, 1.0, 1e-3, s.loss_weights
        )
        assert isinstance(out, P.LossOutputs)
        assert float(ref_loss.detach().abs()) > 1e-4  # a loss that a doubling can be seen in
        torch.testing.assert_close(out.loss, ref_loss)
        (g1,) = torch.autograd.grad(out.loss, s.trainer_logprobs)
        (g2,) = torch.autograd.grad(ref_loss, s.trainer_logprobs)
        torch.testing.assert_close(g1, g2)
        for k in (
            "masked_mismatch_kl",
            "unmasked_mismatch_kl",
            "is_masked",
            "is_masked_low",
            "is_masked_high",
            "masked_advantage_positive",
            "masked_advantage_negative",
        ):
            assert out.metrics[k].dim() == 0
            torch.testing.assert_close(out.metrics[k], torch.as_tensor(ref_metrics[k]).float())


def test_prime_rl_aggregation_over_a_batch_equals_the_upstream_token_mean():
    B, T = 5, 8
    g = torch.Generator().manual_seed(0)
    inference = -torch.rand(B, T, generator=g) * 2
    trainer = (inference + 0.3 * torch.randn(B, T, generator=g)).requires_grad_(True)
    adv = torch.randn(B, generator=g).unsqueeze(-1).expand(B, T)
    mask = torch.ones(B, T, dtype=torch.bool)
    for b, n in enumerate([8, 3, 6, 8, 1]):
        mask[b, n:] = False
    samples = P.samples_from_batch(trainer, inference, adv, mask)
    loss, metrics = P.aggregate(samples)  # Σ per-sample loss / global loss-token count (rl_scale)
    expected = F.dppo_kl_loss(trainer, inference, adv, mask).loss / mask.sum()
    torch.testing.assert_close(loss, expected)
    # and PRIME-RL's own per-sample loss (restated), summed and divided by the loss tokens
    upstream = _upstream_default_loss_fn()
    total = sum(upstream(trainer[b], inference[b], adv[b], mask[b], 0.2, 0.2, 1.0, 1e-3, None)[0] for b in range(B))
    torch.testing.assert_close(loss, total / mask.sum())
    assert metrics["is_masked"].shape == (B,)


@pytest.mark.parametrize("policy", ["dapo", "cispo", "gspo"])
def test_other_policies_are_our_functional_token_sums(policy):
    s = _sample(11, with_weights=True)
    out = P.loss_fn(s, policy=policy, epsilon_low=0.2, epsilon_high=0.28)
    ref = F.policy_loss(
        s.trainer_logprobs[None],
        s.inference_logprobs[None],
        s.advantages[None],
        s.loss_mask[None],
        loss_type="cispo" if policy == "cispo" else "dapo",
        epsilon_low=0.2,
        epsilon_high=0.28,
        importance_sampling_level="sequence" if policy == "gspo" else "token",
        num_items_in_batch=1.0,
        importance_sampling_ratio=s.loss_weights[None],
    )
    torch.testing.assert_close(out.loss, ref.loss)
    with pytest.raises(Exception, match="unknown policy"):
        P.loss_fn(s, policy="ppo")


def test_hint_channel_uses_ref_logprobs_and_the_older_teacher_field():
    s = _sample(3, with_ref=True)
    base = P.loss_fn(s).loss
    out = P.loss_fn(s, hint_weight=0.5, hint_estimator="k3")
    kl = (F.kl_estimate(s.trainer_logprobs, s.ref_logprobs, "k3") * s.loss_mask).sum()
    torch.testing.assert_close(out.loss, base + 0.5 * kl)
    assert float(out.metrics["hint/skipped"]) == 0.0
    # without a reference stream the channel reports itself skipped and adds nothing
    no_ref = dataclasses.replace(s, ref_logprobs=None)
    out2 = P.loss_fn(no_ref, hint_weight=0.5)
    torch.testing.assert_close(out2.loss, base)
    assert float(out2.metrics["hint/skipped"]) == 1.0
    # the pre-0be5ac4 layout: teacher_logprobs, no loss_weights
    old = OldLossInputs(s.trainer_logprobs, s.inference_logprobs, s.ref_logprobs, s.advantages, s.loss_mask)
    torch.testing.assert_close(P.loss_fn(old).loss, base)
    torch.testing.assert_close(P.loss_fn(old, hint_weight=0.5).loss, out.loss)
    olds = P.samples_from_batch(
        s.trainer_logprobs[None],
        s.inference_logprobs[None],
        s.advantages[None],
        s.loss_mask[None],
        s.ref_logprobs[None],
        cls=OldLossInputs,
    )
    assert isinstance(olds[0], OldLossInputs) and olds[0].teacher_logprobs is not None


def test_example_toml_wires_our_loss_the_way_prime_rl_does():
    cfg = tomllib.loads((ROOT / "examples" / "backends" / "prime_rl_composer.toml").read_text())
    loss_cfg = cfg["trainer"]["loss"]
    assert loss_cfg["type"] == "custom"
    custom_fn = import_object(loss_cfg["import_path"])
    assert custom_fn is P.loss_fn
    # setup_rl_loss_fn: custom_fn(inputs, **kwargs); every kwarg must be a parameter of ours
    params = inspect.signature(custom_fn).parameters
    assert set(loss_cfg["kwargs"]) <= set(params)
    s = _sample(5)
    out = custom_fn(s, **loss_cfg["kwargs"])
    torch.testing.assert_close(
        out.loss, F.dppo_kl_loss(s.trainer_logprobs, s.inference_logprobs, s.advantages, s.loss_mask).loss
    )
    # the import path is the distribution's package (lazy: it loads the backend module on first use)
    assert loss_cfg["import_path"] == P.IMPORT_PATH == "composer_plugins_prime_rl.loss_fn"
    assert import_object("composer_plugins_prime_rl.backend.loss_fn") is P.loss_fn


def test_backend_toml_and_refusals(tmp_path):
    b = P.PrimeRLBackend(
        {"losses": {"dppo": {"weight": 1.0, "kl_tau": 0.01}}, "output_dir": str(tmp_path)}, mode="prime-rl"
    )
    cfg = tomllib.loads(b.toml())
    assert cfg["trainer"]["loss"] == {
        "type": "custom",
        "import_path": P.IMPORT_PATH,
        "kwargs": {"policy": "dppo", "kl_tau": 0.01},
    }
    # hint_distill runs in mode='local' only: upstream, its reference stream never reaches the custom loss
    hinted = P.PrimeRLBackend({"losses": {"dppo": 1.0, "hint_distill": {"weight": 0.25}}})
    assert hinted.loss_kwargs["hint_weight"] == 0.25
    with pytest.raises(Exception, match=r"losses\.hint_distill: .*mode='prime-rl'.*ref_kl"):
        hinted.toml()
    if not P.USING_PRIME_RL:
        with pytest.raises(Exception, match="needs prime-rl installed"):
            b.train()
    with pytest.raises(Exception, match=r"losses\.replay_dpo: .*cannot run in the prime_rl backend"):
        P.PrimeRLBackend({"losses": {"dppo": 1.0, "replay_dpo": {"weight": 0.1}}})
