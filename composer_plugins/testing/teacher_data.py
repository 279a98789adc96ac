"""Teacher test data: a tiny local chat model and sample traces (no hub access, CPU-sized).

:func:`build_tiny_chat_model` trains a byte-level BPE tokenizer with ``tokenizers`` on a
small arithmetic corpus, gives it a chat template, initialises a two-layer Llama, and
writes both with ``save_pretrained``, so :class:`~composer_plugins.teachers.hf.HFTeacher`
and ``replay record`` load it through the ordinary ``from_pretrained`` path.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] if m['content'] else '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def arithmetic_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """GSM8K-format arithmetic problems with answers (the tokenizer's training text)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        op = rng.choice(["+", "-", "*"])
        val = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append(f"<|user|>\nWhat is {a} {op} {b}?\n<|assistant|>\n{a} {op} {b} = {val}\n#### {val}\n")
    return out


def build_tiny_chat_model(
    out_dir: str | os.PathLike[str],
    corpus: Iterable[str] | None = None,
    *,
    vocab_size: int = 320,
    hidden_size: int = 32,
    layers: int = 2,
    seed: int = 0,
) -> Path:
    """Train a tokenizer, initialise a tiny Llama, ``save_pretrained`` both into ``out_dir``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|pad|>", "<|bos|>", "<|eos|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) if corpus is not None else arithmetic_corpus(), trainer)
    fast: Any = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=fast.pad_token_id,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = fast.pad_token_id
    model.generation_config.eos_token_id = fast.eos_token_id
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def write_sample_traces(path: str | os.PathLike[str], n: int = 8, wrong_every: int = 2) -> Path:
    """OpenAI-messages JSONL of arithmetic conversations; every ``wrong_every``-th student answer is off by one."""
    from composer_plugins.core.io import atomic_write_jsonl

    rows = []
    for i in range(n):
        a, b = 3 + i, 7 + 2 * i
        ans = a + b + (1 if wrong_every and i % wrong_every == 0 else 0)
        rows.append(
            {
                "id": f"arith-{i}",
                "messages": [
                    {"role": "system", "content": "Answer in GSM8K format."},
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": f"#### {ans}"},
                ],
                "metadata": {"answer": str(a + b)},
            }
        )
    p = Path(path)
    atomic_write_jsonl(p, rows, ensure_ascii=True)
    return p
