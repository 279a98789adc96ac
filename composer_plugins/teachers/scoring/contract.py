"""The scoring contract: a row to score, the top-k scores on the student's tokens, the scorer base, token mapping."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from composer_plugins.teachers.base import CallCounts, TeacherError, check_number


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

    ``messages``: the conversation the student's prompt was rendered from (chat prompts only; see
    :meth:`_Aligner.teacher_tokens`).
    """

    prompt: str
    completion: str
    completion_ids: tuple[int, ...]
    prompt_ids: tuple[int, ...] = ()
    messages: tuple[Mapping[str, Any], ...] | None = None


@dataclass
class ScorerStats(CallCounts):
    """Per-scorer counters (reported as metrics); ``failures`` counts rows."""

    rows: int = 0
    skipped_batches: int = 0
    bytes_received: int = 0
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
        #: What :meth:`bind` maps the teacher's tokens to the student's with (set by a subclass's ``bind``).
        self._aligner: _Aligner | None = None

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

    def _aligned(self, requests: Sequence[ScoreRequest]) -> tuple[_Aligner, list[Any]]:
        """The aligner :meth:`bind` made and each request's teacher tokens (refused before :meth:`bind`)."""
        al = self._aligner
        if al is None:
            raise TeacherError(f"{self.kind} scorer {self.id!r}: bind(student_tokenizer) before score()")
        return al, [al.teacher_tokens(r) for r in requests]

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
            from composer_plugins.chat.render import render_prompt

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
