"""``compute.kernels``: the pick per device and memory (faked), refused typos with the closest name, and the pick
reaching the run's log and its MLflow params through ``ComposerModule.on_train_start``."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from composer_plugins.core.errors import ConfigError
from composer_plugins.losses.functional import KERNEL_SETTINGS, pick_kernels
from composer_plugins.training.lightning.tracking import log_kernel_pick

QWEN_V = 151_936
GIB = 1 << 30


def test_auto_picks_per_device_and_memory():
    big = {"vocab": QWEN_V, "tokens": 64 * 512}  # 80 GB of logits
    p = pick_kernels("auto", device="cuda", free_bytes=100 * GIB, **big)
    assert (p.kernels, p.chunk_size) == ("chunked", 1024) and "exceed" in p.reason
    assert pick_kernels("auto", device="cuda", free_bytes=100 * GIB, liger=True, **big).kernels == "liger"
    p = pick_kernels("auto", vocab=QWEN_V, tokens=256, device="cuda", free_bytes=100 * GIB)  # 0.6 GB: fits
    assert (p.kernels, p.chunk_size) == ("materialised", 256) and "fit" in p.reason
    p = pick_kernels("auto", vocab=QWEN_V, tokens=256, device="cuda", free_bytes=2 * GIB)  # 0.5 GiB budget: not
    assert (p.kernels, p.chunk_size) == ("chunked", 208)
    # the CPU: small chunks, a tiny vocabulary's step materialised; no Liger off CUDA even when installed
    assert pick_kernels("auto", vocab=QWEN_V, tokens=4096, liger=True).kernels == "chunked"
    assert pick_kernels("auto", vocab=QWEN_V, tokens=4096).chunk_size == 96
    assert pick_kernels("auto", vocab=300, tokens=96, device="cpu").kernels == "materialised"
    assert pick_kernels("auto", vocab=300, tokens=96, chunk_size=32).chunk_size == 32  # given: chunked at it


def test_explicit_settings_and_refusals():
    assert set(KERNEL_SETTINGS) == {"auto", "materialised", "chunked", "liger"}
    assert pick_kernels("materialised", vocab=QWEN_V, tokens=4096).chunk_size == 4096
    assert pick_kernels("chunked", vocab=QWEN_V, tokens=4096, device="cuda", free_bytes=100 * GIB).chunk_size == 1024
    assert pick_kernels("liger", vocab=QWEN_V, tokens=8, liger=True).kernels == "liger"
    with pytest.raises(ImportError, match=r"pip install 'composer-plugins\[liger\]'"):
        pick_kernels("liger", vocab=QWEN_V, tokens=8)
    with pytest.raises(ValueError, match="Did you mean 'chunked'"):
        pick_kernels("chunkd", vocab=QWEN_V, tokens=8)


def test_the_config_refuses_an_unknown_kernels_value_with_the_closest(make_cfg):
    with pytest.raises(ConfigError, match="chunked") as err:
        make_cfg("", "compute.kernels=chunkd")
    assert "compute.kernels" in str(err.value)
    cfg, _ = make_cfg("", "compute.kernels=materialised")
    assert cfg.compute.kernels == "materialised"


class FakeLogger:
    def __init__(self) -> None:
        self.params: dict[str, str] = {}

    def log_hyperparams(self, params):
        self.params.update(params)


def test_the_pick_reaches_the_runs_log_and_params(make_cfg, caplog, monkeypatch):
    from transformers import Qwen2ForCausalLM

    from composer_plugins.models.tiny import TinyModelConfig, make_model_config
    from composer_plugins.training.lightning import module as M

    cfg, _ = make_cfg("", "compute.kernels=auto")
    tiny = TinyModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    policy = Qwen2ForCausalLM(make_model_config(tiny, vocab_size=300, pad_id=0, bos_id=1, eos_id=2))
    logger = FakeLogger()
    hint = SimpleNamespace(kernels="auto")  # a channel choosing Liger itself on CUDA: it follows the pick
    composer = SimpleNamespace(active=[hint, SimpleNamespace(weight=1.0)])
    stub = SimpleNamespace(cfg=cfg, policy=policy, device=torch.device("cpu"), logger=logger, kernel_pick=None)
    stub.composer = composer
    stub._resume_rng, stub.reference, stub.cache_pair_references = None, None, lambda: None
    stub.parts = SimpleNamespace(chunk_size=None)  # the step's components take the pick's chunk size
    with caplog.at_level(logging.INFO, logger="composer_plugins.training"):
        M.ComposerModule.on_train_start(stub)
    # 2 prompts x 4 generations x 12 tokens at V=300: a few KiB of logits -> one chunk of all of them
    assert logger.params == {
        "compute.kernels_pick": "materialised",
        "compute.kernels_chunk_size": "96",
        "compute.kernels_reason": logger.params["compute.kernels_reason"],
    }
    assert "cpu" in logger.params["compute.kernels_reason"] and stub.parts.chunk_size == 96
    assert "compute.kernels=auto: materialised (chunk 96 rows" in caplog.text
    assert hint.kernels == "torch"
    from composer_plugins.training.step.components import StepComponents

    parts = SimpleNamespace(**vars(stub.parts), cfg=cfg, policy=policy, tokenizer=None, ema_teacher=None)
    parts.reference = parts.teacher_scoring = None
    assert StepComponents.step_policy(parts).chunk_size == 96  # the step's chunks follow the pick


def test_a_logger_that_refuses_the_params_leaves_the_log_line(caplog):
    class Refuses:
        def log_hyperparams(self, params):
            raise RuntimeError("Changing param values is not allowed")

    pick = pick_kernels("chunked", vocab=300, tokens=8)
    with caplog.at_level(logging.INFO, logger="composer_plugins.training"):
        params = log_kernel_pick(Refuses(), pick)
    assert params["compute.kernels_pick"] == "chunked"
    assert "not logged as params" in caplog.text and "compute.kernels=chunked: chunked" in caplog.text
