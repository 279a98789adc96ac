"""Fixtures for the training tests: a very small SFT-warm-started policy built once per session in a tmp dir."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

#: A tiny shape so every test trains in seconds on one CPU thread.
TINY = """
seed: 0
cache_dir: {cache}
model:
  tiny: {{hidden_size: 32, intermediate_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1,
          vocab_size: 300, tokenizer_corpus_size: 400, max_position_embeddings: 192}}
env: {{name: gsm8k, difficulty: trivial}}
hints: {{provider: {{name: template, reveal_answer: true}}}}
sft: {{steps: 30, batch_size: 16, lr: 1.0e-2, num_examples: 480, progress: false, warmup_steps: 5}}
rollout: {{prompts_per_step: 2, num_generations: 4, max_new_tokens: 12, temperature: 1.0}}
optim: {{lr: 1.0e-3}}
trainer: {{max_steps: 2, checkpoint_every_n_steps: 1, enable_progress_bar: false, num_threads: 1}}
eval: {{num_problems: 8, batch_size: 8, k: 2, num_samples: 2, at_start: false, at_end: false}}
"""


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A session cache dir holding the tiny base model and its SFT warm start (built on first use)."""
    torch.set_num_threads(1)
    return tmp_path_factory.mktemp("composer_cache")


@pytest.fixture
def tiny_yaml(tiny_cache) -> str:
    """The tiny test config as YAML text."""
    return TINY.format(cache=tiny_cache)


@pytest.fixture
def make_cfg(tiny_cache, tmp_path):
    """``make_cfg(extra_yaml, *overrides) -> (TrainConfig, Config)`` on the tiny base, output in ``tmp_path``."""
    from composer_plugins.training.config.train import loads_train_config

    def make(extra: str = "", *overrides: str, out: Path | None = None):
        text = TINY.format(cache=tiny_cache) + textwrap.dedent(extra)
        return loads_train_config(text, [f"output_dir={out or tmp_path / 'run'}", *overrides])

    return make


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    """Preference pairs in the replay JSONL schema (prompt / chosen / rejected) for GSM8K-format tasks."""
    from composer_plugins.envs.gsm8k import GSM8KEnv

    env = GSM8KEnv(difficulty="trivial")
    p = tmp_path / "pairs.jsonl"
    with p.open("w") as f:
        for t in env.sample_tasks(6, "train", seed=3):
            wrong = str(int(t["answer"]) + 1)
            rejected = t["target"].replace(f"#### {t['answer']}", f"#### {wrong}")
            f.write(json.dumps({"prompt": t["prompt"], "chosen": t["target"], "rejected": rejected}) + "\n")
    return p
