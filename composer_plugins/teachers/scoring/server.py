"""The ``vllm`` / ``sglang`` scorers: prompt log-probs from an OpenAI-compatible server, through the replay engine."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from composer_plugins.teachers.base import Teacher, TeacherCallError, TeacherError, TeacherResponse
from composer_plugins.teachers.scoring.contract import ScoreRequest, TeacherScorer, TeacherScores, _Aligner

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
        scores = {"skipped": skipped, "actual": actual, "ids": ids, "logprobs": lps}
        msg = {"role": "assistant", "content": None, "scores": scores}
        return self.response("", pt, message=msg, latency_s=time.perf_counter() - t0)

    async def aclose(self) -> None:
        await self.http.aclose()


class ServerScorer(TeacherScorer):
    """A teacher served by vLLM (``api: vllm``) or SGLang (``api: sglang``), scored through the replay engine.

    ``tokenizer``: a local directory with the teacher's tokenizer when it differs from the student's (null: the
    student's ids are sent). ``cache``, ``max_usd``, ``run_id``: the replay engine's sqlite cache/ledger, ceiling
    and run name (null cache: no resume). See docs/losses.md, "Teachers that score".
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

        t0 = time.perf_counter()
        al, toks = self._aligned(requests)
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
