"""PRIME-RL backend: the ``teacher_distill`` term from the sample's teacher stream (``K = 1``, the sampled token)."""

from __future__ import annotations

import math

import pytest
import torch
from composer_plugins_prime_rl import backend as P

from composer_plugins.kernels.divergences import TeacherTopKKernel
from composer_plugins.kernels.teacher_topk import TeacherTopK, chunked_teacher_distill


@pytest.mark.parametrize(("divergence", "beta"), [("reverse_kl", 0.5), ("forward_kl", 0.5), ("jsd", 0.3)])
def test_teacher_term_is_the_channels_k1_case(divergence, beta):
    """The per-sample term is the channel on the same tokens with ``TeacherTopK.from_sampled`` (loss, gradient)."""
    g = torch.Generator().manual_seed(0)
    T, V, H = 7, 11, 5
    h = torch.randn(1, T, H, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    ids = torch.randint(V, (1, T), generator=g)
    teacher = torch.log(torch.rand(1, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    mask = torch.ones(1, T, dtype=torch.bool)
    mask[0, -2:] = False
    trainer = torch.log_softmax(h @ w.T, -1).gather(-1, ids[..., None])[..., 0]
    sample = P.samples_from_batch(trainer, trainer.detach(), torch.zeros(1), mask.float(), ref_logprobs=teacher)[0]
    base = P.loss_fn(sample).loss
    out = P.loss_fn(sample, teacher_weight=0.5, teacher_divergence=divergence, teacher_beta=beta)
    term = (out.loss - base) / 0.5
    (g_term,) = torch.autograd.grad(term, h, retain_graph=True)
    kernel = TeacherTopKKernel(divergence, beta)
    ref = chunked_teacher_distill(h, w, TeacherTopK.from_sampled(ids, teacher, mask), mask, kernel, denominator=1.0)
    (g_ref,) = torch.autograd.grad(ref.loss, h)
    torch.testing.assert_close(term, ref.loss)
    torch.testing.assert_close(g_term, g_ref)
    assert float(out.metrics["teacher_distill/skipped"]) == 0.0
    n = int(mask.sum())
    assert float(out.metrics["teacher_distill/divergence"]) == pytest.approx(float(ref.loss.detach()) / n)


def test_reverse_kl_by_hand():
    p, q = 0.5, 0.8
    s, t = torch.tensor([math.log(p)], requires_grad=True), torch.tensor([math.log(q)])
    sample = P.LossInputs(s, s.detach(), t, torch.zeros(1), torch.ones(1, dtype=torch.bool))
    out = P.loss_fn(sample, policy="dapo", teacher_weight=1.0)
    base = P.loss_fn(sample, policy="dapo").loss
    want = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert float((out.loss - base).detach()) == pytest.approx(want)


def test_config_maps_the_channel_and_refuses_what_one_stream_cannot_do():
    b = P.PrimeRLBackend(
        {"losses": {"dppo": 1.0, "teacher_distill": {"weight": 0.3, "divergence": "jsd", "beta": 0.2}}}
    )
    assert b.loss_kwargs["teacher_weight"] == 0.3 and b.loss_kwargs["teacher_divergence"] == "jsd"
    assert b.loss_kwargs["teacher_beta"] == 0.2
    with pytest.raises(Exception, match="one reference/teacher stream"):
        P.PrimeRLBackend({"losses": {"dppo": 1.0, "hint_distill": 0.5, "teacher_distill": 0.3}})
    with pytest.raises(Exception, match="one teacher"):
        P.PrimeRLBackend({"losses": {"dppo": 1.0, "teacher_distill": {"weight": 0.3, "min_agree": 2}}})


def test_local_mode_scores_the_teacher_stream_with_the_configs_teacher(tiny_model_dir, tmp_path):
    """``mode="local"``: the config's scorer gives each sampled token's teacher log-prob (``teacher_logprobs``)."""
    from composer_plugins.testing.teacher_data import build_tiny_chat_model

    teacher = build_tiny_chat_model(tmp_path / "teacher", vocab_size=260, seed=7)  # another tokenizer
    cfg = {
        "seed": 0,
        "output_dir": str(tmp_path / "out"),
        "cache_dir": str(tmp_path / "cache"),
        "model": {"name_or_path": tiny_model_dir},
        "env": {"class_path": "backend_envs.ToyAddEnv"},
        "sft": {"enabled": False},
        "rollout": {"prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6},
        "losses": {
            "dppo": 1.0,
            "grpo": False,
            "teacher_distill": {
                "weight": 0.5,
                "teachers": [{"kind": "causal_lm", "id": "t", "model_path": str(teacher), "topk": 4}],
            },
        },
        "optim": {"lr": 3e-3},
        "trainer": {"max_steps": 2, "num_threads": 1, "enable_progress_bar": False},
        "eval": {"num_problems": 2, "batch_size": 2, "k": 1, "num_samples": 1, "at_start": False, "at_end": False},
    }
    res = P.PrimeRLBackend(cfg).train()
    assert len(res.history) == 2
    for row in res.history:
        assert row["teacher_distill/skipped"] == 0.0
        assert math.isfinite(row["teacher_distill/divergence"]) and row["teacher_distill/divergence"] >= 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_teacher_stream_entry_is_left_out_never_a_nan_loss(bad):
    """A NaN / +inf teacher log-prob is no score: the term equals the stream without that token, counted."""
    g = torch.Generator().manual_seed(3)
    T = 6
    s = torch.log(torch.rand(1, T, generator=g, dtype=torch.float64) * 0.9 + 0.05).requires_grad_()
    teacher = torch.log(torch.rand(1, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    mask = torch.ones(1, T, dtype=torch.bool)
    broken = teacher.clone()
    broken[0, 2] = bad
    drop = mask.clone()
    drop[0, 2] = False
    kw = {"teacher_weight": 1.0, "policy": "dapo"}
    out = P.loss_fn(P.LossInputs(s[0], s[0].detach(), broken[0], torch.zeros(T, dtype=torch.float64), mask[0]), **kw)
    base = P.loss_fn(
        P.LossInputs(s[0], s[0].detach(), broken[0], torch.zeros(T, dtype=torch.float64), mask[0]), policy="dapo"
    ).loss
    want = P.loss_fn(P.LossInputs(s[0], s[0].detach(), teacher[0], torch.zeros(T, dtype=torch.float64), drop[0]), **kw)
    want_base = P.loss_fn(
        P.LossInputs(s[0], s[0].detach(), teacher[0], torch.zeros(T, dtype=torch.float64), drop[0]), policy="dapo"
    ).loss
    term, want_term = out.loss - base, want.loss - want_base
    assert torch.isfinite(term)
    torch.testing.assert_close(term, want_term)
    (grad,) = torch.autograd.grad(term, s)
    assert torch.isfinite(grad).all() and float(grad[0, 2]) == 0.0
    assert float(out.metrics["teacher_distill/nonfinite"]) == 1.0
    assert float(out.metrics["teacher_distill/divergence"]) == pytest.approx(
        float(want.metrics["teacher_distill/divergence"])
    )
