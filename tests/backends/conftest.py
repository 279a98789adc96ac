"""Fixtures for the backend tests: a tiny Qwen2 policy with a locally trained tokenizer (built once)."""

from __future__ import annotations

import pytest

CORPUS = [f"Q: {a}+{b}=? A: {a + b}" for a in range(25) for b in range(25)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny causal LM + tokenizer written with save_pretrained (loaded back with from_pretrained)."""
    import torch

    from composer_plugins.models.tiny import TinyModelConfig, build_tiny_model

    torch.set_num_threads(2)
    cfg = TinyModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                          num_kv_heads=1, max_position_embeddings=128)  # fmt: skip
    return str(build_tiny_model(cfg, CORPUS, tmp_path_factory.mktemp("tiny")))
