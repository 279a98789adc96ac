"""``rollout.compile``: sampling with a static KV cache and HF's compiled decode step.

* at temperature 0 the static-cache path gives the eager dynamic-cache path's tokens (prompts of
  different lengths, so the left padding to one cache shape is exercised), and it is the compiled call
  that ``generate`` chooses (HF's ``get_compiled_call``);
* where the compiled step fails, the model falls back to eager with one warning and the same tokens;
* ``auto`` is on for CUDA only; the config field takes ``auto``/``on``/``off`` (YAML booleans too) and refuses
  anything else naming the field and the choices; the built ``hf`` generator carries the setting.
"""

from __future__ import annotations

import pytest
import torch

from composer_plugins.models import generation as G
from composer_plugins.models.generation import compiles, generate_completions
from composer_plugins.models.tiny import TinyModelConfig, build_tiny_model, load_policy

CORPUS = [
    f"Question: Ann has {a} cats and {b} dogs.\nAnswer: {a + b}\n#### {a + b}" for a in range(1, 25) for b in range(9)
]
PROMPTS = ["Question: Ann has 3 cats", "Question: Ann has 12 cats and 4 dogs.\nAnswer:"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = TinyModelConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=128,
    )
    return build_tiny_model(cfg, CORPUS, tmp_path_factory.mktemp("tiny"))


def _greedy(model, tok, compile, **kw):
    ro = generate_completions(model, tok, PROMPTS, 2, max_new_tokens=12, do_sample=False, compile=compile, **kw)
    return ro


def test_static_cache_path_gives_the_eager_tokens_and_uses_the_compiled_call(tiny_dir, monkeypatch):
    model, tok = load_policy(tiny_dir)
    eager = _greedy(model, tok, "off")
    assert not hasattr(model, "_cache")  # the eager path keeps no cache on the model
    chosen = []

    def compiled_call(compile_config):  # HF's choice of the compiled decode step, run uncompiled here
        chosen.append(compile_config)
        return model.__call__

    monkeypatch.setattr(model, "get_compiled_call", compiled_call)
    for max_prompt_length in (None, 40):
        static = _greedy(model, tok, "on", max_prompt_length=max_prompt_length)
        assert torch.equal(static.completion_ids, eager.completion_ids)
        assert torch.equal(static.completion_mask, eager.completion_mask)
        assert torch.equal(static.prompt_ids, eager.prompt_ids)  # the cache's left padding is not returned
        assert static.completions == eager.completions
    from transformers import StaticCache

    assert chosen and type(model._cache) is StaticCache
    assert model._cache.max_cache_len >= 40 + 12  # sized for max_prompt_length + max_new_tokens
    model.train()  # the training mode is restored after sampling
    _greedy(model, tok, "on")
    assert model.training


def test_a_failing_compile_falls_back_to_eager_with_one_warning(tiny_dir, monkeypatch):
    model, tok = load_policy(tiny_dir)
    eager = _greedy(model, tok, "off")
    sampled = generate_completions(model, tok, PROMPTS, 2, max_new_tokens=12, seed=5)

    def broken(*a, **k):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(model, "get_compiled_call", lambda cc: broken)
    with pytest.warns(RuntimeWarning, match="compiled decode step failed .RuntimeError: no C.. compiler") as rec:
        first = _greedy(model, tok, "on")
        second = _greedy(model, tok, "on")
        again = generate_completions(model, tok, PROMPTS, 2, max_new_tokens=12, seed=5, compile="on")
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1
    assert torch.equal(first.completion_ids, eager.completion_ids) and torch.equal(
        second.completion_ids, eager.completion_ids
    )
    assert torch.equal(again.completion_ids, sampled.completion_ids)  # the same seeded samples as eager
    assert model in G._EAGER_ONLY and not hasattr(model, "_cache")


def test_auto_compiles_on_cuda_only_and_modes_are_checked():
    assert compiles("auto", torch.device("cuda")) and not compiles("auto", torch.device("cpu"))
    assert compiles("on", torch.device("cpu")) and not compiles("off", torch.device("cuda"))
    with pytest.raises(ValueError, match="compile='fast': expected one of auto, on, off"):
        compiles("fast", torch.device("cpu"))


def test_rollout_compile_config_field_and_the_built_generator():
    from composer_plugins.core.errors import ConfigError
    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.rollout.multiturn import build_generator
    from composer_plugins.training.rollout.rollouts import HFGenerator

    for text, want in (("", "auto"), ("{compile: on}", "on"), ("{compile: off}", "off"), ("{compile: auto}", "auto")):
        cfg, src = loads_train_config(f"rollout: {text or '{}'}")
        assert cfg.rollout.compile == want
        gen = build_generator(cfg, src)
        assert isinstance(gen, HFGenerator) and gen.compile == want
    cfg, src = loads_train_config("rollout: {compile: on, generator: {name: hf, compile: off}}")
    assert build_generator(cfg, src).compile == "off"  # the generator's own setting wins
    with pytest.raises(ConfigError, match=r"rollout\.compile: expected one of 'auto', 'on', 'off'.*got 'fast'"):
        loads_train_config("rollout: {compile: fast}")
    with pytest.raises(ValueError, match="HFGenerator.compile='yes'.: expected one of auto, on, off"):
        HFGenerator("yes")
