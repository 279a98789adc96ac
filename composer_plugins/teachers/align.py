"""Mapping a teacher's per-token distributions onto the student's tokens when their tokenizers differ.

Both sides tokenize the same completion text; the end offsets both share cut it into *blocks*. A block of one
student token is scored (ids mapped by :class:`VocabMap`; several teacher tokens: the chain rule), a block of
several is not; each scored position keeps the ``k`` most probable entries and always the student's own token.
The rules, their limits and how they are tested: docs/losses.md ("Across tokenizers").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def token_spans(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)`` of ``ids`` decoded: each token's ``[start, end)`` in ``text``, by prefix decoding.

    Prefix decoding keeps multi-byte characters whole (a token that ends inside a character gets an
    empty span, merging it with the next one).
    """
    spans: list[tuple[int, int]] = []
    prev = 0
    text = ""
    for j in range(len(ids)):
        text = tokenizer.decode(list(ids[: j + 1]), skip_special_tokens=True)
        # an incomplete character: wait for the byte(s) that finish it
        end = prev if "\ufffd" in text[prev:] else len(text)
        spans.append((prev, end))
        prev = end
    if spans and spans[-1][1] < len(text):
        spans[-1] = (spans[-1][0], len(text))
    return text, spans


class VocabMap:
    """Teacher token id -> student token id with the same decoded text (``None`` if the student has none)."""

    def __init__(self, teacher_tokenizer: Any, student_tokenizer: Any) -> None:
        self.teacher = teacher_tokenizer
        self._student: dict[str, int] = {}
        for i in range(len(student_tokenizer)):
            text = student_tokenizer.decode([i])
            if text and text not in self._student and "\ufffd" not in text:
                self._student[text] = i
        self._cache: dict[int, int | None] = {}

    def __call__(self, teacher_id: int) -> int | None:
        tid = int(teacher_id)
        if tid not in self._cache:
            text = self.teacher.decode([tid])
            self._cache[tid] = self._student.get(text) if text else None
        return self._cache[tid]


@dataclass
class Aligned:
    """Per student token: top-k ids (student vocabulary), their teacher log-probs, and whether it is scored."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    mask: list[bool]
    #: the teacher's log-prob of the student's own token (NaN where not scored)
    sampled: list[float]


def align_scores(
    student_ids: Sequence[int],
    student_spans: Sequence[tuple[int, int]],
    teacher_ids: Sequence[int],
    teacher_spans: Sequence[tuple[int, int]],
    teacher_actual: Sequence[float],
    teacher_top_ids: Sequence[Sequence[int]],
    teacher_top_logprobs: Sequence[Sequence[float]],
    map_id: Callable[[int], int | None],
    k: int,
) -> Aligned:
    """Map the teacher's scores of its tokens onto the student's tokens (the rule in the module docstring).

    Both sides tokenize the same text; ``teacher_actual`` is the teacher's log-prob of each of its own tokens,
    ``map_id`` maps a teacher id to a student id (or None), ``k`` entries are kept per student token.
    """
    ns, nt = len(student_ids), len(teacher_ids)
    out = Aligned([[] for _ in range(ns)], [[] for _ in range(ns)], [False] * ns, [math.nan] * ns)
    i = j = 0
    while i < nt and j < ns:
        i0, j0 = i, j
        while teacher_spans[i][1] != student_spans[j][1]:
            if teacher_spans[i][1] < student_spans[j][1]:
                i += 1
            else:
                j += 1
            if i >= nt or j >= ns:
                return out  # the rest of the text is not covered by both sides
        if j == j0:
            probs: dict[int, float] = {}
            sid = int(student_ids[j])
            # several teacher tokens: the chain rule for the student's token, the first piece is no alternative
            skip = int(teacher_ids[i0]) if i > i0 else None
            if i > i0:
                probs[sid] = math.exp(sum(float(teacher_actual[x]) for x in range(i0, i + 1)))
            for tid, lp in zip(teacher_top_ids[i0], teacher_top_logprobs[i0], strict=False):
                s = map_id(int(tid))
                if s is not None and int(tid) != skip:
                    probs[s] = probs.get(s, 0.0) + math.exp(float(lp))
            if sid not in probs:
                probs[sid] = math.exp(float(teacher_actual[i0]))
            top = sorted(probs.items(), key=lambda kv: -kv[1])[:k]
            if sid not in dict(top):  # the student's own token keeps its (exactly known) teacher probability
                top = [*top[: k - 1], (sid, probs[sid])]
            out.ids[j] = [s for s, _ in top]
            out.logprobs[j] = [math.log(max(p, 1e-300)) for _, p in top]
            out.mask[j] = True
            out.sampled[j] = math.log(max(probs[sid], 1e-300))
        i += 1
        j += 1
    return out
