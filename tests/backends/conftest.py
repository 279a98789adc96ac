"""Fixtures for the backend tests: the backend distributions' entry points, a tiny Qwen2 policy.

The root conftest turns third-party plugin autoload off; the upstream backends (trl, verl, prime_rl,
monarch) live in their own distributions (``packages/``) and register through their ``composer_plugins``
entry points, so every test here loads exactly those four (and nothing else that happens to be installed).
"""

from __future__ import annotations

import pytest

from composer_plugins.core import plugins

#: The distributions that bring the upstream backends (``packages/composer-plugins-<backend>``).
BACKEND_DISTRIBUTIONS = (
    "composer-plugins-trl",
    "composer-plugins-verl",
    "composer-plugins-prime-rl",
    "composer-plugins-monarch",
)


@pytest.fixture(autouse=True)
def backend_entry_points(monkeypatch):
    """Load the backend distributions' entry points (only those) in this process and its children."""
    monkeypatch.setenv(plugins.LOAD_ENV, ",".join(BACKEND_DISTRIBUTIONS))
    plugins.reset()
    yield plugins
    plugins.reset()


CORPUS = [f"Q: {a}+{b}=? A: {a + b}" for a in range(25) for b in range(25)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny causal LM + tokenizer written with save_pretrained (loaded back with from_pretrained)."""
    import torch

    from composer_plugins.models.tiny import TinyModelConfig, build_tiny_model

    torch.set_num_threads(2)
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


@pytest.fixture
def toy_config(tiny_model_dir, tmp_path):
    """``toy_config(losses, pairs, **sections)``: the backend tests' train config (see :func:`toy_train_config`)."""
    return lambda losses, pairs, **sections: toy_train_config(tiny_model_dir, tmp_path, losses, pairs, **sections)


def toy_train_config(model_dir: str, tmp_path, losses, pairs, **sections) -> dict:
    """The backend tests' train config: the toy add env, its answer hints, ``pairs`` written as the replay file,
    then ``sections`` merged over each section (``rollout={"temperature": 0.8}`` keeps the other rollout keys)."""
    import json

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = {
        "seed": 0,
        "output_dir": str(tmp_path / "out"),
        "cache_dir": str(tmp_path / "cache"),
        "model": {"name_or_path": model_dir},
        "env": {"class_path": "backend_envs.ToyAddEnv"},
        "sft": {"enabled": False},
        "rollout": {"prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6},
        "losses": losses,
        "hints": {"provider": {"class_path": "backend_envs.AnswerHints"}},
        "replay": {"pairs_path": str(path), "pairs_per_step": 1},
        "trainer": {"max_steps": 1, "num_threads": 1, "enable_progress_bar": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(cfg.get(key), dict) and isinstance(value, dict) else value
    return cfg
