"""Which policy a run starts from: ``model.name_or_path``, the embedded tiny default, the SFT warm start.

:func:`resolve_policy` gives a directory or hub id (``tiny`` and the SFT warm start built and cached by config
hash); :func:`load_policy_for` loads it. Backends reach ``load_policy``, ``decoder_body`` and ``lm_head_weight``
(from :mod:`composer_plugins.models`) through here. See docs/training.md "The embedded default (no hub)".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from composer_plugins.core.config import build_component, redact, to_dict
from composer_plugins.core.io import read_jsonl
from composer_plugins.models.logprobs import decoder_body, lm_head_weight
from composer_plugins.models.tiny import build_cached, cache_dir_for, load_policy, tiny_model_dir
from composer_plugins.training.config.train import TrainConfig
from composer_plugins.training.rollout.chat import install_chat_template
from composer_plugins.training.rollout.rewards import env_tasks, task_prompt
from composer_plugins.training.runs.sft import sft_train

__all__ = [
    "apply_checkpointing",
    "base_policy_path",
    "decoder_body",
    "lm_head_weight",
    "load_policy",
    "load_policy_for",
    "resolve_policy",
    "sft_cache_key",
]


def _file_digest(path: str | None) -> str | None:
    """``path@sha256`` of a data file, so a cache keyed on it notices new contents."""
    if not path:
        return None
    try:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return str(path)
    return f"{path}@{digest}"


def base_policy_path(cfg: TrainConfig, env: Any = None) -> str:
    """``model.name_or_path``, or the cached directory of the embedded tiny model when it is ``tiny``."""
    if cfg.model.name_or_path != "tiny":
        return cfg.model.name_or_path
    env = env if env is not None else build_component("envs", cfg.env, key="env")
    tcfg = cfg.model.tiny

    def corpus() -> Iterator[str]:
        if cfg.data.train_path:
            tasks = read_jsonl(cfg.data.train_path)[: tcfg.tokenizer_corpus_size]
        else:
            tasks = env_tasks(env, cfg.data.train_split, tcfg.tokenizer_corpus_size, 1)
        for t in tasks:
            yield task_prompt(t) + str(t.get("target", t.get("solution", "")))

    corpus_key = {"env": redact(cfg.env), "train_path": _file_digest(cfg.data.train_path)}
    return str(tiny_model_dir(tcfg, corpus, cfg.cache_dir, corpus_key=corpus_key))


def sft_cache_key(cfg: TrainConfig, base: str) -> dict[str, Any]:
    """What determines an SFT checkpoint: the base policy, the data and the SFT settings."""
    sft = asdict(cfg.sft)
    sft.pop("cache")
    sft.pop("progress")
    if sft.get("hint_kinds") is None:
        sft.pop("hint_kinds")  # the default: configs from before the option keep their cached warm start
    if not sft.get("slip_rate"):
        sft.pop("slip_rate", None)  # likewise: no slips is the warm start from before the option
    key = {
        "base": base,
        "tiny": asdict(cfg.model.tiny) if cfg.model.name_or_path == "tiny" else None,
        "env": redact(cfg.env),
        "data": _file_digest(cfg.data.train_path),
        "sft": sft,
        "dtype": cfg.model.dtype,
        # hinted SFT examples are built with the hint provider: a new template is a new warm start
        "hints": redact(to_dict(cfg.hints.provider)) if cfg.sft.hint_fraction > 0 else None,
    }
    if cfg.model.chat_template != "auto":  # the SFT prompts are rendered with it (auto: keys from before stay valid)
        key["chat_template"] = _file_digest(cfg.model.chat_template) if cfg.model.chat_template != "none" else "none"
    return key


def resolve_policy(cfg: TrainConfig, env: Any = None) -> str:
    """The path/id the RL policy is loaded from: base policy, plus the cached SFT warm start if enabled."""
    env = env if env is not None else build_component("envs", cfg.env, key="env")
    base = base_policy_path(cfg, env)
    if not cfg.sft.enabled:
        return base
    key = sft_cache_key(cfg, base)
    if not cfg.sft.cache:
        out = Path(cfg.output_dir) / "sft"
        sft_train(cfg, base, env, out)
        return str(out)
    target = cache_dir_for(cfg.cache_dir, "sft", key)
    build_cached(target, lambda tmp: sft_train(cfg, base, env, tmp), meta=key)
    return str(target)


def load_policy_for(cfg: TrainConfig, env: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the resolved policy, loaded with ``from_pretrained``.

    A ``model.chat_template`` file is set on the tokenizer
    (:func:`~composer_plugins.training.rollout.chat.install_chat_template`).
    """
    model, tok = load_policy(resolve_policy(cfg, env), dtype=cfg.model.dtype)
    return model, install_chat_template(tok, cfg.model.chat_template)


def apply_checkpointing(policy: Any, cfg: TrainConfig) -> bool:
    """Per-decoder-layer activation checkpointing of ``policy`` as ``compute.gradient_checkpointing`` says
    (``auto``: when the rollout rows or the replay pairs of a step need more than one micro-batch). Whether it is on."""
    r, rp = cfg.rollout, cfg.replay
    forwards = [(r.prompts_per_step * r.num_generations, r.max_prompt_length + r.max_new_tokens * r.max_turns)]
    if rp.pairs_path:
        forwards.append((2 * rp.pairs_per_step, r.max_prompt_length + rp.max_completion_length))
    c, ok = cfg.compute, getattr(policy, "supports_gradient_checkpointing", False)
    mode = c.gradient_checkpointing
    if mode == "none" or (mode == "auto" and (not ok or all(c.rows_per_micro_batch(t) >= n for n, t in forwards))):
        return False
    if not ok:
        raise ValueError(
            f"compute.gradient_checkpointing: {type(policy).__name__} does not support per-layer checkpointing; "
            "set it to auto or none"
        )
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return True
