"""Batched sampling of ``G`` completions per prompt with HF ``generate`` (KV cache on).

Rows of a :class:`Rollout` are grouped: rows ``[i*G, (i+1)*G)`` are the completions of
prompt ``i``. The completion mask covers every generated token up to and including the
first EOS; everything after is padding.

``compile`` (``rollout.compile``, :data:`CompileMode`): ``on`` samples with a static KV cache (kept on the
model between calls, sized for ``max_prompt_length + max_new_tokens`` so its shape stays the same) and HF's
compiled decode step; ``auto`` does so on CUDA only. Where compilation fails, the model falls back to the
eager dynamic-cache path for good, with one warning.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from composer_plugins.models import COMPILE_MODES, CompileMode

#: Models whose compiled decode step failed once: sampled eagerly from then on.
_EAGER_ONLY: weakref.WeakSet[Any] = weakref.WeakSet()


def compiles(mode: str, device: torch.device) -> bool:
    """Whether ``compile=mode`` samples with the static cache and compiled decode step on ``device``."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile={mode!r}: expected one of {', '.join(COMPILE_MODES)}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def _static_kwargs(device: torch.device) -> dict[str, Any]:
    """``generate`` settings of the compiled path: a static cache, HF's compiled decode step (CUDA graphs on CUDA)."""
    from transformers import CompileConfig

    cc = CompileConfig(mode="reduce-overhead" if device.type == "cuda" else "default")
    cc._compile_all_devices = device.type != "cuda"  # HF compiles only on accelerators unless told
    return {"cache_implementation": "static", "compile_config": cc}


@dataclass
class Rollout:
    """Prompts and sampled completions, as tensors and text.

    Attributes:
        prompt_ids: ``(N, P)`` left-padded prompt tokens, ``N = num_prompts * G``.
        prompt_mask: ``(N, P)`` 1 on real prompt tokens.
        completion_ids: ``(N, C)`` generated tokens, right-padded.
        completion_mask: ``(N, C)`` 1 up to and including the first EOS.
        completions: decoded completion text (special tokens removed), one per row.
        prompts: prompt text, one per row (repeated ``G`` times).
        group_index: ``(N,)`` index of the prompt each row belongs to.
        num_generations: ``G``.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    completions: list[str]
    prompts: list[str]
    group_index: Tensor
    num_generations: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def input_ids(self) -> Tensor:
        """``(N, P + C)`` prompt and completion tokens."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """``(N, P + C)`` attention mask over :attr:`input_ids`."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def num_completion_tokens(self) -> int:
        """Number of real (unmasked) completion tokens."""
        return int(self.completion_mask.sum().item())


def completion_mask_from_ids(completion_ids: Tensor, eos_token_id: int | Sequence[int] | None) -> Tensor:
    """1 for each token up to and including the first EOS in each row, 0 after."""
    if eos_token_id is None:
        return torch.ones_like(completion_ids)
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= completion_ids == e
    # number of EOS tokens strictly before each position
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (before == 0).long()


def tokenize_prompts(
    tokenizer: Any, prompts: Sequence[str], max_prompt_length: int | None = None, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Left-pad ``prompts``; when longer than ``max_prompt_length`` keep the *last* tokens."""
    enc = tokenizer(list(prompts), add_special_tokens=False)
    rows = [list(ids) for ids in enc["input_ids"]]
    if max_prompt_length is not None:
        rows = [r[-max_prompt_length:] for r in rows]
    return left_pad(rows, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0, device)


def tokenize_completions(
    tokenizer: Any, texts: Sequence[str], max_length: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Right-pad ``texts`` as completions (each followed by EOS), keeping the first ``max_length`` tokens.

    Padded with the tokenizer's pad token, or its EOS token when it has none.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [[*tokenizer(t, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id][:max_length] for t in texts]
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Left-pad token-id lists into ``(ids, mask)``."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r) :] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str] | None,
    num_generations: int = 1,
    *,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    do_sample: bool = True,
    seed: int | None = None,
    max_prompt_length: int | None = None,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    compile: CompileMode = "off",
) -> Rollout:
    """Sample ``num_generations`` completions for each prompt (one batched ``generate`` call, KV cache on).

    Args:
        prompts: prompt strings (or ``None`` with ``prompt_token_ids``); ``top_k=0`` disables top-k.
        seed: when given, sampling uses a private RNG stream seeded with it (the global RNG
            is left untouched), so a step's rollouts depend only on ``seed``.
        max_prompt_length: truncate prompts from the left to this many tokens.
        prompt_token_ids: already tokenized prompts (multi-turn contexts), used instead of ``prompts``.
        compile: :data:`CompileMode` (module docstring); the tokens equal the eager path's at ``do_sample=False``.
    """
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if prompt_token_ids is not None:
        rows = [list(r)[-max_prompt_length:] if max_prompt_length else list(r) for r in prompt_token_ids]
        ids, mask = left_pad(rows, pad, device)
        prompt_texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    else:
        assert prompts is not None
        ids, mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, device)
        prompt_texts = list(prompts)
    ids = ids.repeat_interleave(num_generations, dim=0)
    mask = mask.repeat_interleave(num_generations, dim=0)
    eos = tokenizer.eos_token_id
    gen_kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "pad_token_id": pad,
        "eos_token_id": eos,
        "use_cache": True,
    }
    if do_sample:
        gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    else:
        gen_kwargs.update(temperature=None, top_p=None, top_k=None)
    static = compiles(compile, device) and model not in _EAGER_ONLY
    was_training = model.training
    model.eval()
    try:
        out = _generate(model, ids, mask, gen_kwargs, seed, static, max_prompt_length, pad)
    finally:
        model.train(was_training)
    completion_ids = out[:, ids.shape[1] :]
    cmask = completion_mask_from_ids(completion_ids, eos)
    completion_ids = torch.where(cmask.bool(), completion_ids, torch.full_like(completion_ids, pad))
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    group = torch.arange(ids.shape[0] // num_generations, device=device).repeat_interleave(num_generations)
    return Rollout(
        prompt_ids=ids,
        prompt_mask=mask,
        completion_ids=completion_ids,
        completion_mask=cmask,
        completions=list(texts),
        prompts=[p for p in prompt_texts for _ in range(num_generations)],
        group_index=group,
        num_generations=num_generations,
    )


def _generate(
    model: Any,
    ids: Tensor,
    mask: Tensor,
    gen_kwargs: dict[str, Any],
    seed: int | None,
    static: bool,
    max_prompt_length: int | None,
    pad: int,
) -> Tensor:
    """``model.generate`` (seeded on a private RNG stream); the compiled path falls back to eager once, warning."""
    width = ids.shape[1]
    kw = {**gen_kwargs, "disable_compile": True}
    if static:  # one cache shape for every call: prompts left-padded to max_prompt_length (or a multiple of 64)
        target = max(width, max_prompt_length or -(-width // 64) * 64)
        ids, mask = (torch.nn.functional.pad(t, (target - width, 0), value=v) for t, v in ((ids, pad), (mask, 0)))
        kw = {**gen_kwargs, **_static_kwargs(ids.device)}
    devices = [ids.device] if ids.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            return model.generate(input_ids=ids, attention_mask=mask, **kw)[:, ids.shape[1] - width :]
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        if not static:
            raise
        _EAGER_ONLY.add(model)
        model.__dict__.pop("_cache", None)  # the static cache's memory
        warnings.warn(
            f"rollout.compile: the compiled decode step failed ({type(e).__name__}: {str(e)[:300]}); this model "
            "samples eagerly from now on (set rollout.compile=off to skip the attempt).",
            RuntimeWarning,
            stacklevel=3,
        )
        ids, mask = ids[:, ids.shape[1] - width :], mask[:, mask.shape[1] - width :]
        return _generate(model, ids, mask, gen_kwargs, seed, False, max_prompt_length, pad)
