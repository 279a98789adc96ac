"""A loopback inference server for the ``server`` rollout generator (tests, benchmarks, demos).

It speaks the parts of vLLM's and SGLang's HTTP APIs the generator and the scorers use, over HF ``generate``
on a local policy, in its own process (``python -m composer_plugins.testing.loopback_server --model PATH
--port 0``; it prints ``LISTENING <port>`` once ready, and :class:`RolloutServerProcess` starts and stops it):

* ``POST /v1/completions`` with a token-id ``prompt``: ``n`` completions with vLLM's ``token_ids`` and
  ``token_id:<id>`` log-probs at the request's temperature, made by
  :func:`~composer_plugins.models.generation.generate_completions` with the request's seed (so the same seed
  gives the same tokens as in-process sampling); with ``prompt_logprobs: K``, vLLM's prompt log-probs and
  nothing generated;
* ``POST /generate`` (SGLang) with ``return_logprob`` and ``top_logprobs_num``: the input token log-probs;
* ``POST /update_weights_from_disk`` (SGLang's route): serve a ``save_pretrained`` folder from then on;
* the teachers' loopback control routes and planned faults (:mod:`composer_plugins.testing.teacher_loopback`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import threading
import time
from typing import Any

from composer_plugins.testing.teacher_loopback import LoopbackProcess, LoopbackServer, ServerConfig, serve_forever


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj).encode()


class RolloutLoopbackServer(LoopbackServer):
    """The teachers' loopback server plus ``/v1/completions`` over a local policy and a weight reload."""

    def __init__(self, config: ServerConfig, model_path: str, num_threads: int = 1) -> None:
        import torch

        torch.set_num_threads(num_threads)
        super().__init__(config)
        self._lock = threading.Lock()
        self.reloads = 0
        self._load(model_path)

    def _load(self, path: str) -> None:
        from composer_plugins.models.tiny import load_policy

        model, tok = load_policy(path)
        with self._lock:
            self.model, self.tokenizer, self.model_path = model.eval(), tok, path

    def _sample(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        from composer_plugins.models.generation import generate_completions
        from composer_plugins.models.logprobs import completion_logprobs_no_grad

        prompt = [int(t) for t in req["prompt"]]
        n = int(req.get("n") or 1)
        temperature = float(req.get("temperature", 1.0))
        top_k = int(req.get("top_k") or 0)
        with self._lock:
            model, tok = self.model, self.tokenizer
            ro = generate_completions(
                model,
                tok,
                None,
                n,
                max_new_tokens=int(req.get("max_tokens") or 16),
                temperature=temperature if temperature > 0 else 1.0,
                top_p=float(req.get("top_p", 1.0)),
                top_k=max(0, top_k),
                do_sample=temperature > 0,
                seed=req.get("seed"),
                prompt_token_ids=[prompt],
            )
            logps = completion_logprobs_no_grad(
                model,
                ro.prompt_ids,
                ro.prompt_mask,
                ro.completion_ids,
                ro.completion_mask,
                temperature=temperature if temperature > 0 else 1.0,
            )
        choices = []
        for i in range(n):
            keep = ro.completion_mask[i].bool()
            ids = ro.completion_ids[i][keep].tolist()
            lps = logps[i][keep].tolist()
            ended = bool(ids) and ids[-1] == tok.eos_token_id
            choice: dict[str, Any] = {
                "index": i,
                "text": tok.decode(ids, skip_special_tokens=True),
                "finish_reason": "stop" if ended else "length",
                "token_ids": ids if req.get("return_token_ids") else None,
            }
            if req.get("logprobs") is not None:
                choice["logprobs"] = {
                    "tokens": [f"token_id:{t}" for t in ids]
                    if req.get("return_tokens_as_token_ids")
                    else [tok.decode([t]) for t in ids],
                    "token_logprobs": lps,
                }
            choices.append(choice)
        return choices

    def _scores(self, ids: list[int], k: int) -> list[tuple[float, list[int], list[float]]]:
        """For positions 1.. of ``ids``: (log-prob of the token there, top-k ids, top-k log-probs)."""
        import torch

        with self._lock, torch.no_grad():
            x = torch.tensor([ids])
            logp = self.model(input_ids=x).logits[0, :-1].float().log_softmax(-1)
            top = logp.topk(min(k, logp.shape[-1]), -1)
            own = logp.gather(-1, x[0, 1:, None]).squeeze(-1)
        return [(float(own[t]), top.indices[t].tolist(), top.values[t].tolist()) for t in range(len(ids) - 1)]

    def _prompt_logprobs(self, ids: list[int], k: int) -> list[dict[str, Any]]:
        """vLLM's ``prompt_logprobs`` after its leading ``None``: per token, its top-k and the token itself."""
        tok = self.tokenizer
        out = []
        for t, (own, top_ids, top_lps) in enumerate(self._scores(ids, k)):
            entry = {
                str(i): {"logprob": lp, "rank": r + 1, "decoded_token": tok.decode([i])}
                for r, (i, lp) in enumerate(zip(top_ids, top_lps, strict=True))
            }
            target = ids[t + 1]
            if str(target) not in entry:
                entry[str(target)] = {"logprob": own, "rank": k + 1, "decoded_token": tok.decode([target])}
            out.append(entry)
        return out

    async def generate(self, request: Any) -> Any:
        """SGLang's ``/generate`` scoring form: ``input_ids``, ``return_logprob``, ``top_logprobs_num``."""
        from aiohttp import web

        req = json.loads(await request.read())
        self.requests += 1
        ids = [int(t) for t in req["input_ids"]]
        k = int(req.get("top_logprobs_num") or 0)
        ident = hashlib.sha256(json.dumps(req, sort_keys=True).encode()).hexdigest()[:24]
        self.attempts[ident] += 1
        scores = await asyncio.to_thread(self._scores, ids, k)
        self._bill(ident, len(ids), 0)
        self.by_status["200"] += 1
        tok = self.tokenizer
        meta = {
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "input_token_logprobs": [[None, ids[0], None]]
            + [[own, ids[t + 1], None] for t, (own, _, _) in enumerate(scores)],
            "input_top_logprobs": [None]
            + [[[lp, i, tok.decode([i])] for i, lp in zip(ti, tl, strict=True)] for _, ti, tl in scores],
        }
        return web.Response(body=_json_bytes({"text": "", "meta_info": meta}), content_type="application/json")

    async def completions(self, request: Any) -> Any:
        from aiohttp import web

        raw = await request.read()
        self.requests += 1
        try:
            req = json.loads(raw)
            if not isinstance(req.get("prompt"), list):
                raise ValueError("prompt must be a list of token ids")
        except Exception as e:
            self.by_status["400"] += 1
            return web.Response(status=400, body=_json_bytes({"error": {"message": f"bad request: {e}"}}))
        ident = hashlib.sha256(json.dumps(req, sort_keys=True).encode()).hexdigest()[:24]
        attempt, fault = self._attempt(ident)
        failed = await self.inject_fault(request, fault, b'{"id": "x", "choices": [{"token_ids": [1, 2')
        if failed is not None:
            return failed
        if req.get("prompt_logprobs") is not None:  # scoring: vLLM's prompt log-probs, nothing generated
            plp = await asyncio.to_thread(self._prompt_logprobs, req["prompt"], int(req["prompt_logprobs"]))
            self.by_status["200"] += 1
            self._bill(ident, len(req["prompt"]), 0)
            body = {
                "id": f"cmpl-{ident[:12]}-{attempt}",
                "object": "text_completion",
                "model": req.get("model", "policy"),
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "finish_reason": "length",
                        "logprobs": None,
                        "prompt_logprobs": [None, *plp],
                    }
                ],
                "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": 0},
            }
            return web.Response(body=_json_bytes(body), content_type="application/json")
        choices = await asyncio.to_thread(self._sample, req)
        self.by_status["200"] += 1
        n_out = sum(len(c.get("token_ids") or c.get("logprobs", {}).get("tokens", [])) for c in choices)
        body = {
            "id": f"cmpl-{ident[:12]}-{attempt}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.get("model", "policy"),
            "choices": choices,
            "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": n_out},
        }
        return web.Response(body=_json_bytes(body), content_type="application/json")

    async def update_weights_from_disk(self, request: Any) -> Any:
        from aiohttp import web

        try:
            path = str(json.loads(await request.read())["model_path"])
            await asyncio.to_thread(self._load, path)
        except Exception as e:
            return web.Response(body=_json_bytes({"success": False, "message": f"{type(e).__name__}: {e}"}))
        self.reloads += 1
        return web.Response(body=_json_bytes({"success": True, "message": f"loaded {path}"}))

    async def stats(self, request: Any) -> Any:
        from aiohttp import web

        resp = await super().stats(request)
        data = json.loads(resp.body)
        data.update(reloads=self.reloads, model_path=self.model_path)
        return web.Response(body=_json_bytes(data), content_type="application/json")

    def app(self) -> Any:
        app = super().app()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_post("/generate", self.generate)
        return app


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (``python -m composer_plugins.testing.loopback_server``)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", required=True, help="a save_pretrained folder to serve")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--config", default=None, help="JSON ServerConfig fields (latency, faults)")
    a = ap.parse_args(argv)
    cfg = ServerConfig()
    for k, v in json.loads(a.config or "{}").items():
        setattr(cfg, k, v)
    serve_forever(lambda: RolloutLoopbackServer(cfg, a.model, a.threads).app(), a.host, a.port)


class RolloutServerProcess(LoopbackProcess):
    """Start :mod:`composer_plugins.testing.loopback_server` serving ``model`` in a subprocess (context manager).

    Example::

        with RolloutServerProcess(model="runs/x/model", fault_rate=0.3) as srv:
            gen = ServerGenerator(srv.base_url)
    """

    module = "composer_plugins.testing.loopback_server"

    def __init__(
        self, *, model: str, threads: int = 1, env: dict[str, str] | None = None, cpu: int | None = None, **config: Any
    ) -> None:
        super().__init__(env=env, cpu=cpu, args=["--model", str(model), "--threads", str(threads)], **config)


if __name__ == "__main__":
    main()
