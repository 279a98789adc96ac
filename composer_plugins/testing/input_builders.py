"""Conformance check for channel input builders (the ``input_builders`` kind, ``register_input_builders`` hook).

:func:`check_input_builder` runs a registered builder the way the assembler does, on a small step record of a
tiny random Llama, and checks its side of the contract (docs/plugins.md, ``register_input_builders``).
:func:`check` is the kit's dispatcher with this kind added, for every registered builder, built-in or
third-party.
"""

from __future__ import annotations

import functools
import inspect
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from composer_plugins.testing import conformance
from composer_plugins.testing.base import _entry, _fail

__all__ = ["check", "check_input_builder", "conformance_step"]


def check(kind: str, name: str, registry: Any = None, **build_kwargs: Any) -> None:
    """:func:`composer_plugins.testing.conformance.check`, with the ``input_builders`` kind's check."""
    from composer_plugins.core.registry import normalize_kind

    if normalize_kind(kind) == "input_builders":
        check_input_builder(name, registry, **build_kwargs)
    else:
        conformance.check(kind, name, registry, **build_kwargs)


@functools.lru_cache(maxsize=1)
def _tiny() -> tuple[Any, Any]:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from composer_plugins.testing.teacher_data import build_tiny_chat_model

    d = build_tiny_chat_model(tempfile.mkdtemp(prefix="cp-input-builders-"), vocab_size=300, hidden_size=16, layers=1)
    tok = AutoTokenizer.from_pretrained(d)
    model = LlamaForCausalLM.from_pretrained(d).float()
    return model, tok


def conformance_step() -> tuple[Any, Any, Any]:
    """``(record, meta, policy)``: the step a builder is checked on (4 rows of 5 tokens, 2 hinted, 1 pair)."""
    from composer_plugins.training.step.assemble import StepPolicy
    from composer_plugins.training.step.experience import ExperienceMaker
    from composer_plugins.training.step.record import StepMeta, StepRecord

    model, tok = _tiny()
    g = torch.Generator().manual_seed(0)
    V, N, P, C = int(model.config.vocab_size), 4, 3, 5
    mask = torch.ones(N, C, dtype=torch.long)
    mask[0, 3:] = 0
    base = StepRecord(
        tasks=[{"prompt": "What is 3 + 4?"}, {"prompt": "What is 2 * 6?"}],
        prompts=["What is 3 + 4?"] * 2 + ["What is 2 * 6?"] * 2,
        completions=["7", "8", "12", "11"],
        prompt_ids=torch.randint(3, V, (N, P), generator=g),
        prompt_mask=torch.ones(N, P, dtype=torch.long),
        completion_ids=torch.randint(3, V, (N, C), generator=g),
        completion_mask=mask,
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.7, 0.7, -0.7]),
        num_generations=2,
        hint_contexts=[None, "What is 3 + 4? Hint: count on.", None, "What is 2 * 6? Hint: add 6 twice."],
    )
    maker = ExperienceMaker()
    record = base.replace(ref_logprobs=maker.logprobs(model, base), old_logprobs=maker.logprobs(model, base))
    meta = StepMeta(step=1, total_steps=4, pairs=({"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"},))
    return record, meta, StepPolicy(model, tok, max_context_length=32)


def check_input_builder(name: str, registry: Any = None, **_: Any) -> None:
    """Run the conformance checks of the input builder registered as ``name`` (see the module docstring)."""
    from composer_plugins.core.plugins import get_registry
    from composer_plugins.training.step.assemble import Assembly, input_builders
    from composer_plugins.training.step.record import RecordFrozenError

    registry = registry or get_registry()
    entry = _entry("input_builders", name, registry)
    try:
        fn = entry.factory
    except Exception as e:
        raise _fail(entry, f"its builder does not import: {type(e).__name__}: {e}") from e
    if not callable(fn):
        raise _fail(entry, f"the builder is not callable: {fn!r}")
    try:
        inspect.signature(fn).bind(object())
    except TypeError as e:
        raise _fail(entry, f"the builder must take one argument (the Assembly): {e}") from e
    except ValueError:  # no signature (a builtin): called below
        pass
    record, meta, policy = conformance_step()
    table = input_builders(registry)
    runs = []
    for _attempt in range(2):
        asm = Assembly(record, policy, (name,), meta, table)
        try:
            out = fn(asm)
        except RecordFrozenError as e:
            raise _fail(entry, f"the builder wrote the step record ({e})") from e
        except Exception as e:
            raise _fail(entry, f"raised on the conformance step: {type(e).__name__}: {e}") from e
        if not isinstance(out, Mapping) or not all(isinstance(k, str) for k in out):
            raise _fail(entry, f"must return a mapping of input names to values, got {type(out).__name__}")
        runs.append({**asm.values, **out})
    rows, tokens = record.completion_ids.shape
    vocab = int(policy.model.config.vocab_size)
    for key, value in runs[0].items():
        if isinstance(value, torch.Tensor) and value.numel() >= rows * tokens * vocab:
            raise _fail(
                entry,
                f"{key!r} holds {tuple(value.shape)} = rows × tokens × vocabulary elements or more; build "
                "inputs from hidden states through the LM head in chunks (composer_plugins.kernels)",
            )
    for key, value in runs[0].items():
        again = runs[1].get(key)
        if isinstance(value, torch.Tensor) and isinstance(again, torch.Tensor):
            same = value.shape == again.shape and torch.allclose(value.detach().float(), again.detach().float())
            if not same:
                raise _fail(entry, f"{key!r} differs between two assemblies of the same record")
