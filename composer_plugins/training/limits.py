"""The numeric ranges of a train config: numbers a run cannot use, refused when the config is loaded.

:func:`check_ranges` is called by :func:`composer_plugins.training.config.train_config_from_dict` on every
loaded config; each problem is reported as ``file:line: key: problem — fix``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from composer_plugins.core.config import Config

__all__ = ["SFT_HINT_KINDS", "check_ranges"]

#: What a hinted SFT example can carry (``sft.hint_kinds``).
SFT_HINT_KINDS = ("feedback", "demonstration", "step_check")


def check_ranges(cfg: Any, src: Config, pre: str = "") -> None:
    """Numbers a run cannot use, refused at load with ``file:line: key: problem — fix``."""

    def need(key: str, ok: bool, value: Any, problem: str, fix: str) -> None:
        if not ok:
            raise src.error(pre + key, f"{problem}, got {value!r} — {fix}.")

    for key, value, default in (("optim.lr", cfg.optim.lr, 2e-5), ("sft.lr", cfg.sft.lr, 3e-3)):
        need(key, value > 0, value, "a learning rate must be > 0", f"use a small positive number such as {default:g}")
    kinds = cfg.sft.hint_kinds
    if kinds is not None:
        need(
            "sft.hint_kinds",
            isinstance(kinds, Mapping) and bool(kinds),
            kinds,
            "must map hint kinds to shares",
            "e.g. {feedback: 0.5, demonstration: 0.5}",
        )
        for k, v in kinds.items():
            if k not in SFT_HINT_KINDS:
                raise src.error(pre + f"sft.hint_kinds.{k}", "unknown hint kind.", valid=SFT_HINT_KINDS)
            need(
                f"sft.hint_kinds.{k}",
                isinstance(v, int | float) and v >= 0,
                v,
                "a share must be a number >= 0",
                "use e.g. 0.5",
            )
        need("sft.hint_kinds", sum(kinds.values()) > 0, kinds, "the shares sum to 0", "give one share > 0")
    for key, value in (
        ("sft.batch_size", cfg.sft.batch_size),
        ("sft.num_examples", cfg.sft.num_examples),
        ("sft.max_length", cfg.sft.max_length),
    ):
        need(key, value >= 1, value, "must be >= 1", "use a positive integer")
    need(
        "sft.steps",
        cfg.sft.steps >= 0,
        cfg.sft.steps,
        "must be >= 0",
        "use a number of optimizer steps, or sft.enabled: false to skip the warm start",
    )
    need("sft.warmup_steps", cfg.sft.warmup_steps >= 0, cfg.sft.warmup_steps, "must be >= 0", "use 0 for no warmup")
    need(
        "optim.warmup_steps", cfg.optim.warmup_steps >= 0, cfg.optim.warmup_steps, "must be >= 0", "use 0 for no warmup"
    )
    t = cfg.trainer
    need(
        "trainer.checkpoint_every_n_steps",
        t.checkpoint_every_n_steps >= 0,
        t.checkpoint_every_n_steps,
        "must be >= 0",
        "use 0 to write no checkpoints, or N to write one every N steps",
    )
    need(
        "trainer.keep_checkpoints",
        t.keep_checkpoints >= -1,
        t.keep_checkpoints,
        "must be >= -1",
        "use -1 to keep every checkpoint, or how many to keep",
    )
    tiny = cfg.model.tiny
    for f in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "max_position_embeddings",
    ):
        v = getattr(tiny, f)
        need(f"model.tiny.{f}", v >= 1, v, "must be >= 1", "use a positive integer")
    need(
        "model.tiny.num_heads",
        tiny.hidden_size % tiny.num_heads == 0,
        tiny.num_heads,
        f"must divide model.tiny.hidden_size ({tiny.hidden_size})",
        f"use one of {[h for h in range(1, tiny.hidden_size + 1) if tiny.hidden_size % h == 0][:12]}",
    )
    need(
        "model.tiny.num_kv_heads",
        tiny.num_heads % tiny.num_kv_heads == 0,
        tiny.num_kv_heads,
        f"must divide model.tiny.num_heads ({tiny.num_heads})",
        f"use one of {[h for h in range(1, tiny.num_heads + 1) if tiny.num_heads % h == 0]}",
    )
