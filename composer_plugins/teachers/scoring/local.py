"""The ``causal_lm`` scorer: a frozen local causal LM, top-k taken chunk by chunk through its LM head."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from composer_plugins.teachers.base import TeacherError, check_number
from composer_plugins.teachers.hf import load_causal_lm
from composer_plugins.teachers.scoring.contract import ScoreRequest, TeacherScorer, TeacherScores, _Aligner


class LocalScorer(TeacherScorer):
    """A frozen local causal LM (``from_pretrained``: a directory or, with ``local_files_only: false``, an id).

    ``id`` (default: the directory name) names it in weights and metrics; ``chunk_size`` token rows go through the
    LM head at once when taking the top-k (never ``T × V``).
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
        self._lock = threading.Lock()

    def load(self) -> tuple[Any, Any]:
        """Load (once) the frozen model and its tokenizer."""
        if self._model is None:
            if self.local_files_only and not os.path.isdir(self.model_path):
                raise TeacherError(
                    f"causal_lm scorer {self.id!r}: model_path {self.model_path!r} is not a directory. HINT: point it "
                    "at a save_pretrained folder, or set local_files_only: false to load a hub id",
                    field="model_path",
                )
            model, tok = load_causal_lm(self.model_path, self.dtype, self.device, self.local_files_only)
            self._model, self._tok = model.requires_grad_(False), tok
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
        # position t predicts token t + 1; a row without a prompt has nothing predicting its first token
        firsts = [0 if p else 1 for p, _ in rows]
        lens = [max(len(c) - f, 0) for (_, c), f in zip(rows, firsts, strict=True)]
        at = [b * width + len(p) - 1 + j for b, (p, c) in enumerate(rows) for j in range(firsts[b], len(c))]
        target = torch.tensor([t for (_, c), f in zip(rows, firsts, strict=True) for t in c[f:]], dtype=torch.long)
        k = min(self.topk, head.shape[0])
        vals, idxs, act = [], [], []
        with torch.no_grad():  # every row's tokens in one head matmul, log-softmax and top-k per chunk
            hidden = body(input_ids=ids.to(self.device), attention_mask=att.to(self.device)).last_hidden_state
            h = hidden.reshape(-1, hidden.shape[-1])[torch.tensor(at, dtype=torch.long, device=hidden.device)]
            target = target.to(h.device)
            for s in range(0, h.shape[0], self.chunk_size):
                z = (h[s : s + self.chunk_size] @ head.T).float().log_softmax(-1)
                v, i = z.topk(k, -1)
                vals.append(v.cpu())
                idxs.append(i.cpu())
                act.append(z.gather(-1, target[s : s + self.chunk_size, None]).squeeze(-1).cpu())
        v_all = torch.cat(vals) if vals else torch.zeros((0, k))
        i_all = torch.cat(idxs) if idxs else torch.zeros((0, k), dtype=torch.long)
        a_all = torch.cat(act) if act else torch.zeros(0)
        out = []
        for (p, c), v, i, a in zip(rows, v_all.split(lens), i_all.split(lens), a_all.split(lens), strict=True):
            if c and not p:
                v = torch.cat([v.new_zeros(1, k), v])
                i = torch.cat([i.new_full((1, k), -1), i])
                a = torch.cat([a.new_full((1,), math.nan), a])
            out.append((a.tolist(), i, v))
        return out

    def score(self, requests: Sequence[ScoreRequest]) -> list[TeacherScores | None]:
        t0 = time.perf_counter()
        al, toks = self._aligned(requests)
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
