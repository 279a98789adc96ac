"""The in-process rollout generator (``rollout.generator: hf``) with the policy on the training device."""

from __future__ import annotations

import pytest
import torch
from gpu_support import DEVICES

from composer_plugins.models.tiny import TinyModelConfig, build_tiny_model, load_policy

CORPUS = [f"Q: {a}+{b}=? A: {a + b}" for a in range(20) for b in range(20)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    cfg = TinyModelConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=128,
    )
    return str(build_tiny_model(cfg, CORPUS, tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("device", DEVICES)
def test_hf_generator_samples_on_the_device_and_is_seeded(device, tiny_dir):
    from composer_plugins.models.logprobs import completion_logprobs
    from composer_plugins.training.rollout.rollouts import HFGenerator

    policy, tok = load_policy(tiny_dir)
    policy.to(device)
    gen = HFGenerator()
    prompts = ["Q: 3+4=? A:", "Q: 10+12=? A:"]
    kw = {"seed": 7, "temperature": 1.0, "max_new_tokens": 12}
    a = gen.generate(policy, tok, prompts, 3, **kw)
    b = gen.generate(policy, tok, prompts, 3, **kw)
    for t in (a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask, a.group_index):
        assert t.device.type == device
    assert a.completion_ids.shape[0] == 6 and len(a.completions) == 6
    assert a.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(a.completion_ids, b.completion_ids)  # the same seed samples the same tokens
    assert int(a.completion_mask.sum()) > 0
    lp = completion_logprobs(policy, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask)
    assert isinstance(lp, torch.Tensor) and lp.device.type == device
    assert torch.isfinite(lp).all() and (lp[a.completion_mask.bool()] <= 0).all()


@pytest.mark.gpu
def test_compiled_decode_on_cuda_gives_the_eager_tokens_at_temperature_0(tiny_dir):
    """``rollout.compile: auto`` on CUDA: a static cache and HF's compiled decode step (really compiled here),
    the eager path's tokens at temperature 0, no fallback warning."""
    import warnings

    from composer_plugins.models import generation as G

    policy, tok = load_policy(tiny_dir)
    policy.to("cuda")
    prompts = ["Q: 3+4=? A:", "Q: 10+12=? A:"]
    kw = {"do_sample": False, "max_new_tokens": 16, "max_prompt_length": 32}
    eager = G.generate_completions(policy, tok, prompts, 2, compile="off", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed compile warns and falls back
        compiled = G.generate_completions(policy, tok, prompts, 2, compile="auto", **kw)
        again = G.generate_completions(policy, tok, prompts, 2, compile="auto", **kw)
    assert hasattr(policy, "_compiled_call") and policy not in G._EAGER_ONLY
    assert torch.equal(compiled.completion_ids, eager.completion_ids)
    assert torch.equal(again.completion_ids, eager.completion_ids)  # the cache reused, reset between calls
