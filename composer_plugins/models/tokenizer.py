"""Train a small byte-level BPE tokenizer locally with ``tokenizers`` (no hub access).

Digits are split one per token so the tiny default model can learn arithmetic, and the
byte-level decoder round-trips spaces and newlines exactly, so an env parsing ``#### 42``
sees the text the model produced. The result is a ``PreTrainedTokenizerFast`` that is
saved with ``save_pretrained`` and loaded back with ``AutoTokenizer.from_pretrained``,
the same path a real model's tokenizer takes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
UNK_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

#: The Qwen2 pre-tokenizer split (each digit its own piece). ``transformers`` 5 rebuilds a qwen2
#: checkpoint's tokenizer as ``Qwen2Tokenizer`` (NFC + this split + byte-level, ``<|endoftext|>``
#: as unk) whatever ``tokenizer_config.json`` says, so the tokenizer is trained with exactly that
#: pipeline: the one saved and the one ``AutoTokenizer`` loads back encode identically.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512, min_frequency: int = 2) -> object:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``.

    ``vocab_size`` includes the special tokens and the 256 byte symbols. The tokenizer has
    ``pad``/``bos``/``eos``/``unk`` tokens (ids 0-3) and left padding (what batched generation needs).
    """
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is below the byte alphabet plus special tokens; use at least 260")
    tok = train_bpe(texts, vocab_size, SPECIAL_TOKENS, min_frequency=min_frequency)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
    )


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Iterable[str], *, min_frequency: int = 0) -> Any:
    """A raw ``tokenizers.Tokenizer``: byte-level BPE with the Qwen2 split (:data:`PRETOKENIZE_REGEX`), NFC."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok
