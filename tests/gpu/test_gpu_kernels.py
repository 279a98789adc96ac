"""The chunked LM-head kernels on the device the user trains on: equal to the materialised path and to Liger.

On CUDA at a Qwen2.5-0.5B head (V = 151,936, H = 896, 2 × 512 tokens), on the CPU at a tiny head (the
same code path, in CI): per-token log-probs (:func:`chunked_logprobs` against ``selective_log_softmax`` of
the full logits) and the ``hint_distill`` divergence (hidden-state path against the logits path of the same
channel, full vocabulary and ``topk: 100``), loss and both gradients, in fp32 and bf16; and the channel's
own chunked jsd against Liger-Kernel's fused linear JSD (``kernels: liger``, ``torch.compile``-d on CUDA).

bf16 is compared against the fp32 computation on the same (bf16-rounded) inputs: both paths must stay
within bf16's rounding of the logits, the chunked one no further than the materialised one plus a margin.
"""

from __future__ import annotations

import pytest
import torch
from gpu_support import DEVICES, QWEN_VOCAB, sync

from composer_plugins.kernels.chunked import chunked_logprobs
from composer_plugins.losses import functional as LF
from composer_plugins.losses.distill import HintDistillChannel

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.fixture(autouse=True)
def exact_fp32_matmul():
    """fp32 means fp32 here (no TF32), whatever an earlier test in this process set."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|."""
    return (a - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)


def _shape(device: str) -> dict[str, int]:
    if device == "cuda":
        return {"B": 2, "T": 512, "H": 896, "V": QWEN_VOCAB}
    return {"B": 2, "T": 24, "H": 32, "V": 5003}


def _inputs(device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    s = _shape(device)
    g = torch.Generator(device=device).manual_seed(seed)
    B, T, H, V = s["B"], s["T"], s["H"], s["V"]
    weight = (torch.randn(V, H, generator=g, device=device) * H**-0.5).to(dtype)
    hidden = (torch.randn(B, T, H, generator=g, device=device) * 2.0).to(dtype)
    teacher = (0.8 * hidden.float() + 0.6 * torch.randn(B, T, H, generator=g, device=device)).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g, device=device)
    mask = torch.rand(B, T, generator=g, device=device) > 0.2
    return {"weight": weight, "hidden": hidden, "teacher": teacher, "ids": ids, "mask": mask}


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}


def _logprob_loss(x: dict[str, torch.Tensor], chunked: bool, upcast: bool = False) -> list[torch.Tensor]:
    w = x["weight"].detach().clone()
    h = x["hidden"].detach().clone()
    if upcast:
        w, h = w.float(), h.float()
    w.requires_grad_(True)
    h.requires_grad_(True)
    if chunked:
        lp = chunked_logprobs(h, w, x["ids"], chunk_size=256, temperature=0.9)
    else:
        lp = LF.selective_log_softmax(h @ w.T, x["ids"], temperature=0.9)
    assert isinstance(lp, torch.Tensor)
    loss = (lp.float() * x["mask"]).sum() / x["mask"].sum()
    loss.backward()
    return [lp.detach().float(), loss.detach().float(), h.grad.float(), w.grad.float()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_chunked_logprobs_equal_the_materialised_logits(device, dtype):
    x = _inputs(device, dtype)
    chunked = _logprob_loss(x, chunked=True)
    plain = _logprob_loss(x, chunked=False)
    sync(device)
    if dtype == torch.float32:
        for a, b in zip(chunked, plain, strict=True):
            torch.testing.assert_close(a, b, **_tol(dtype))
        return
    exact = _logprob_loss(x, chunked=False, upcast=True)  # fp32 maths on the same bf16 inputs
    for name, a, b, ref in zip(("logprobs", "loss", "grad_hidden", "grad_weight"), chunked, plain, exact, strict=True):
        # the chunked path accumulates in fp32 inside a chunk: never much worse than the bf16 logits path
        err_chunked, err_plain = _rel_err(a, ref), _rel_err(b, ref)
        assert err_chunked <= max(2.0 * err_plain, 2e-2), (name, err_chunked, err_plain)


def _fused_step(x: dict[str, torch.Tensor], fused: bool, autocast: bool) -> list[torch.Tensor]:
    """The training step's log-probs under ``torch.autocast`` (fp32 parameters, as Lightning's bf16-mixed)."""
    w = x["weight"].detach().float().clone().requires_grad_(True)
    h = x["hidden"].detach().float().clone().requires_grad_(True)
    mask = x["mask"]
    adv = torch.linspace(-1.0, 1.0, mask.shape[0], device=mask.device).unsqueeze(-1)

    def loss_fn(lp: torch.Tensor) -> torch.Tensor:
        return -(lp.float() * adv * mask).sum() / mask.sum()

    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
        if fused:  # chunk size from the device's free memory (1,024 rows on an idle H200)
            lp = LF.fused_logprobs(h, w, x["ids"], mask, loss_fn, temperature=0.9)
        else:
            lp = LF.selective_log_softmax(h @ w.T, x["ids"], temperature=0.9) * mask
        loss = loss_fn(lp)
    loss.backward()
    return [loss.detach().float(), h.grad.float(), w.grad.float()]


@pytest.mark.parametrize("device", DEVICES)
def test_fused_logprobs_under_bf16_autocast_stay_within_the_materialised_paths_rounding(device):
    x = _inputs(device, torch.float32)
    fused, plain = _fused_step(x, True, True), _fused_step(x, False, True)
    exact = _fused_step(x, False, False)
    sync(device)
    for name, a, b, ref in zip(("loss", "grad_hidden", "grad_weight"), fused, plain, exact, strict=True):
        err_fused, err_plain = _rel_err(a, ref), _rel_err(b, ref)
        assert err_fused <= max(2.0 * err_plain, 2e-2), (name, err_fused, err_plain)


def _distill(
    x: dict[str, torch.Tensor], topk: int | None, hidden_path: bool, kernels: str = "torch", upcast: bool = False
) -> list[torch.Tensor]:
    w = x["weight"].detach().clone()
    h = x["hidden"].detach().clone()
    t = x["teacher"].detach()
    if upcast:
        w, h, t = w.float(), h.float(), t.float()
    w.requires_grad_(True)
    h.requires_grad_(True)
    ch = HintDistillChannel(criterion="jsd", beta=0.5, temperature=1.0, topk=topk, kernels=kernels, chunk_size=256)
    mask = x["mask"].float()
    if hidden_path:
        loss, metrics = ch({"student_hidden": h, "teacher_hidden": t, "lm_head_weight": w, "hint_mask": mask})
        assert metrics["chunked"] == 1.0 and metrics.get("liger", 0.0) == (1.0 if kernels == "liger" else 0.0)
    else:
        loss, metrics = ch({"student_logits": h @ w.T, "teacher_logits": (t @ w.T).detach(), "hint_mask": mask})
        assert metrics["chunked"] == 0.0
    loss.backward()
    return [loss.detach().float(), h.grad.float(), w.grad.float()]


@pytest.mark.parametrize("topk", [None, 100], ids=["full_vocab", "top100"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_chunked_hint_distill_equals_the_materialised_logits(device, dtype, topk):
    x = _inputs(device, dtype, seed=1)
    chunked = _distill(x, topk, hidden_path=True)
    plain = _distill(x, topk, hidden_path=False)
    sync(device)
    assert chunked[0].item() > 0
    if dtype == torch.float32:
        for a, b in zip(chunked, plain, strict=True):
            torch.testing.assert_close(a, b, **_tol(dtype))
        return
    exact = _distill(x, topk, hidden_path=False, upcast=True)
    for name, a, b, ref in zip(("loss", "grad_hidden", "grad_weight"), chunked, plain, exact, strict=True):
        err_chunked, err_plain = _rel_err(a, ref), _rel_err(b, ref)
        assert err_chunked <= max(2.0 * err_plain, 3e-2), (name, err_chunked, err_plain)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_chunked_jsd_equals_ligers_fused_linear_jsd(device, dtype):
    """``kernels: torch`` (the project's chunked jsd) = ``kernels: liger`` (Liger-Kernel, compiled on CUDA).

    fp32: equal. bf16: Liger keeps the logits and the divergence in bf16 where the chunked kernel accumulates
    in fp32, so both are compared with the fp32 computation on the same inputs: ours is at least as close.
    """
    x = _inputs(device, dtype, seed=2)
    ours = _distill(x, None, hidden_path=True, kernels="torch")
    liger = _distill(x, None, hidden_path=True, kernels="liger")
    sync(device)
    names = ("loss", "grad_hidden", "grad_weight")
    if dtype == torch.float32:
        for name, a, b in zip(names, ours, liger, strict=True):
            assert _rel_err(b, a) <= 1e-4, (name, _rel_err(b, a))
        return
    exact = _distill(x, None, hidden_path=True, kernels="torch", upcast=True)
    for name, a, b, ref in zip(names, ours, liger, exact, strict=True):
        err_ours, err_liger = _rel_err(a, ref), _rel_err(b, ref)
        assert err_liger <= 0.25, (name, err_liger)  # the same quantity, at bf16's precision
        assert err_ours <= max(1.5 * err_liger, 2e-2), (name, err_ours, err_liger)
