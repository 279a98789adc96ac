"""The generalised JSD kernel's mixed-beta path (one exp per side, log of the mixture) against autograd.

The lean path forms ``log M = log((1-b) p + b q)`` from the probabilities instead of the logaddexp
of the log-probs; where both probabilities underflow in float32 it floors M. These tests hold it to
the float64 autograd reference of ``JSDKernel.value`` (the logaddexp form), also on peaked rows where
most of the vocabulary underflows on both sides.
"""

from __future__ import annotations

import pytest
import torch

from composer_plugins.kernels.divergences import JSDKernel


def _reference(zs: torch.Tensor, zt: torch.Tensor, go: torch.Tensor, k: JSDKernel) -> tuple[torch.Tensor, torch.Tensor]:
    z = zs.double().clone().requires_grad_(True)
    val = k.value(z, zt.double())
    (g,) = torch.autograd.grad(val, z, go.double())
    return val.detach(), g


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("spread", [2.0, 60.0])  # 60: most of each row underflows in float32 on both sides
def test_mixed_beta_values_and_gradients_match_the_float64_reference(beta, temperature, spread):
    g = torch.Generator().manual_seed(7)
    zs = torch.randn(6, 1000, generator=g) * spread
    zt = zs * 0.6 + torch.randn(6, 1000, generator=g) * spread
    go = torch.rand(6, generator=g) + 0.5
    k = JSDKernel(beta=beta, temperature=temperature)
    val, grad, _ = k.compute(zs.clone(), zt.clone(), go)
    ref_val, ref_grad = _reference(zs, zt, go, k)
    assert torch.isfinite(val).all() and grad is not None and torch.isfinite(grad).all()
    torch.testing.assert_close(val.double(), ref_val, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)


def test_mixed_beta_value_without_gradient_and_stats_shape():
    zs = torch.randn(3, 50) * 4
    zt = torch.randn(3, 50) * 4
    k = JSDKernel(beta=0.5)
    val, grad, st = k.compute(zs.clone(), zt.clone(), None, with_stats=True)
    assert grad is None and st is not None and st.shape == (3, 0)
    torch.testing.assert_close(val, k.value(zs, zt), rtol=1e-5, atol=1e-6)
    # identical distributions: zero divergence and zero gradient
    val, grad, _ = k.compute(zs.clone(), zs.clone(), torch.ones(3))
    assert float(val.abs().max()) < 1e-5 and grad is not None and float(grad.abs().max()) < 1e-6
