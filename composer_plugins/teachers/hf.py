"""The ``hf`` teacher: a local ``transformers`` causal LM loaded with ``from_pretrained``.

Loaded on the first call; one generation at a time in a worker thread, so the event loop keeps serving the other
teachers (docs/replay.md, "Teachers").
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from composer_plugins.teachers.base import (
    Teacher,
    TeacherCallError,
    TeacherError,
    TeacherResponse,
    check_number,
    check_sampling,
)


def load_causal_lm(path: str, dtype: str, device: str, local_files_only: bool) -> tuple[Any, Any]:
    """``(model, tokenizer)`` loaded with ``from_pretrained`` from ``path``, the model on ``device`` in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=local_files_only)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), local_files_only=local_files_only)
    return model.to(device).eval(), tok


class HFTeacher(Teacher):
    """A teacher backed by a local Hugging Face causal LM.

    ``model_path``: a ``save_pretrained`` directory (or a hub id with ``local_files_only=False``); ``id`` defaults
    to its name. ``temperature=0`` decodes greedily; above, it samples, reseeded with ``seed`` at every call.
    """

    kind = "hf"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        id: str | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        dtype: str = "float32",
        device: str = "cpu",
        local_files_only: bool = True,
        prompt_usd_per_token: float = 0.0,
        completion_usd_per_token: float = 0.0,
    ) -> None:
        path = os.fspath(model_path)
        who = f"hf teacher {id or os.path.basename(path.rstrip('/')) or 'hf'!r}"
        check_number(max_new_tokens, "max_new_tokens", who, integer=True, minimum=1, example="64")
        self.temperature, self.top_p, self.seed = check_sampling(who, temperature, top_p, seed, required=True)
        super().__init__(
            id=id or os.path.basename(path.rstrip("/")) or "hf",
            model=path,
            max_tokens=max_new_tokens,
            max_concurrency=1,
            prompt_usd_per_token=prompt_usd_per_token,
            completion_usd_per_token=completion_usd_per_token,
        )
        if dtype not in ("float32", "bfloat16", "float16"):
            raise TeacherError(f"hf teacher {self.id!r}: dtype must be float32, bfloat16 or float16, got {dtype!r}")
        self.model_path = path
        self.dtype = dtype
        self.device = device
        self.local_files_only = local_files_only
        self._model: Any = None
        self._tok: Any = None
        self._lock = threading.Lock()

    def cache_params(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_tokens,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "seed": self.seed,
            "dtype": self.dtype,
        }

    def check(self) -> None:
        if self.local_files_only and not os.path.isdir(self.model_path):
            raise TeacherError(
                f"hf teacher {self.id!r}: model_path {self.model_path!r} is not a directory. "
                "HINT: point it at a directory written by save_pretrained."
            )

    def load(self) -> tuple[Any, Any]:
        """Load (once) and return ``(model, tokenizer)``."""
        if self._model is None:
            try:
                model, tok = load_causal_lm(self.model_path, self.dtype, self.device, self.local_files_only)
            except (OSError, ValueError) as e:
                raise TeacherError(
                    f"hf teacher {self.id!r}: cannot load a model from {self.model_path!r}: {e}. "
                    "HINT: model_path must be a directory written by save_pretrained."
                ) from e
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token
            self._model, self._tok = model, tok
        return self._model, self._tok

    def prompt_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The text fed to the model for ``messages``."""
        from composer_plugins.chat.render import render_prompt

        _, tok = self.load()
        return render_prompt([dict(m) for m in messages], tok, "auto")

    def _generate(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, int, int]:
        import torch

        model, tok = self.load()
        text = self.prompt_text(messages)
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
        ids = enc["input_ids"].to(self.device)
        mask = enc["attention_mask"].to(self.device)
        kw: dict[str, Any] = dict(
            max_new_tokens=self.max_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
        )
        if self.temperature > 0:
            kw.update(do_sample=True, temperature=self.temperature, top_p=self.top_p)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with self._lock, torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        new = out[0, ids.shape[1] :]
        if tok.eos_token_id is not None:
            eos = (new == tok.eos_token_id).nonzero()
            if len(eos):
                new = new[: int(eos[0, 0]) + 1]
        completion = tok.decode(new, skip_special_tokens=True)
        return completion, int(ids.shape[1]), int(new.shape[0])

    def generate(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """Synchronously generate the assistant reply to ``messages`` (used to record student rollouts)."""
        return self._generate(messages)[0]

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], *, metadata: Mapping[str, Any] | None = None
    ) -> TeacherResponse:
        t0 = time.perf_counter()
        try:
            text, pt, ct = await asyncio.to_thread(self._generate, messages)
        except TeacherError:
            raise
        except Exception as e:  # a generation failure is not transient
            raise TeacherCallError(
                f"teacher {self.id!r}: generation failed: {type(e).__name__}: {e}", retryable=False, kind="generate"
            ) from e
        finish = "stop" if ct < self.max_tokens else "length"
        return self.response(text, pt, ct, latency_s=time.perf_counter() - t0, finish_reason=finish)
