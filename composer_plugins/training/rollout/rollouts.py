"""Rollout generators: what samples the ``G`` completions of a step (registry kind ``rollout_generators``).

Chosen by ``rollout.generator``: ``hf`` (default, HF ``generate`` in process) or ``server`` (an
OpenAI-compatible ``/v1/completions`` endpoint, weights reloaded every ``sync_every`` steps, its log-probs
used for the importance-sampling correction). The :class:`RolloutGenerator` protocol and the capability
protocols :class:`WeightSyncing` and :class:`EpisodeGenerator` are checked with ``isinstance``; see
docs/training.md "Rollouts from an inference server" and docs/plugins.md ``register_rollout_generators``.
"""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from composer_plugins.core.errors import ComposerPluginsError

if TYPE_CHECKING:
    from composer_plugins.core.config import Config
    from composer_plugins.models.generation import Rollout

__all__ = [
    "EpisodeGenerator",
    "HFGenerator",
    "RolloutGenerator",
    "RolloutServerError",
    "ServerGenerator",
    "WeightSyncing",
    "as_rollout_generator",
]


@runtime_checkable
class RolloutGenerator(Protocol):
    """What samples the ``G`` completions of a step: rows ``[i*G, (i+1)*G)`` of the rollout are prompt ``i``'s."""

    def generate(
        self, policy: Any, tokenizer: Any, prompts: Sequence[str], num_generations: int, *, seed: int | None, **kw: Any
    ) -> Rollout:
        """``num_generations`` completions per prompt (same seed: same tokens), sampled with the keyword settings
        ``temperature``, ``top_p`` (1.0), ``top_k`` (0), ``max_new_tokens`` and ``max_prompt_length`` (``None``)."""
        ...


@runtime_checkable
class WeightSyncing(Protocol):
    """A generator whose engine holds its own copy of the weights: the trainer pushes the policy when due."""

    #: Push the weights every this many optimizer steps (0: never, or only at the start).
    sync_every: int
    #: The optimizer step of the last push (``None``: never); every data-parallel rank sets it after a push.
    last_synced: int | None

    def wants_sync(self, step: int) -> bool:
        """True when the engine should get the policy's weights before step ``step``'s rollout."""
        ...

    def sync(self, policy: Any, tokenizer: Any, step: int, out_dir: str | Path | None = None) -> Any:
        """Push ``policy``'s weights to the engine (rank 0 only); set :attr:`last_synced`."""
        ...


@runtime_checkable
class EpisodeGenerator(Protocol):
    """A generator of multi-turn episodes: the env's ``reset``/``step`` score every turn."""

    def episodes(
        self, policy: Any, tokenizer: Any, env: Any, tasks: Sequence[Mapping[str, Any]], num_generations: int, **kw: Any
    ) -> tuple[Rollout, list[float], list[Any]]:
        """``(rollout, rewards, feedback)`` of the ``num_generations`` episodes of each task (keywords: ``seed``,
        ``max_prompt_length`` and the sampling settings, as :meth:`RolloutGenerator.generate`)."""
        ...


def as_rollout_generator(obj: Any, key: str = "rollout.generator", src: Config | None = None) -> RolloutGenerator:
    """``obj`` if it keeps the :class:`RolloutGenerator` protocol, else a :class:`ConfigError` located at ``key``."""
    if isinstance(obj, RolloutGenerator):
        return obj
    from composer_plugins.core.config import Config

    raise (src if src is not None else Config()).error(
        key,
        f"{type(obj).__module__}.{type(obj).__qualname__} is not a rollout generator: it has no "
        "generate(policy, tokenizer, prompts, num_generations, *, seed, temperature, ...) method — register a "
        "class that keeps composer_plugins.training.rollout.rollouts.RolloutGenerator.",
    )


class RolloutServerError(ComposerPluginsError):
    """The inference server could not serve a request (after its retries) or reload the weights."""


class HFGenerator:
    """Sampling with HF ``generate`` on the training policy (one batched call per step, KV cache on).

    ``compile``: ``rollout.compile`` (``models.generation.CompileMode``: a static cache and a compiled decode
    step ``on``, ``off``, ``auto`` = on CUDA only).
    """

    def __init__(self, compile: str = "auto") -> None:
        from composer_plugins.models import COMPILE_MODES

        if isinstance(compile, bool):  # YAML reads a bare on/off as a boolean
            compile = "on" if compile else "off"
        if compile not in COMPILE_MODES:
            raise ValueError(f"HFGenerator(compile={compile!r}): expected one of {', '.join(COMPILE_MODES)}")
        self.compile = compile

    def generate(
        self, policy: Any, tokenizer: Any, prompts: Sequence[str] | None, num_generations: int, **sampling: Any
    ) -> Any:
        """``num_generations`` completions per prompt: :func:`~composer_plugins.models.generation.generate_completions`
        with the :class:`RolloutGenerator` settings (``seed``, ``temperature`` ...); ``prompt_token_ids``: already
        tokenized prompts (``prompts`` is then ``None``), as the multi-turn generator continues a trajectory."""
        from composer_plugins.models.generation import generate_completions

        return generate_completions(policy, tokenizer, prompts, num_generations, compile=self.compile, **sampling)

    def close(self) -> None:
        """Nothing to release."""


def prompt_seed(seed: int | None, i: int) -> int | None:
    """The sampling seed sent with prompt ``i`` of a step sampled with ``seed``."""
    if seed is None:
        return None
    from composer_plugins.training.rollout.rewards import derive_seed

    return derive_seed(seed, 7, i)


class ServerGenerator:
    """Completions from an OpenAI-compatible server that reports token ids and log-probs.

    Args:
        base_url: the server's OpenAI root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name sent with every request (vLLM: the served model's name or path).
        api_key_env: environment variable holding a key (``None``: no ``Authorization`` header).
        max_concurrency: requests in flight at once (one request per prompt, ``n = G``).
        timeout_s: limit of one attempt.
        max_retries, backoff_base_s, backoff_max_s: retry policy of every request
            (:class:`~composer_plugins.teachers.engine.RetryPolicy`, ``Retry-After`` honoured).
        sync_every: push the policy's weights every this many optimizer steps (0: never).
        sync_at_start: push them before the first rollout too (the server may hold other weights).
        weights_dir: where the policy is saved for the server to load (default: a ``rollout_weights``
            folder in the run's output directory). Must be readable by the server at the same path.
        reload_path: route on the server root that loads weights from ``{"model_path": dir}``
            (SGLang: ``/update_weights_from_disk``).
        extra_body: more request fields (e.g. vLLM ``{"skip_special_tokens": false}``).
    """

    def __init__(
        self,
        base_url: str,
        model: str = "policy",
        *,
        api_key_env: str | None = None,
        max_concurrency: int = 16,
        timeout_s: float = 300.0,
        max_retries: int = 6,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        sync_every: int = 1,
        sync_at_start: bool = True,
        weights_dir: str | None = None,
        reload_path: str = "/update_weights_from_disk",
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        from composer_plugins.teachers.engine import RetryPolicy
        from composer_plugins.teachers.openai_compat import OpenAITeacher

        for k, v in (("max_concurrency", max_concurrency), ("max_retries", max_retries + 1)):
            if not isinstance(v, int) or v < 1:
                raise RolloutServerError(f"rollout.generator.{k} must be a positive integer, got {v!r}")
        if not isinstance(sync_every, int) or sync_every < 0:
            raise RolloutServerError(f"rollout.generator.sync_every must be an integer >= 0, got {sync_every!r}")
        # the teachers' HTTP transport: key handling, connection limits, one error mapping
        self.transport = OpenAITeacher(
            model,
            base_url=base_url,
            api_key_env=api_key_env,
            id="rollout-server",
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
        )
        self.base_url = self.transport.base_url
        self.root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.model = model
        self.max_concurrency = max_concurrency
        self.retry = RetryPolicy(max_retries=max_retries, backoff_base_s=backoff_base_s, backoff_max_s=backoff_max_s)
        self.sync_every = sync_every
        self.sync_at_start = bool(sync_at_start)
        self.weights_dir = weights_dir
        self.reload_path = "/" + reload_path.lstrip("/")
        self.extra_body = dict(extra_body or {})
        self.last_synced: int | None = None
        self.retries = 0
        self._rng = random.Random(0)

    # -- sampling ----------------------------------------------------------------------
    def request_body(
        self,
        prompt_ids: Sequence[int],
        n: int,
        *,
        seed: int | None,
        temperature: float,
        top_p: float,
        top_k: int,
        max_new_tokens: int,
        do_sample: bool = True,
    ) -> dict[str, Any]:
        """The ``/v1/completions`` request for one prompt (token ids in, token ids and log-probs out).

        ``logprobs: 0`` asks for the sampled token's log-prob only; ``return_tokens_as_token_ids``
        makes vLLM spell the tokens ``token_id:<id>``; ``return_token_ids`` (vLLM >= 0.10.2) adds
        the ids as a list.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": max_new_tokens,
            "temperature": float(temperature) if do_sample else 0.0,
            "top_p": float(top_p),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        if top_k and top_k > 0:
            body["top_k"] = int(top_k)
        if seed is not None:
            body["seed"] = int(seed)
        body.update(self.extra_body)
        return body

    async def _call(self, url: str, body: Mapping[str, Any]) -> Any:
        from composer_plugins.teachers.base import TeacherCallError

        for attempt in range(self.retry.max_retries + 1):
            try:
                return await self.transport.post_json(url, body)
            except TeacherCallError as e:
                if not e.retryable or attempt == self.retry.max_retries:
                    raise RolloutServerError(
                        f"rollout server: {e} (after {attempt + 1} attempt(s)). HINT: check that the server at "
                        f"{self.root} is up and serves model {self.model!r}"
                    ) from e
                self.retries += 1
                await asyncio.sleep(self.retry.delay(attempt, e.retry_after, self._rng))
        raise AssertionError("unreachable")

    async def _sample_all(self, bodies: Sequence[Mapping[str, Any]]) -> list[Any]:
        sem = asyncio.Semaphore(self.max_concurrency)
        url = self.base_url + "/completions"

        async def one(body: Mapping[str, Any]) -> Any:
            async with sem:
                return await self._call(url, body)

        try:
            return list(await asyncio.gather(*(one(b) for b in bodies)))
        finally:
            await self.transport.aclose()

    def generate(
        self,
        policy: Any,
        tokenizer: Any,
        prompts: Sequence[str],
        num_generations: int,
        *,
        seed: int | None,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 32,
        max_prompt_length: int | None = None,
        do_sample: bool = True,
    ) -> Any:
        """``num_generations`` completions per prompt from the server; its log-probs in ``extra["sampling_logprobs"]``.

        Prompt ``i`` is sent as token ids (left-truncated to ``max_prompt_length``) with the seed
        :func:`prompt_seed` ``(seed, i)``.
        """
        import torch

        from composer_plugins.models.generation import Rollout, completion_mask_from_ids, tokenize_prompts

        device = next(policy.parameters()).device if policy is not None else torch.device("cpu")
        ids, mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, "cpu")
        rows = [ids[i][mask[i].bool()].tolist() for i in range(len(prompts))]
        settings = dict(
            temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, do_sample=do_sample
        )
        bodies = [
            self.request_body(r, num_generations, seed=prompt_seed(seed, i), **settings) for i, r in enumerate(rows)
        ]
        answers = asyncio.run(self._sample_all(bodies))
        choices = [c for i, ans in enumerate(answers) for c in parse_choices(ans, num_generations, where=f"prompt {i}")]
        tokens, logps = [t for t, _ in choices], [lp for _, lp in choices]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        width = max(1, max(len(t) for t in tokens))
        cids = torch.full((len(tokens), width), pad, dtype=torch.long)
        slp = torch.zeros((len(tokens), width), dtype=torch.float32)
        for j, (t, lp) in enumerate(zip(tokens, logps, strict=True)):
            if t:
                cids[j, : len(t)] = torch.tensor(t, dtype=torch.long)
                slp[j, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        cmask = completion_mask_from_ids(cids, tokenizer.eos_token_id)
        for j, t in enumerate(tokens):  # the padding past a completion's last token
            cmask[j, len(t) :] = 0
        cids = torch.where(cmask.bool(), cids, torch.full_like(cids, pad))
        G = num_generations
        ro = Rollout(
            prompt_ids=ids.repeat_interleave(G, dim=0).to(device),
            prompt_mask=mask.repeat_interleave(G, dim=0).to(device),
            completion_ids=cids.to(device),
            completion_mask=cmask.to(device),
            completions=list(tokenizer.batch_decode(cids, skip_special_tokens=True)),
            prompts=[p for p in prompts for _ in range(G)],
            group_index=torch.arange(len(prompts), device=device).repeat_interleave(G),
            num_generations=G,
        )
        ro.extra["sampling_logprobs"] = (slp * cmask).to(device)
        return ro

    # -- weight sync -------------------------------------------------------------------
    def wants_sync(self, step: int) -> bool:
        """True when the server should get the policy's weights before step ``step``'s rollout."""
        if self.sync_every <= 0:
            return self.last_synced is None and self.sync_at_start
        if self.last_synced is None:
            return self.sync_at_start or step >= self.sync_every
        return step - self.last_synced >= self.sync_every

    def sync(self, policy: Any, tokenizer: Any, step: int, out_dir: str | Path | None = None) -> Path:
        """Save the policy (``save_pretrained``) and ask the server to load it; returns the folder it loaded."""
        root = Path(self.weights_dir or Path(out_dir or ".") / "rollout_weights")
        target = root / f"step-{step}"
        if target.exists():
            shutil.rmtree(target)
        policy.save_pretrained(target)
        tokenizer.save_pretrained(target)
        ans = asyncio.run(self._reload(str(target.resolve())))
        if isinstance(ans, Mapping) and ans.get("success") is False:
            raise RolloutServerError(
                f"rollout server at {self.root} refused to load {target}: {str(ans.get('message'))[:300]}"
            )
        for old in root.glob("step-*"):  # keep only what the server now serves
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
        self.last_synced = step
        return target

    async def _reload(self, path: str) -> Any:
        try:
            return await self._call(self.root + self.reload_path, {"model_path": path})
        finally:
            await self.transport.aclose()

    def close(self) -> None:
        """Nothing held between steps (each step's HTTP session is closed after it)."""


def parse_choices(answer: Any, n: int, where: str = "") -> list[tuple[list[int], list[float]]]:
    """``[(token ids, log-probs)]`` of the ``n`` choices of a ``/v1/completions`` answer, in ``index`` order.

    Token ids come from ``choices[i].token_ids`` (vLLM ``return_token_ids``) or from the
    ``token_id:<id>`` strings of ``logprobs.tokens`` (``return_tokens_as_token_ids``); log-probs
    from ``logprobs.token_logprobs``.
    """
    if not isinstance(answer, Mapping) or not isinstance(answer.get("choices"), list):
        raise RolloutServerError(f"rollout server: {where}: the answer has no 'choices' list")
    choices = sorted(answer["choices"], key=lambda c: int(c.get("index", 0)))
    if len(choices) != n:
        raise RolloutServerError(f"rollout server: {where}: asked for n={n} completions, got {len(choices)}")
    out = []
    for c in choices:
        lp = c.get("logprobs") or {}
        ids = c.get("token_ids")
        if ids is None:
            toks = lp.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
                raise RolloutServerError(
                    f"rollout server: {where}: no token ids in the answer. HINT: the server must honour "
                    "return_tokens_as_token_ids (vLLM) or return choices[].token_ids"
                )
            ids = [int(t.split(":", 1)[1]) for t in toks]
        vals = lp.get("token_logprobs")
        if not isinstance(vals, list) or len(vals) != len(ids):
            raise RolloutServerError(
                f"rollout server: {where}: no per-token log-probs for the {len(ids)} sampled tokens. "
                "HINT: the request sets logprobs: 0; the server must return logprobs.token_logprobs"
            )
        out.append(([int(i) for i in ids], [float("nan") if v is None else float(v) for v in vals]))
    return out
