"""The LM-head kernels' GPU structure, proven on the CPU.

* Matmul count and dtype: a ``TorchDispatchMode`` records every ``mm``/``addmm``/``bmm``/``matmul`` that touches
  the student's head (an argument or the result has both the vocabulary and the hidden size as dimensions:
  the logits ``h @ W.T``, ``dL/dh = g @ W``, ``dL/dW = g.T @ h``) under ``torch.autocast("cpu", bfloat16)``: at
  most three per chunk, forward and backward together, each with bf16 inputs (the teacher's logits of a
  divergence are one more, no-grad). Before this change the log-probs took four (a recompute in backward) and
  every path accumulated dL/dW with an fp32 ``addmm_``.
* :func:`fused_logprobs` against the materialised path (logits of every token at once, autograd): loss and
  gradients (hidden and weight) for each policy loss type, gspo included (whole rows per chunk), the KL term,
  DPPO, a two-channel composition, a scaled loss, and the exact fallback when the loss is not the predicted one.
* The chunk size from the device's free memory (faked).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from composer_plugins.kernels import chunked as C
from composer_plugins.kernels.divergences import JSDKernel, TeacherTopKKernel
from composer_plugins.kernels.fused import fused_logprobs, row_bounds
from composer_plugins.kernels.teacher_topk import TeacherTopK, chunked_teacher_distill
from composer_plugins.losses.policy import DPPOChannel, PolicyLossChannel

V, H = 40, 24  # distinct from every row count below
MATMULS = {"mm", "addmm", "bmm", "matmul"}


class HeadMatmuls(TorchDispatchMode):
    """Records ``(op, input dtypes)`` of each matmul whose arguments or result have both V and H as dimensions."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__.rstrip("_")
        if name in MATMULS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            shapes = [tuple(t.shape) for t in (*tensors, out) if isinstance(t, torch.Tensor)]
            if any(V in s and H in s for s in shapes):
                self.ops.append((name, tuple(t.dtype for t in tensors)))
        return out


def _leaves(n_rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n_rows, H, generator=g) * 0.5).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.5).requires_grad_(True)
    return hidden, weight


def _bf16_only(ops) -> bool:
    return all(d == torch.bfloat16 for _, dts in ops for d in dts)


def test_fused_logprobs_three_bf16_matmuls_per_chunk_under_autocast():
    B, T = 2, 8  # 16 tokens, chunks of one row each
    hidden, weight = _leaves(B * T)
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5])

    def loss_fn(lp):
        return -(lp * adv.unsqueeze(-1)).sum()

    rec = HeadMatmuls()
    with torch.autocast("cpu", dtype=torch.bfloat16), rec:
        lp = fused_logprobs(hidden.view(B, T, H), weight, ids, mask, loss_fn, chunk_size=T)
        loss_fn(lp).backward()
    assert len(rec.ops) == 3 * B, rec.ops  # two chunks (one row each), three each
    assert _bf16_only(rec.ops), rec.ops
    assert weight.grad is not None and weight.grad.dtype == torch.float32 and hidden.grad is not None


def test_generic_chunked_logprobs_keeps_bf16_matmuls_with_its_recompute():
    """Without a known loss the per-token path recomputes (four a chunk), still all in the autocast dtype."""
    hidden, weight = _leaves(16)
    ids = torch.randint(0, V, (16,))
    rec = HeadMatmuls()
    with torch.autocast("cpu", dtype=torch.bfloat16), rec:
        C.chunked_logprobs(hidden, weight, ids, chunk_size=16).sum().backward()
    assert len(rec.ops) == 4 and _bf16_only(rec.ops), rec.ops


def test_precomputed_divergence_three_student_matmuls_and_one_teacher_in_bf16():
    hidden, weight = _leaves(32)
    t_hidden = torch.randn(32, H)
    t_weight = torch.randn(V, H)
    rec = HeadMatmuls()
    with torch.autocast("cpu", dtype=torch.bfloat16), rec:
        loss = C.chunked_distill(
            hidden,
            t_hidden,
            weight,
            JSDKernel(beta=0.5),
            teacher_lm_head_weight=t_weight,
            chunk_size=16,
            grad_mode="precompute",
        )
        loss.backward()
    assert len(rec.ops) == 2 * (3 + 1), rec.ops  # two chunks: logits, dL/dh, dL/dW + the teacher's logits
    assert _bf16_only(rec.ops), rec.ops
    assert weight.grad is not None and weight.grad.dtype == torch.float32


def test_teacher_topk_three_bf16_matmuls_per_chunk():
    B, T, K = 2, 8, 3
    hidden, weight = _leaves(B * T)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, 1, T, K), generator=g)
    lps = torch.log_softmax(torch.randn(B, 1, T, K, generator=g), -1) - 0.1
    scores = TeacherTopK(ids, lps, torch.ones(B, 1, T, dtype=torch.bool))
    rec = HeadMatmuls()
    with torch.autocast("cpu", dtype=torch.bfloat16), rec:
        out = chunked_teacher_distill(
            hidden.view(B, T, H), weight, scores, torch.ones(B, T), TeacherTopKKernel(), chunk_size=T
        )
        out.loss.backward()
    assert len(rec.ops) == 3 * B and _bf16_only(rec.ops), rec.ops


# ---------------------------------------------------------------------------------------------------------------
# fused log-probs == materialised, loss and gradients
# ---------------------------------------------------------------------------------------------------------------
def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 5
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    mask[3, :] = 0  # a row with no token
    mask[3, 0] = 1
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64) * 0.4
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4
    ids = torch.randint(0, V, (B, T), generator=g)
    old = (torch.log_softmax((hidden @ weight.T) / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)).detach()
    old = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)) * mask
    base = {
        "completion_mask": mask,
        "advantages": torch.tensor([1.0, -0.7, 0.4, 2.0], dtype=torch.float64),
        "old_logprobs": old,
        "inference_logprobs": old,
        "ref_logprobs": old - 0.2 * mask,
    }
    return hidden, weight, ids, mask, base


def _run(loss_fn, fused: bool, chunk_size: int = 4, scale: float = 1.0):
    hidden, weight, ids, mask, _ = _batch()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    if fused:
        lp = fused_logprobs(h, w, ids, mask, loss_fn, chunk_size=chunk_size, temperature=0.7)
    else:  # materialised: every token's logits at once, autograd
        lp = torch.log_softmax((h @ w.T) / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1) * mask
    loss = loss_fn(lp)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


def _channel_loss(channels):
    _, _, _, _, base = _batch()

    def loss_fn(lp):
        return sum(ch.weight * ch({**base, "logprobs": lp})[0] for ch in channels)

    return loss_fn


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "gspo"])
def test_fused_equals_materialised_for_each_policy_loss(loss_type):
    fn = _channel_loss([PolicyLossChannel(loss_type=loss_type, beta=0.05)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the saved gradients are used: no recompute
        fused = _run(fn, True)
    _assert_same(fused, _run(fn, False))
    assert float(fused[2].abs().sum()) > 0


def test_fused_equals_materialised_for_dppo_and_a_composition_with_a_scaled_loss():
    fn = _channel_loss([PolicyLossChannel(loss_type="gspo", weight=0.5), DPPOChannel(weight=2.0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fused = _run(fn, True, chunk_size=3, scale=0.25)  # scale: an accumulation divisor on the loss
    _assert_same(fused, _run(fn, False, scale=0.25))


def test_a_loss_other_than_the_predicted_one_falls_back_to_the_exact_recompute():
    fn = _channel_loss([PolicyLossChannel(loss_type="grpo")])

    def other(lp):  # what backward sees is not fn: not proportional per token
        return fn(lp) + (lp**2).sum()

    hidden, weight, ids, mask, _ = _batch()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with pytest.warns(RuntimeWarning, match="recomputing"):
        other(fused_logprobs(h, w, ids, mask, fn, chunk_size=4, temperature=0.7)).backward()
    ref = _run(other, False)
    torch.testing.assert_close(h.grad, ref[1], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(w.grad, ref[2], rtol=1e-9, atol=1e-11)


def test_row_bounds_hold_whole_rows():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    # tokens per row 3, 2, 0, 4, 1 -> flat ranges of whole rows, at most 5 tokens unless one row has more
    assert row_bounds(mask, 5) == [(0, 5), (5, 10)]
    assert row_bounds(mask, 3) == [(0, 3), (3, 5), (5, 9), (9, 10)]
    assert row_bounds(mask, 2) == [(0, 3), (3, 5), (5, 9), (9, 10)]
    assert row_bounds(torch.zeros(2, 3), 4) == []


def test_fused_logprobs_values_equal_chunked_and_bad_shapes_are_refused():
    hidden, weight, ids, mask, _ = _batch()
    lp = fused_logprobs(hidden, weight, ids, mask, lambda x: x.sum(), chunk_size=2)
    ref = C.chunked_logprobs(hidden, weight, ids, mask=mask.bool(), chunk_size=2)
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"\(B, T, H\)"):
        fused_logprobs(hidden[0], weight, ids[0], mask[0], lambda x: x.sum())
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(hidden, weight, ids, mask, lambda x: x.sum(), temperature=0)


# ---------------------------------------------------------------------------------------------------------------
# chunk size from the device's memory
# ---------------------------------------------------------------------------------------------------------------
def test_chunk_size_from_free_cuda_memory(monkeypatch):
    free = {"bytes": 100 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 141 << 30))
    assert C.auto_chunk_size(151_936, "cuda") == 1024  # an idle H200: the cap
    free["bytes"] = 8 << 30  # 2 GiB budget / (151,936 x 16 B) = 883 rows -> 880
    assert C.auto_chunk_size(151_936, "cuda") == 880
    free["bytes"] = 1 << 20
    assert C.auto_chunk_size(151_936, "cuda") == 16  # never below 16
    assert C.auto_chunk_size(151_936, free_bytes=8 << 30, fraction=0.5) == 1024
    assert C.resolve_chunk_size(None, 151_936, torch.device("cuda")) == 16
    assert C.resolve_chunk_size(7, 151_936, "cuda") == 7


def test_chunk_size_on_the_cpu_is_small():
    assert C.auto_chunk_size(151_936) == 96
    assert C.auto_chunk_size(151_936, "cpu") == 96
    assert C.auto_chunk_size(1000) == 256
    assert all(C.auto_chunk_size(v) % 16 == 0 for v in (50_000, 128_256, 151_936, 300_000))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        C.resolve_chunk_size(0, 100)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_fused_logprobs_with_no_gradient_or_no_token_use_the_saved_zeros():
    hidden, weight, ids, mask, _ = _batch()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

    def flat(x):  # dL/dlogp = 0 everywhere
        return (x * 0).sum()

    flat(fused_logprobs(h, w, ids, mask, flat, chunk_size=4)).backward()
    assert float(h.grad.abs().sum()) == 0.0 and float(w.grad.abs().sum()) == 0.0
    h.grad = w.grad = None
    lp = fused_logprobs(h, w, ids, torch.zeros_like(mask), lambda x: x.sum(), chunk_size=4)
    assert lp.shape == ids.shape and float(lp.detach().abs().sum()) == 0.0
    (lp.sum() + h.sum() * 0).backward()
    assert float(w.grad.abs().sum()) == 0.0


def test_under_autocast_only_the_matmul_is_bf16_the_rest_is_fp32():
    """The chunk's logits are the bf16 product upcast, then divided by the temperature in fp32 (a bf16 division
    would round the quotient again), and the log-softmax is fp32: the same as fp32 maths on the bf16 product."""
    hidden, weight = _leaves(16, seed=3)
    hidden = hidden.detach() * 4
    ids = torch.randint(0, V, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = C.chunked_logprobs(hidden, weight.detach(), ids, chunk_size=8, temperature=0.7)
    z = (hidden.bfloat16() @ weight.detach().bfloat16().T).float() / 0.7
    ref = torch.log_softmax(z, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref, rtol=1e-6, atol=1e-6)
