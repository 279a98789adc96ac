"""A local stand-in for an instruct model: a Qwen2-architecture checkpoint with a Qwen2.5-style chat template.

:func:`build_instruct_model` trains a byte-level BPE tokenizer with ``tokenizers`` (the Qwen2 split,
:func:`composer_plugins.models.tokenizer.train_bpe_tokenizer`'s pipeline) whose special tokens are
Qwen2.5-Instruct's (``<|endoftext|>`` pad, ``<|im_start|>``, ``<|im_end|>`` the end of a turn and EOS),
gives it :data:`QWEN25_STYLE_TEMPLATE`, builds a ``Qwen2ForCausalLM`` from its config (random weights,
any size) and writes both with ``save_pretrained``: ``from_pretrained`` on the directory is the path a
hub id such as ``Qwen/Qwen2.5-0.5B-Instruct`` takes, without the download. :func:`write_gsm8k_like`
writes GSM8K-format rows (``question``/``answer`` ending in ``#### <n>``, the ``openai/gsm8k`` layout).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

__all__ = ["QWEN25_STYLE_TEMPLATE", "build_instruct_model", "gsm8k_like_rows", "write_gsm8k_like"]

#: A chat template in the style of Qwen2.5-Instruct's: ChatML turns, a default system turn when the
#: conversation has none, ``<|im_start|>assistant\n`` as the generation prompt.
QWEN25_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def gsm8k_like_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` GSM8K-format rows (``question``, ``answer`` with worked steps and a final ``#### <n>``)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
        total = (a + b) * c
        rows.append(
            {
                "question": f"Tom has {a} apples and buys {b} more. He fills {c} baskets with that many apples each. "
                "How many apples are in the baskets?",
                "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n"
                f"The baskets hold {a + b} * {c} = <<{a + b}*{c}={total}>>{total} apples.\n#### {total}",
            }
        )
    return rows


def write_gsm8k_like(directory: str | os.PathLike[str], n_train: int = 64, n_test: int = 16) -> Path:
    """``train.jsonl`` and ``test.jsonl`` of :func:`gsm8k_like_rows` in ``directory`` (a local ``openai/gsm8k``)."""
    from composer_plugins.core.io import atomic_write_jsonl

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(d / "train.jsonl", gsm8k_like_rows(n_train, 0), ensure_ascii=True)
    atomic_write_jsonl(d / "test.jsonl", gsm8k_like_rows(n_test, 1), ensure_ascii=True)
    return d


def build_instruct_model(
    out_dir: str | os.PathLike[str],
    *,
    vocab_size: int = 400,
    hidden_size: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    template: str = QWEN25_STYLE_TEMPLATE,
) -> Path:
    """Write a tiny Qwen2-architecture instruct checkpoint (tokenizer with ``template``) to ``out_dir``."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from composer_plugins.models.tiny import TinyModelConfig, make_model_config, save_policy
    from composer_plugins.models.tokenizer import train_bpe

    corpus = [f"{r['question']}\n{r['answer']}" for r in gsm8k_like_rows(200, seed)]
    tok = train_bpe(corpus, vocab_size, SPECIAL_TOKENS)
    fast: Any = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",
    )
    fast.chat_template = template
    shape = TinyModelConfig(hidden_size=hidden_size, intermediate_size=hidden_size * 2, num_layers=layers)
    shape.num_heads, shape.num_kv_heads, shape.max_position_embeddings = heads, kv_heads, 1024
    cfg = make_model_config(shape, len(fast), fast.pad_token_id, None, fast.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    return save_policy(model, fast, out_dir, None)
