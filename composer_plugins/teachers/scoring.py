"""Teachers that **score** the student's rollout: top-k log-probs per completion token (on-policy distillation).

A scorer is given, per row, the prompt and the student's completion (text and the student's token
ids) and returns :class:`TeacherScores`: per student completion token, the teacher's ``K`` most
likely next tokens (ids in the **student's** vocabulary) and their log-probs, and a mask of the
positions it scored. Kinds (``composer-plugins list scorers``; third parties register more with
the ``register_teacher_scorers`` hook):

* ``causal_lm`` (:class:`LocalScorer`): a frozen ``from_pretrained`` causal LM (an id or a
  directory), optionally on its own device, batched; the top-k is taken from its hidden states
  chunk by chunk through its LM head (never ``rows × tokens × vocab``).
* ``vllm`` / ``sglang`` (:class:`ServerScorer`): an OpenAI-compatible server returning prompt
  log-probs (vLLM's ``/v1/completions`` with ``prompt_logprobs``; SGLang's ``/generate`` with
  ``return_logprob`` + ``top_logprobs_num``), through the replay engine: the same HTTP transport,
  cache (keyed by teacher, prompt, completion tokens and K), dollar budget, retries and
  fault accounting as replay.

A teacher whose tokenizer differs from the student's is mapped onto the student's tokens by
:mod:`composer_plugins.teachers.align`. :class:`ScoringPool` runs the scorers in the background
(started as soon as the rollouts exist) and collects them with a deadline: a teacher that has not
finished by then is skipped for that batch and reported.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from composer_plugins.teachers.base import (
    Teacher,
    TeacherCallError,
    TeacherError,
    TeacherResponse,
    check_number,
)

log = logging.getLogger(__name__)


@dataclass
class TeacherScores:
    """One row's scores, aligned to the student's completion tokens.

    Attributes:
        token_ids: ``LongTensor [T, K]`` the teacher's top-k next-token ids, in the student's
            vocabulary (``-1``: no entry; cross-tokenizer rows may have fewer than K).
        logprobs: ``FloatTensor [T, K]`` their log-probs under the teacher.
        mask: ``BoolTensor [T]`` the positions scored.
        sampled: optional ``FloatTensor [T]``: the teacher's log-prob of the student's own token at each
            position (NaN where unknown) — PRIME-RL's ``teacher_logprobs`` stream.
    """

    token_ids: Any
    logprobs: Any
    mask: Any
    sampled: Any = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.token_ids, self.logprobs, self.mask))

    @classmethod
    def from_lists(
        cls,
        ids: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]],
        mask: Sequence[bool],
        k: int,
        sampled: Sequence[float] | None = None,
    ) -> TeacherScores:
        """Pack ragged per-token lists (padded to ``k`` with id ``-1``)."""
        import torch

        T = len(mask)
        t_ids = torch.full((T, k), -1, dtype=torch.long)
        t_lp = torch.zeros((T, k), dtype=torch.float32)
        for t in range(T):
            n = min(k, len(ids[t]))
            if n:
                t_ids[t, :n] = torch.tensor(list(ids[t])[:n], dtype=torch.long)
                t_lp[t, :n] = torch.tensor(list(logprobs[t])[:n], dtype=torch.float32)
        own = None if sampled is None else torch.tensor([float(x) for x in sampled], dtype=torch.float32)
        return cls(t_ids, t_lp, torch.tensor(list(mask), dtype=torch.bool), own)


@dataclass(frozen=True)
class ScoreRequest:
    """One row to score: the prompt text and the student's completion (text and token ids).

    ``messages``: the conversation the student's prompt was rendered from (chat prompts only); a
    teacher whose tokenizer has a chat template renders it with its own template
    (:func:`composer_plugins.core.chat.render_prompt`) instead of reading the student's prompt.
    """

    prompt: str
    completion: str
    completion_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...] = ()
    messages: tuple[Mapping[str, Any], ...] | None = None


@dataclass
class ScorerStats:
    """Per-scorer counters (reported as metrics)."""

    rows: int = 0
    calls: int = 0
    cache_hits: int = 0
    failures: int = 0
    skipped_batches: int = 0
    bytes_received: int = 0
    spent_usd: float = 0.0
    seconds: float = 0.0


class TeacherScorer:
    """Base class of scoring teachers.

    Subclasses set :attr:`kind` and implement :meth:`score`. :meth:`bind` is called once with the
    student's tokenizer before the first batch.
    """

    kind: ClassVar[str] = "scorer"

    def __init__(self, *, id: str | None = None, topk: int = 20) -> None:
        self.id = id or self.kind
        check_number(topk, "topk", f"{self.kind} scorer {self.id!r}", integer=True, minimum=1, example="20")
        self.topk = int(topk)
        self.stats = ScorerStats()
        self.student_tokenizer: Any = None
        #: The last failed call's reason (what the console warning and the end-of-run summary quote).
        self.last_error = ""

    @property
    def endpoint(self) -> str | None:
        """Where the teacher answers (a URL without user info or query string), or ``None`` for a local one."""
        return None

    def bind(self, student_tokenizer: Any) -> None:
        """Learn the student's tokenizer (its vocabulary is the one scores are returned in)."""
        self.student_tokenizer = student_tokenizer

    def score(self, requests: Sequence[ScoreRequest]) -> list[TeacherScores | None]:
        """Scores per row (``None``: not scored, e.g. the call failed)."""
        raise NotImplementedError(f"{type(self).__name__} must implement score()")

    def close(self) -> None:
        """Release the model / connections."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, topk={self.topk})"


def same_vocabulary(a: Any, b: Any) -> bool:
    """True when two tokenizers map every token string to the same id."""
    if a is b:
        return True
    try:
        return len(a) == len(b) and a.get_vocab() == b.get_vocab()
    except Exception:  # pragma: no cover - exotic tokenizers
        return False


class _Aligner:
    """Turns a teacher's scores of its own tokenization into :class:`TeacherScores` on the student's tokens."""

    def __init__(self, teacher_tokenizer: Any, student_tokenizer: Any, k: int) -> None:
        from composer_plugins.teachers.align import VocabMap

        self.teacher, self.student, self.k = teacher_tokenizer, student_tokenizer, k
        self.same = same_vocabulary(teacher_tokenizer, student_tokenizer)
        self.map = None if self.same else VocabMap(teacher_tokenizer, student_tokenizer)

    def teacher_tokens(self, req: ScoreRequest) -> tuple[list[int], list[int], list[tuple[int, int]] | None]:
        """``(teacher prompt ids, teacher completion ids, their spans or None when the vocabularies agree)``.

        A chat prompt (``req.messages``) is rendered with the teacher tokenizer's own chat template
        when it has one; otherwise the teacher reads the student's prompt (its ids when the
        vocabularies agree, else its text).
        """
        own = None
        if req.messages and getattr(self.teacher, "chat_template", None):
            from composer_plugins.core.chat import render_prompt

            own = self.teacher(render_prompt(list(req.messages), self.teacher), add_special_tokens=False)["input_ids"]
        if self.same:
            p = own or list(req.prompt_ids) or self.teacher(req.prompt, add_special_tokens=False)["input_ids"]
            return list(p), list(req.completion_ids), None
        p = own or self.teacher(req.prompt, add_special_tokens=False)["input_ids"]
        text = self.student.decode(list(req.completion_ids), skip_special_tokens=True)
        enc = self.teacher(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(p), list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def to_student(
        self,
        req: ScoreRequest,
        t_ids: Sequence[int],
        spans: Sequence[tuple[int, int]] | None,
        actual: Sequence[float],
        top_ids: Sequence[Sequence[int]],
        top_lps: Sequence[Sequence[float]],
    ) -> TeacherScores:
        if spans is None:
            return TeacherScores.from_lists(top_ids, top_lps, [True] * len(top_ids), self.k, actual)
        from composer_plugins.teachers.align import align_scores, token_spans

        assert self.map is not None
        _, s_spans = token_spans(self.student, list(req.completion_ids))
        a = align_scores(list(req.completion_ids), s_spans, t_ids, spans, actual, top_ids, top_lps, self.map, self.k)
        return TeacherScores.from_lists(a.ids, a.logprobs, a.mask, self.k, a.sampled)


# ------------------------------------------------------------------------------------------------
# (a) a local causal LM
# ------------------------------------------------------------------------------------------------
class LocalScorer(TeacherScorer):
    """A frozen local causal LM (``from_pretrained``: a directory or, with ``local_files_only: false``, an id).

    Args:
        model_path: the model to load.
        id: the teacher's name (weights and metrics use it); default the directory name.
        topk: ``K`` log-probs per student token.
        device: where the teacher runs (``cpu``, ``cuda:1`` ... its own device; default: ``cpu``).
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        batch_size: rows per forward.
        chunk_size: token rows per LM-head chunk when taking the top-k (never ``T × V`` at once).
        local_files_only: never download (default).
    """

    kind = "causal_lm"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        id: str | None = None,
        topk: int = 20,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 8,
        chunk_size: int = 256,
        local_files_only: bool = True,
    ) -> None:
        path = os.fspath(model_path)
        super().__init__(id=id or os.path.basename(path.rstrip("/")) or "causal_lm", topk=topk)
        who = f"causal_lm scorer {self.id!r}"
        check_number(batch_size, "batch_size", who, integer=True, minimum=1, example="8")
        check_number(chunk_size, "chunk_size", who, integer=True, minimum=1, example="256")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise TeacherError(f"{who}: dtype must be float32, bfloat16 or float16, got {dtype!r}", field="dtype")
        self.model_path, self.device, self.dtype = path, device, dtype
        self.batch_size, self.chunk_size, self.local_files_only = int(batch_size), int(chunk_size), local_files_only
        self._model: Any = None
        self._tok: Any = None
        self._aligner: _Aligner | None = None
        self._lock = threading.Lock()

    def load(self) -> tuple[Any, Any]:
        """Load (once) the frozen model and its tokenizer."""
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            if self.local_files_only and not os.path.isdir(self.model_path):
                raise TeacherError(
                    f"causal_lm scorer {self.id!r}: model_path {self.model_path!r} is not a directory. HINT: point it "
                    "at a save_pretrained folder, or set local_files_only: false to load a hub id",
                    field="model_path",
                )
            tok = AutoTokenizer.from_pretrained(self.model_path, local_files_only=self.local_files_only)
            model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=getattr(torch, self.dtype), local_files_only=self.local_files_only
            )
            model.to(self.device).eval().requires_grad_(False)
            self._model, self._tok = model, tok
        return self._model, self._tok

    def bind(self, student_tokenizer: Any) -> None:
        super().bind(student_tokenizer)
        _, tok = self.load()
        self._aligner = _Aligner(tok, student_tokenizer, self.topk)

    def _forward_topk(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[list[float], Any, Any]]:
        """Per row ``(actual log-probs, top ids [T, K], top log-probs [T, K])`` of the completion tokens."""
        import torch

        model, tok = self.load()
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        att = torch.zeros((len(rows), width), dtype=torch.long)
        for b, (p, c) in enumerate(rows):
            seq = p + c
            ids[b, : len(seq)] = torch.tensor(seq)
            att[b, : len(seq)] = 1
        body = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        head = model.get_output_embeddings().weight
        out = []
        with torch.no_grad():
            hidden = body(input_ids=ids.to(self.device), attention_mask=att.to(self.device)).last_hidden_state
            for b, (p, c) in enumerate(rows):
                if not c:
                    out.append(([], torch.zeros((0, self.topk), dtype=torch.long), torch.zeros((0, self.topk))))
                    continue
                start = max(len(p) - 1, 0)
                h = hidden[b, start : start + len(c)]  # position t predicts token t + 1
                target = torch.tensor(c, device=h.device)
                if not p:  # nothing predicts the first token: it is not scored
                    h, target = hidden[b, : len(c) - 1], target[1:]
                vals, idxs, act = [], [], []
                for s in range(0, h.shape[0], self.chunk_size):
                    z = (h[s : s + self.chunk_size] @ head.T).float().log_softmax(-1)
                    v, i = z.topk(min(self.topk, z.shape[-1]), -1)
                    vals.append(v.cpu())
                    idxs.append(i.cpu())
                    act.append(z.gather(-1, target[s : s + self.chunk_size, None]).squeeze(-1).cpu())
                v, i, a = torch.cat(vals), torch.cat(idxs), torch.cat(act)
                if not p:
                    v = torch.cat([torch.zeros(1, v.shape[1], device=v.device), v])
                    i = torch.cat([torch.full((1, i.shape[1]), -1, dtype=torch.long, device=i.device), i])
                    a = torch.cat([torch.full((1,), math.nan, device=a.device), a])
                out.append((a.tolist(), i, v))
        return out

    def score(self, requests: Sequence[ScoreRequest]) -> list[TeacherScores | None]:
        if self._aligner is None:
            raise TeacherError(f"causal_lm scorer {self.id!r}: bind(student_tokenizer) before score()")
        t0 = time.perf_counter()
        al = self._aligner
        toks = [al.teacher_tokens(r) for r in requests]
        results: list[TeacherScores | None] = []
        with self._lock:
            for s in range(0, len(requests), self.batch_size):
                part = toks[s : s + self.batch_size]
                scored = self._forward_topk([(p, c) for p, c, _ in part])
                for r, (p, c, spans), (actual, ids, lps) in zip(requests[s:], part, scored, strict=False):
                    sc = al.to_student(r, c, spans, actual, ids.tolist(), lps.tolist())
                    if not p:
                        sc.mask[0] = False
                    results.append(sc)
        self.stats.rows += len(requests)
        self.stats.calls += math.ceil(len(requests) / self.batch_size)
        self.stats.seconds += time.perf_counter() - t0
        return results

    def close(self) -> None:
        self._model = self._tok = None


# ------------------------------------------------------------------------------------------------
# (b) an OpenAI-compatible server returning prompt log-probs, through the replay engine
# ------------------------------------------------------------------------------------------------
Parsed = tuple[list[float], list[list[int]], list[list[float]]]


def parse_vllm_prompt_logprobs(data: Mapping[str, Any], start: int, k: int, targets: Sequence[int]) -> Parsed:
    """vLLM's ``choices[0].prompt_logprobs`` from position ``start`` on: ``(actual, top ids, top log-probs)``.

    Each position is ``None`` (the first prompt token) or ``{token_id: {"logprob", "rank", "decoded_token"}}``
    holding the top-``k`` and the prompt's own token (which may lie outside the top-k).
    """
    plp = data["choices"][0]["prompt_logprobs"]
    actual, ids, lps = [], [], []
    for t, target in enumerate(targets):
        entry = plp[start + t]
        if not isinstance(entry, Mapping):
            raise TypeError(f"prompt_logprobs[{start + t}] is {type(entry).__name__}, not a mapping")
        items = [(int(tid), float(v["logprob"] if isinstance(v, Mapping) else v)) for tid, v in entry.items()]
        own = dict(items)
        if int(target) not in own:
            raise ValueError(f"prompt_logprobs[{start + t}] lacks the prompt's own token {target}")
        actual.append(own[int(target)])
        items.sort(key=lambda x: -x[1])
        ids.append([i for i, _ in items[:k]])
        lps.append([v for _, v in items[:k]])
    return actual, ids, lps


def parse_sglang_input_logprobs(data: Mapping[str, Any], start: int, k: int, targets: Sequence[int]) -> Parsed:
    """SGLang's ``meta_info.input_token_logprobs`` / ``input_top_logprobs`` (``[logprob, id, text]`` triples)."""
    meta = data["meta_info"]
    own_lp, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    actual, ids, lps = [], [], []
    for t, target in enumerate(targets):
        lp, tid = own_lp[start + t][0], own_lp[start + t][1]
        if int(tid) != int(target):
            raise ValueError(f"input_token_logprobs[{start + t}] is token {tid}, expected {target}")
        actual.append(float(lp))
        top = sorted(((int(e[1]), float(e[0])) for e in tops[start + t] or []), key=lambda x: -x[1])[:k]
        ids.append([i for i, _ in top])
        lps.append([v for _, v in top])
    return actual, ids, lps


class ScoringClient(Teacher):
    """The replay-engine side of a :class:`ServerScorer`: one scoring request per state, over the HTTP transport.

    The state's messages are ``[user: prompt, assistant: completion + token ids]``, so the cache key is
    (teacher id, kind, model, ``{topk, api}``, prompt, completion tokens). The answer (actual, top ids,
    top log-probs of the completion tokens) is stored in the response's ``message`` as JSON lists.
    """

    kind = "score_server"

    def __init__(
        self,
        *,
        id: str,
        model: str,
        base_url: str,
        api: str,
        topk: int,
        api_key_env: str | None,
        prompt_usd_per_token: float,
        timeout_s: float,
        max_concurrency: int,
    ) -> None:
        from composer_plugins.teachers.openai_compat import OpenAITeacher

        super().__init__(
            id=id, model=model, max_tokens=1, max_concurrency=max_concurrency, prompt_usd_per_token=prompt_usd_per_token
        )
        self.api, self.topk = api, int(topk)
        self.http = OpenAITeacher(
            model,
            base_url=base_url,
            api_key_env=api_key_env,
            id=id,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
        )
        root = self.http.base_url
        self.url = root + "/completions" if api == "vllm" else root.removesuffix("/v1") + "/generate"

    def cache_params(self) -> dict[str, Any]:
        return {"topk": self.topk, "api": self.api}

    def max_cost(self, messages: Sequence[Mapping[str, Any]]) -> float:
        n = len(messages[0].get("token_ids") or ()) + len(messages[1].get("token_ids") or ())
        return self.cost(n, 1)

    def check(self) -> None:
        self.http.check()

    def scrub(self, text: str) -> str:
        return self.http.scrub(text)

    def body(self, ids: list[int], k: int) -> dict[str, Any]:
        """The request body scoring the token sequence ``ids`` (prompt + completion)."""
        if self.api == "vllm":
            return {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k}
        return {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": k,
        }

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], *, metadata: Mapping[str, Any] | None = None
    ) -> TeacherResponse:
        p = [int(t) for t in messages[0]["token_ids"]]
        c = [int(t) for t in messages[1]["token_ids"]]
        t0 = time.perf_counter()
        data = await self.http.post_json(self.url, self.body(p + c, self.topk))
        start = max(len(p), 1)
        targets = c[start - len(p) :]
        try:
            parse = parse_vllm_prompt_logprobs if self.api == "vllm" else parse_sglang_input_logprobs
            actual, ids, lps = parse(data, start, self.topk, targets)
        except Exception as e:
            raise TeacherCallError(
                f"teacher {self.id!r}: malformed prompt log-probs from {self.url} ({type(e).__name__}: {e})",
                retryable=True,
                status=200,
                billed="maybe",
                kind="malformed",
            ) from None
        skipped = len(c) - len(targets)  # no prompt: nothing predicts the first token
        usage = data.get("usage") or {}
        pt = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else len(p) + len(c)
        msg = {
            "role": "assistant",
            "content": None,
            "scores": {"skipped": skipped, "actual": actual, "ids": ids, "logprobs": lps},
        }
        return TeacherResponse(
            text="",
            message=msg,
            prompt_tokens=pt,
            completion_tokens=0,
            cost_usd=self.cost(pt, 0),
            latency_s=time.perf_counter() - t0,
            model=self.model,
            teacher=self.id,
        )

    async def aclose(self) -> None:
        await self.http.aclose()


class ServerScorer(TeacherScorer):
    """A teacher served by vLLM (``api: vllm``) or SGLang (``api: sglang``), scored through the replay engine.

    Args:
        model: the served model's name.
        base_url: ``http://host:port/v1``.
        api: ``vllm`` (``/v1/completions`` with ``prompt_logprobs``) or ``sglang`` (``/generate`` with
            ``return_logprob`` and ``top_logprobs_num``).
        tokenizer: a local directory with the teacher's tokenizer when it differs from the student's
            (null: the student's; the prompt and completion are sent as the student's token ids).
        cache: the sqlite cache/ledger file (null: no cache, no resume).
        max_usd: the dollar ceiling over the whole run (the ledger carries it across restarts).
        prompt_usd_per_token: price per scored token.
        run_id: the ledger's run name (a restarted run with the same id resumes its budget).
        max_retries, timeout_s, max_concurrency: as the replay engine's.
    """

    kind = "vllm"

    def __init__(
        self,
        model: str,
        base_url: str,
        *,
        id: str | None = None,
        api: str = "vllm",
        topk: int = 20,
        tokenizer: str | None = None,
        api_key_env: str | None = None,
        cache: str | None = None,
        max_usd: float | None = None,
        prompt_usd_per_token: float = 0.0,
        run_id: str = "teacher_distill",
        max_retries: int = 3,
        timeout_s: float = 60.0,
        max_concurrency: int = 8,
    ) -> None:
        super().__init__(id=id or model, topk=topk)
        if api not in ("vllm", "sglang"):
            raise TeacherError(f"scorer {self.id!r}: api must be 'vllm' or 'sglang', got {api!r}", field="api")
        self.client = ScoringClient(
            id=self.id,
            model=model,
            base_url=base_url,
            api=api,
            topk=topk,
            api_key_env=api_key_env,
            prompt_usd_per_token=prompt_usd_per_token,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
        )
        self.tokenizer_path, self.cache_path, self.max_usd, self.run_id = tokenizer, cache, max_usd, run_id
        self.max_retries = int(max_retries)
        self._cache: Any = None
        self._aligner: _Aligner | None = None

    def bind(self, student_tokenizer: Any) -> None:
        super().bind(student_tokenizer)
        tok = student_tokenizer
        if self.tokenizer_path is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
        self._aligner = _Aligner(tok, student_tokenizer, self.topk)

    @property
    def endpoint(self) -> str | None:
        from composer_plugins.core.config import redact_url

        return redact_url(str(self.client.http.base_url))

    @property
    def cache(self) -> Any:
        if self._cache is None and self.cache_path is not None:
            from composer_plugins.teachers.cache import ReplayCache

            self._cache = ReplayCache(self.cache_path)
        return self._cache

    def score(self, requests: Sequence[ScoreRequest]) -> list[TeacherScores | None]:
        from composer_plugins.teachers.engine import ReplayEngine, RetryPolicy
        from composer_plugins.teachers.traces import TraceState

        if self._aligner is None:
            raise TeacherError(f"scorer {self.id!r}: bind(student_tokenizer) before score()")
        t0 = time.perf_counter()
        al = self._aligner
        toks = [al.teacher_tokens(r) for r in requests]
        states = [
            TraceState(
                state_id=str(i),
                messages=[
                    {"role": "user", "content": r.prompt, "token_ids": p},
                    {"role": "assistant", "content": r.completion, "token_ids": c},
                ],
                student_action={"role": "assistant", "content": r.completion},
            )
            for i, (r, (p, c, _)) in enumerate(zip(requests, toks, strict=True))
        ]
        ceiling = self.max_usd
        if ceiling is not None and self.cache is None:  # no ledger: the ceiling is kept across calls in memory
            ceiling = max(0.0, ceiling - self.stats.spent_usd)
        engine = ReplayEngine(
            [self.client],
            cache=self.cache,
            max_usd=ceiling,
            run_id=self.run_id,
            retry=RetryPolicy(max_retries=self.max_retries, backoff_base_s=0.05, backoff_max_s=2.0),
            progress=False,
        )
        res = asyncio.run(engine.arun(states))
        out: list[TeacherScores | None] = []
        for i, (r, (_p, c, spans)) in enumerate(zip(requests, toks, strict=True)):
            resp = res.responses[str(i)].get(self.id)
            if resp is None:
                out.append(None)
                continue
            s = resp.message["scores"]
            self.stats.bytes_received += sum(8 * len(x) for x in s["ids"]) + 8 * len(s["actual"])
            pad = s["skipped"]
            actual = [math.nan] * pad + list(s["actual"])
            ids = [[]] * pad + list(s["ids"])
            lps = [[]] * pad + list(s["logprobs"])
            sc = al.to_student(r, c, spans, actual, ids, lps)
            if pad:
                sc.mask[:pad] = False
            out.append(sc)
        st = res.stats
        if res.failures:
            self.last_error = res.failures[-1].message
        self.stats.rows += len(requests)
        self.stats.calls += st.calls
        self.stats.cache_hits += st.cache_hits
        self.stats.failures += st.failures
        self.stats.spent_usd += st.spent_usd + st.uncertain_usd
        self.stats.seconds += time.perf_counter() - t0
        return out

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None


# ------------------------------------------------------------------------------------------------
# asynchronous scoring with a deadline
# ------------------------------------------------------------------------------------------------
@dataclass
class ScoringJob:
    """The scorers' futures for one batch (from :meth:`ScoringPool.submit`)."""

    futures: dict[str, cf.Future]
    started: float = field(default_factory=time.monotonic)
    #: Why a teacher was left out of the last :meth:`collect` (failed: its error; late: the deadline).
    reasons: dict[str, str] = field(default_factory=dict)

    def collect(self, deadline_s: float | None) -> tuple[dict[str, list[TeacherScores | None]], dict[str, float]]:
        """Wait at most ``deadline_s`` (from now) for the scorers; ``(scores by teacher, metrics)``.

        A scorer still running at the deadline, or one that failed, is left out of the scores (its
        term is skipped for this batch), logged, and reported as ``teacher/<id>/skipped = 1``.
        """
        done, _ = cf.wait(list(self.futures.values()), timeout=deadline_s)
        scores: dict[str, list[TeacherScores | None]] = {}
        metrics: dict[str, float] = {"teacher/wait_s": time.monotonic() - self.started}
        for name, fut in self.futures.items():
            if fut in done and fut.exception() is None:
                scores[name] = fut.result()
                metrics[f"teacher/{name}/skipped"] = 0.0
                continue
            if fut in done:
                log.warning("teacher %r failed to score this batch; its term is skipped: %s", name, fut.exception())
                self.reasons[name] = f"failed: {type(fut.exception()).__name__}: {fut.exception()}"
            else:
                log.warning(
                    "teacher %r missed the %.3gs deadline; its term is skipped for this batch", name, deadline_s or 0.0
                )
                self.reasons[name] = f"missed the {deadline_s or 0.0:.3g}s deadline"
                fut.cancel()
            metrics[f"teacher/{name}/skipped"] = 1.0
        return scores, metrics


class ScoringPool:
    """Runs each scorer on its own worker thread, so scoring overlaps the trainer's work.

    ``submit`` returns at once; ``ScoringJob.collect(deadline)`` gathers what finished. A scorer
    that missed a deadline keeps its thread until it finishes (it is not interrupted); the next
    batch queues behind it on that thread.
    """

    def __init__(self, scorers: Sequence[TeacherScorer]) -> None:
        ids = [s.id for s in scorers]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise TeacherError(f"scoring teachers need distinct ids; duplicated: {dupes}. HINT: give each an `id:`")
        self.scorers = list(scorers)
        self._pools = {s.id: cf.ThreadPoolExecutor(1, thread_name_prefix=f"score-{s.id}") for s in scorers}

    def bind(self, student_tokenizer: Any) -> None:
        for s in self.scorers:
            s.bind(student_tokenizer)

    def submit(self, requests: Sequence[ScoreRequest]) -> ScoringJob:
        reqs = list(requests)
        return ScoringJob({s.id: self._pools[s.id].submit(s.score, reqs) for s in self.scorers})

    def step_report(self, reasons: Mapping[str, str] | None = None) -> list[str]:
        """One line per teacher that failed rows (or was left out: ``reasons``) since the last report.

        Called once per step; each line names the teacher, its endpoint (no secrets), the failed rows of
        the step and the reason. The counts also add up to :meth:`summary`.
        """
        reasons = dict(reasons or {})
        seen = getattr(self, "_seen", None)
        if seen is None:
            seen = self._seen = {s.id: (0, 0) for s in self.scorers}
            self._bad_steps = dict.fromkeys(seen, 0)
        lines = []
        for s in self.scorers:
            f0, r0 = seen[s.id]
            failed, rows = s.stats.failures - f0, s.stats.rows - r0
            seen[s.id] = (s.stats.failures, s.stats.rows)
            if not failed and s.id not in reasons:
                continue
            self._bad_steps[s.id] += 1
            what = (
                f"{failed} of {rows} rows failed this step" + (f" ({s.last_error})" if s.last_error else "")
                if failed
                else reasons[s.id]
            )
            lines.append(f"teacher {s.id!r}{_at(s)}: {what}; its term is skipped for them")
        return lines

    def summary(self) -> list[str]:
        """One line per teacher that failed at least once over the run: failed rows, steps and the last reason."""
        bad = getattr(self, "_bad_steps", {})
        lines = []
        for s in self.scorers:
            if not s.stats.failures and not bad.get(s.id):
                continue
            last = f"; last error: {s.last_error}" if s.last_error else ""
            lines.append(
                f"teacher {s.id!r}{_at(s)}: {s.stats.failures} of {s.stats.rows} rows failed over the run, "
                f"in {bad.get(s.id, 0)} steps{last}"
            )
        return lines

    def stats(self) -> dict[str, float]:
        """Cumulative per-teacher counters, as metrics."""
        out: dict[str, float] = {}
        for s in self.scorers:
            for k, v in vars(s.stats).items():
                out[f"teacher/{s.id}/{k}"] = float(v)
        return out

    def close(self) -> None:
        for p in self._pools.values():
            p.shutdown(wait=False, cancel_futures=True)
        for s in self.scorers:
            s.close()


def _at(scorer: TeacherScorer) -> str:
    return f" ({scorer.endpoint})" if scorer.endpoint else ""


def build_scorers(specs: Sequence[Any]) -> list[TeacherScorer]:
    """Scorers from registry specs (``{kind: causal_lm, model_path: ...}`` or ``{name: vllm, ...}``) or objects."""
    from composer_plugins.core.config import build_component

    out: list[TeacherScorer] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, TeacherScorer):
            out.append(spec)
            continue
        if isinstance(spec, Mapping) and "kind" in spec and "name" not in spec:
            spec = {"name": spec["kind"], **{k: v for k, v in spec.items() if k != "kind"}}
        built = build_component("scorers", spec, key=f"teachers[{i}]")
        if not isinstance(built, TeacherScorer):
            raise TeacherError(f"teachers[{i}]: {spec!r} built a {type(built).__name__}, not a TeacherScorer")
        out.append(built)
    return out
