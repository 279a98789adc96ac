"""Scoring in the background: each scorer on its own thread, collected with a deadline and reported; building them."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from composer_plugins.teachers.base import TeacherError
from composer_plugins.teachers.scoring.contract import ScoreRequest, TeacherScorer, TeacherScores

log = logging.getLogger(__name__)


_warned: set[str] = set()


def fit_rows(name: str, rows: Any, n: int) -> list[TeacherScores | None]:
    """A scorer's results for a batch of ``n`` rows. A scorer that returned another number of rows cannot be
    matched to them: it is absent for the whole batch (warned once per teacher, with the counts)."""
    out = list(rows) if isinstance(rows, Sequence) else []
    if len(out) == n:
        return out
    if name not in _warned:
        _warned.add(name)
        log.warning(
            "teacher %r returned %d score rows for the %d asked: absent for those rows (reported as absent/%s). "
            "HINT: a scorer's score() returns one entry per request, None for a row it could not score",
            name,
            len(out),
            n,
            name,
        )
    return [None] * n


@dataclass
class ScoringJob:
    """The scorers' futures for one batch (from :meth:`ScoringPool.submit`)."""

    futures: dict[str, cf.Future]
    started: float = field(default_factory=time.monotonic)
    #: Why a teacher was left out of the last :meth:`collect` (failed: its error; late: the deadline).
    reasons: dict[str, str] = field(default_factory=dict)

    def collect(self, deadline_s: float | None) -> tuple[dict[str, list[TeacherScores | None]], dict[str, float]]:
        """Wait at most ``deadline_s`` (from now) for the scorers; ``(scores by teacher, metrics)``. A late or
        failed scorer is left out (docs/losses.md, "Asynchronous")."""
        done, _ = cf.wait(list(self.futures.values()), timeout=deadline_s)
        scores: dict[str, list[TeacherScores | None]] = {}
        metrics: dict[str, float] = {"teacher/wait_s": time.monotonic() - self.started}
        for name, fut in self.futures.items():
            ok = fut in done and fut.exception() is None
            metrics[f"teacher/{name}/skipped"] = 0.0 if ok else 1.0
            if ok:
                scores[name] = fut.result()
            elif fut in done:
                log.warning("teacher %r failed to score this batch; its term is skipped: %s", name, fut.exception())
                self.reasons[name] = f"failed: {type(fut.exception()).__name__}: {fut.exception()}"
            else:
                log.warning(
                    "teacher %r missed the %.3gs deadline; its term is skipped for this batch", name, deadline_s or 0.0
                )
                self.reasons[name] = f"missed the {deadline_s or 0.0:.3g}s deadline"
                fut.cancel()
        return scores, metrics


class ScoringPool:
    """Runs each scorer on its own worker thread, so scoring overlaps the trainer's work.

    A scorer that missed a deadline is not interrupted: the next batch queues behind it (docs/losses.md,
    "Asynchronous").
    """

    def __init__(self, scorers: Sequence[TeacherScorer]) -> None:
        ids = [s.id for s in scorers]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise TeacherError(f"scoring teachers need distinct ids; duplicated: {dupes}. HINT: give each an `id:`")
        self.scorers = list(scorers)
        self._pools = {s.id: cf.ThreadPoolExecutor(1, thread_name_prefix=f"score-{s.id}") for s in scorers}
        self._seen = dict.fromkeys(ids, (0, 0))  # (failures, rows) of each scorer at the last step_report
        self._bad_steps = dict.fromkeys(ids, 0)

    def bind(self, student_tokenizer: Any) -> None:
        for s in self.scorers:
            s.bind(student_tokenizer)

    def submit(self, requests: Sequence[ScoreRequest]) -> ScoringJob:
        reqs = list(requests)
        return ScoringJob({s.id: self._pools[s.id].submit(s.score, reqs) for s in self.scorers})

    def step_report(self, reasons: Mapping[str, str] | None = None) -> list[str]:
        """One line per teacher that failed rows (or was left out: ``reasons``) since the last report (once a step);
        its endpoint (no secrets), the failed rows and the reason."""
        reasons, seen = dict(reasons or {}), self._seen
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
        lines = []
        for s in self.scorers:
            if not s.stats.failures and not self._bad_steps[s.id]:
                continue
            last = f"; last error: {s.last_error}" if s.last_error else ""
            lines.append(
                f"teacher {s.id!r}{_at(s)}: {s.stats.failures} of {s.stats.rows} rows failed over the run, "
                f"in {self._bad_steps[s.id]} steps{last}"
            )
        return lines

    def stats(self) -> dict[str, float]:
        """Cumulative per-teacher counters, as metrics."""
        return {f"teacher/{s.id}/{k}": float(v) for s in self.scorers for k, v in vars(s.stats).items()}

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
