"""The embedded default policy: a tiny Qwen2/Llama model and tokenizer built locally.

:func:`build_tiny_model` trains a BPE tokenizer on a corpus, initialises a small causal LM
with the requested architecture, and writes both with ``save_pretrained``.
:func:`load_policy` then loads that directory through the same ``from_pretrained`` path a
hub model id or any local checkpoint uses. :func:`cache_dir_for` keys cached artifacts
(tiny bases, SFT checkpoints) by a hash of the config that produced them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from composer_plugins.core.errors import ComposerPluginsError

#: Bump when the way artifacts are built changes, so stale caches are not reused.
CACHE_VERSION = 2


@dataclass
class TinyModelConfig:
    """Shape of the embedded default model (used when ``model.name_or_path`` is ``tiny``)."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    #: Seed of the weight initialisation.
    init_seed: int = 0
    #: Number of generated problems (with solutions) the tokenizer is trained on.
    tokenizer_corpus_size: int = 3000


def config_hash(payload: Any) -> str:
    """A short stable hash of JSON-able ``payload`` (plus :data:`CACHE_VERSION`)."""
    blob = json.dumps({"v": CACHE_VERSION, "p": payload}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_dir_for(root: str | os.PathLike[str], kind: str, payload: Any) -> Path:
    """``root/kind-<hash(payload)>``: where an artifact built from ``payload`` is cached."""
    return Path(root) / f"{kind}-{config_hash(payload)}"


def build_cached(target: Path, build: Callable[[Path], None], meta: dict[str, Any] | None = None) -> Path:
    """Run ``build(tmpdir)`` unless ``target`` already holds a finished artifact, then move it in place.

    Building into a sibling temporary directory and renaming makes concurrent or interrupted
    builds safe: ``target`` only ever appears complete (marked by ``composer_meta.json``).
    """
    marker = target / "composer_meta.json"
    if marker.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        build(tmp)
        (tmp / "composer_meta.json").write_text(json.dumps(meta or {}, indent=2, sort_keys=True, default=str))
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first
            if not marker.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def make_model_config(cfg: TinyModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> Any:
    """The ``transformers`` config object for ``cfg`` with the tokenizer's real vocab size."""
    from transformers import LlamaConfig, Qwen2Config

    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[cfg.arch]
    return cls(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        use_cache=True,
    )


def save_policy(model: Any, tok: Any, out_dir: str | os.PathLike[str], bos_token_id: int | None) -> Path:
    """``save_pretrained`` ``model`` and ``tok`` into ``out_dir``, the model's generation config given the
    tokenizer's pad and EOS ids and ``bos_token_id``."""
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = bos_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_tiny_model(cfg: TinyModelConfig, corpus: Iterable[str], out_dir: str | os.PathLike[str]) -> Path:
    """Train a tokenizer on ``corpus``, initialise a tiny causal LM, ``save_pretrained`` both to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    from composer_plugins.models.tokenizer import train_bpe_tokenizer

    tok: Any = train_bpe_tokenizer(corpus, vocab_size=cfg.vocab_size)
    mcfg = make_model_config(cfg, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        model = AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32)
    return save_policy(model, tok, out_dir, tok.bos_token_id)


def tiny_model_dir(
    cfg: TinyModelConfig,
    corpus_fn: Callable[[], Iterable[str]],
    cache_root: str | os.PathLike[str],
    corpus_key: Any = None,
) -> Path:
    """The cached directory of the tiny base model for ``cfg`` (built on first use)."""
    payload = {"tiny": asdict(cfg), "corpus": corpus_key}
    target = cache_dir_for(cache_root, "tiny", payload)
    return build_cached(target, lambda tmp: build_tiny_model(cfg, corpus_fn(), tmp), meta=payload)


class PolicyLoadError(ComposerPluginsError, OSError):
    """A policy that ``from_pretrained`` could not load (not cached and the hub unreachable, no such repo ...).

    ``name_or_path`` is what was asked for, ``problem`` the reason and the ways out (without a location:
    the caller that knows which config key gave the name locates it).
    """

    def __init__(self, name_or_path: str, reason: str) -> None:
        self.name_or_path = name_or_path
        first = next((ln.strip() for ln in reason.splitlines() if ln.strip()), reason)
        self.problem = (
            f"cannot load {name_or_path!r}: {first} — give a local directory written by save_pretrained, a hub id "
            "that is in the Hugging Face cache (HF_HOME; with HF_HUB_OFFLINE=1 nothing is downloaded), check the "
            "network (and HF_TOKEN for a gated model), or use 'tiny' for the embedded model."
        )
        super().__init__(self.problem)


def load_policy(name_or_path: str | os.PathLike[str], dtype: str = "float32", **kwargs: Any) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` with ``from_pretrained`` from a hub id or a local directory.

    The tokenizer is set up for batched generation: left padding, and a pad token (the
    EOS token when the checkpoint defines none). A checkpoint that cannot be found or fetched
    raises :class:`PolicyLoadError` (the hub's reason and the ways out, no traceback at the CLI).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    try:
        tok = AutoTokenizer.from_pretrained(str(name_or_path))
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=torch_dtype, **kwargs)
    except OSError as e:  # transformers' "couldn't connect ... and couldn't find them in the cached files"
        raise PolicyLoadError(str(name_or_path), str(e)) from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


#: Shapes of real checkpoints, for building locally initialised stand-ins (random weights) that
#: train and benchmark at the real vocabulary and body size without a hub download. Values are
#: those of the published Qwen2.5 configs; ``cpu-proxy`` keeps the real vocabulary with a tiny body.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "vocab_size": 151_936,
        "hidden_size": 896,
        "intermediate_size": 4_864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32_768,
    },
    "qwen2.5-1.5b": {
        "vocab_size": 151_936,
        "hidden_size": 1_536,
        "intermediate_size": 8_960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32_768,
    },
    "cpu-proxy": {
        "vocab_size": 151_936,
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4_096,
    },
}


def build_shaped_model(
    tokenizer_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    shape: str | Mapping[str, Any],
    *,
    seed: int = 0,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """A Qwen2 causal LM of ``shape`` with random weights and the tokenizer of ``tokenizer_dir``, saved to ``out_dir``.

    ``shape`` is a key of :data:`MODEL_SHAPES` or a mapping of ``Qwen2Config`` fields; ``overrides``
    change single fields (e.g. ``vocab_size=32768``). The model's vocabulary may be larger than the
    tokenizer's, as in the released Qwen2.5 checkpoints (151,936 rows for 151,665 tokens); ids past
    the tokenizer decode to nothing. The result loads with ``from_pretrained`` like any checkpoint.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if isinstance(shape, str):
        if shape not in MODEL_SHAPES:
            raise ValueError(f"unknown model shape {shape!r}; available: {', '.join(sorted(MODEL_SHAPES))}")
        fields = dict(MODEL_SHAPES[shape])
    else:
        fields = dict(shape)
    fields.update(overrides)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if fields.get("vocab_size", 0) < len(tok):
        raise ValueError(f"vocab_size {fields.get('vocab_size')} is smaller than the tokenizer's {len(tok)} tokens")
    mcfg = Qwen2Config(
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **fields
    )
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(mcfg, dtype=torch_dtype)
    return save_policy(model, tok, out_dir, tok.bos_token_id)
