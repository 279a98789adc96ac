"""The ``replay`` pipeline from a YAML config: traces → teachers → pairs → data-juicer → JSONL.

Every key but ``traces`` and ``teachers`` is optional (:class:`ReplayConfig`; a commented example of every key:
docs/replay.md, "Quick start").
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from composer_plugins.core.config import Config, build_component, from_dict, load_config, redact
from composer_plugins.core.errors import ConfigError, UnknownPluginError
from composer_plugins.teachers.base import Teacher, TeacherError
from composer_plugins.teachers.engine import ReplayEngine, ReplayResult, RetryPolicy, responses_table

log = logging.getLogger(__name__)


@dataclass
class ConsensusConfig:
    """How teacher agreement becomes a pair."""

    k: int = 2
    compare: Literal["text", "final_answer"] = "text"


@dataclass
class BudgetConfig:
    """The dollar ceiling."""

    max_usd: float | None = None
    fresh: bool = False
    durable_reservations: bool = True


@dataclass
class CacheConfig:
    """The persistent response cache / spend ledger."""

    path: str = ".replay/cache.sqlite"
    enabled: bool = True
    synchronous: Literal["FULL", "NORMAL"] = "FULL"


@dataclass
class OutputConfig:
    """Where results go."""

    pairs: str = "replay/pairs.jsonl"
    raw_pairs: str | None = None
    responses: str | None = None
    summary: str | None = None


@dataclass
class NormalizeConfig:
    """The data-juicer pass over the pairs."""

    enabled: bool = True
    recipe: str | None = None


@dataclass
class ReplayConfig:
    """The whole ``replay run`` config."""

    traces: list[Any]
    teachers: list[Any]
    run_id: str | None = None
    limit: int | None = None
    progress: bool = True
    seed: int = 0
    #: Largest fraction of unanswered (state, teacher) calls before ``replay run`` fails (docs/replay.md "Exit status").
    max_unanswered: float = 0.0
    consensus: ConsensusConfig = field(default_factory=ConsensusConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    output: OutputConfig = field(default_factory=OutputConfig)
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)


def parse_config(cfg: Config) -> ReplayConfig:
    """Typed :class:`ReplayConfig` from a loaded config; errors name the file, line and key."""
    rc = from_dict(ReplayConfig, cfg, cfg)
    if not rc.traces:
        raise cfg.error("traces", "at least one trace file is required (a path or {path: ..., format: ...}).")
    if not rc.teachers:
        raise cfg.error("teachers", "at least one teacher is required (e.g. {name: openai, model: ...}).")
    for i, t in enumerate(rc.traces):
        if isinstance(t, dict):
            extra = set(t) - {"path", "format"}
            if "path" not in t or extra:
                raise cfg.error(
                    f"traces.{i}",
                    "a trace entry is a path or {path: ..., format: auto|openai|claude_code}.",
                    valid=["path", "format"],
                )
            if t.get("format", "auto") not in ("auto", "openai", "claude_code"):
                raise cfg.error(
                    f"traces.{i}.format", f"unknown format {t['format']!r}.", valid=["auto", "openai", "claude_code"]
                )
        elif not isinstance(t, str):
            raise cfg.error(f"traces.{i}", f"expected a path, got {t!r}")
    if rc.consensus.k < 1:
        raise cfg.error("consensus.k", f"k must be >= 1, got {rc.consensus.k}.")
    if rc.consensus.k > len(rc.teachers):
        raise cfg.error("consensus.k", f"k={rc.consensus.k} but only {len(rc.teachers)} teacher(s) are configured.")
    if rc.budget.max_usd is not None and rc.budget.max_usd < 0:
        raise cfg.error("budget.max_usd", f"must be >= 0, got {rc.budget.max_usd}. HINT: e.g. budget: {{max_usd: 5.0}}")
    if not 0 <= rc.max_unanswered <= 1:
        raise cfg.error(
            "max_unanswered",
            f"must be a fraction between 0 and 1, got {rc.max_unanswered}. "
            "HINT: 0 fails the run on any unanswered call, 0.05 tolerates 5%, 1 never fails it.",
        )
    if rc.limit is not None and rc.limit < 1:
        raise cfg.error("limit", f"must be >= 1 (or null for every state), got {rc.limit}.")
    r = rc.retry
    for name in ("max_retries", "backoff_base_s", "backoff_max_s", "retry_after_max_s"):
        if getattr(r, name) < 0:
            raise cfg.error(f"retry.{name}", f"must be >= 0, got {getattr(r, name)}.")
    _check_paths(rc, cfg)
    return rc


def _check_paths(rc: ReplayConfig, cfg: Config) -> None:
    """Refuse, before any call is paid for, a cache or output path that cannot be created."""
    from composer_plugins.core.io import path_problem

    paths = [("cache.path", rc.cache.path)] if rc.cache.enabled else []
    paths += [(f"output.{k}", getattr(rc.output, k)) for k in ("pairs", "raw_pairs", "responses", "summary")]
    seen: dict[str, str] = {}
    for key, path in paths:
        if path is None:
            continue
        if not isinstance(path, str) or not path:
            raise cfg.error(key, f"expected a file path, got {path!r}.")
        problem = path_problem(path)
        if problem:
            raise cfg.error(key, problem)
        full = os.path.abspath(path)
        if full in seen:
            raise cfg.error(key, f"{path} is also {seen[full]}; each output needs its own file.")
        seen[full] = key


def build_teachers(specs: list[Any], cfg: Config | None = None) -> list[Teacher]:
    """Build teachers from config entries (``{name: <registry name>, id: ..., <args>}``)."""
    cfg = cfg if cfg is not None else Config()
    out: list[Teacher] = []
    for i, spec in enumerate(specs):
        key = f"teachers.{i}"
        try:
            t = build_component("teachers", spec, key, cfg)
        except TypeError as e:
            valid = _param_names(spec)
            m = re.search(r"unexpected keyword argument '(\w+)'", str(e))
            if m:
                raise cfg.error(f"{key}.{m.group(1)}", "unknown teacher argument.", valid=valid) from None
            raise cfg.error(key, f"bad teacher arguments: {e}", valid=valid) from None
        except TeacherError as e:
            raise cfg.error(f"{key}.{e.field}" if e.field else key, str(e)) from None
        except UnknownPluginError as e:
            raise cfg.error(key, str(e)) from None
        if not isinstance(t, Teacher):
            raise cfg.error(key, f"built {type(t).__name__}, which is not a Teacher")
        out.append(t)
    ids = [t.id for t in out]
    for i, tid in enumerate(ids):
        if tid in ids[:i]:
            raise cfg.error(f"teachers.{i}.id", f"teacher id {tid!r} is used twice; give each teacher a distinct id.")
    return out


def _param_names(spec: Any) -> list[str] | None:
    from composer_plugins.core.plugins import get_registry

    name = spec.get("name") if isinstance(spec, dict) else spec
    try:
        factory = get_registry().get("teachers", str(name)).factory
        return ["name", *[p for p in inspect.signature(factory).parameters if p != "self"]]
    except Exception:
        return None


#: Failure kinds that are a teacher's answer rather than a missing one (an oracle abstaining).
ANSWER_KINDS = frozenset({"abstain"})


def default_run_id(rc: ReplayConfig) -> str:
    """``replay:<absolute path of output.pairs>`` (reruns of one config share a ledger)."""
    return "replay:" + os.path.abspath(rc.output.pairs)


def run_replay(
    rc: ReplayConfig,
    cfg: Config | None = None,
    *,
    teachers: list[Teacher] | None = None,
    progress: bool | None = None,
    fresh_budget: bool | None = None,
) -> dict[str, Any]:
    """Run the whole pipeline; returns the summary (also written to ``output.summary`` if set)."""
    from composer_plugins.core.io import atomic_write_json, atomic_write_jsonl
    from composer_plugins.teachers.cache import ReplayCache
    from composer_plugins.teachers.pairs import extract_pairs
    from composer_plugins.teachers.traces import load_traces

    cfg = cfg if cfg is not None else Config()
    skipped: list[tuple[str, int | None]] = []
    states = load_traces(rc.traces, limit=rc.limit, skipped=skipped)
    if skipped and not states:
        raise no_student_step(rc, cfg, skipped)
    teachers = teachers if teachers is not None else build_teachers(rc.teachers, cfg)
    run_id = rc.run_id or default_run_id(rc)
    cache = ReplayCache(rc.cache.path, rc.cache.synchronous) if rc.cache.enabled else None
    try:
        engine = ReplayEngine(
            teachers,
            cache=cache,
            max_usd=rc.budget.max_usd,
            retry=rc.retry,
            run_id=run_id,
            fresh_budget=rc.budget.fresh if fresh_budget is None else fresh_budget,
            durable_reservations=rc.budget.durable_reservations,
            progress=rc.progress if progress is None else progress,
            seed=rc.seed,
        )
        result = engine.run(states)
    except KeyboardInterrupt:
        from composer_plugins.core.errors import Interrupted

        if cache is None:
            raise Interrupted("nothing saved (cache.enabled: false)", "run the same command again") from None
        raise Interrupted(
            f"{len(cache)} answer(s) saved in {rc.cache.path}",
            "run the same command again to continue (the answers in the cache are not paid again)",
        ) from None
    finally:
        if cache is not None:
            cache.close()
    pairs, pstats = extract_pairs(
        states, result.responses, k=rc.consensus.k, compare=rc.consensus.compare, teacher_order=result.teachers
    )
    if rc.output.raw_pairs:
        atomic_write_jsonl(rc.output.raw_pairs, pairs)
    norm: dict[str, Any] | None = None
    if rc.normalize.enabled and pairs:
        from composer_plugins.teachers.normalize import normalize_pairs

        pairs, report = normalize_pairs(pairs, rc.normalize.recipe)
        norm = report.to_dict()
    atomic_write_jsonl(rc.output.pairs, pairs)
    if rc.output.responses:
        atomic_write_jsonl(rc.output.responses, responses_table(result))
    summary = build_summary(rc, run_id, len(states), result, pstats.to_dict(), norm, teachers)
    if skipped:  # some conversations are usable: the run goes on, and says how many were not
        summary["skipped"] = {"no_student_step": len(skipped), "where": [_at(f, n) for f, n in skipped[:10]]}
    if rc.output.summary:
        atomic_write_json(rc.output.summary, summary, sort_keys=True)
    return summary


def _at(file: str, line: int | None) -> str:
    return f"{file}:{line}" if line else file


def _trace_key(rc: ReplayConfig, file: str) -> str:
    """``traces.<i>``: the config entry that names ``file`` (itself, or the directory holding it)."""
    f = Path(file).resolve()
    for i, t in enumerate(rc.traces):
        p = Path(t["path"] if isinstance(t, dict) else t).resolve()
        if p == f or p == f.parent:
            return f"traces.{i}"
    return "traces"


def no_student_step(rc: ReplayConfig, cfg: Config, skipped: list[tuple[str, int | None]]) -> ConfigError:
    """The error of a replay whose traces hold no student step at all, located at the first such conversation."""
    file, line = skipped[0]
    key = _trace_key(rc, file)
    ov = cfg.override_of(key)
    where = f"command-line override {ov!r}" if ov else (f"{cfg.source}:{cfg.line_of(key)}" if cfg.source else "")
    shown = ", ".join(_at(f, n) for f, n in skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
    return ConfigError(
        f"no conversation holds a student step (an assistant message after at least one earlier message), so "
        f"there is nothing to replay: {shown} — record traces with `composer-plugins replay record`, add the "
        f"student's assistant turns to these lines, or point {key}{f' ({where})' if where else ''} at a file "
        "of student traces.",
        key=key,
        file=file,
        line=line,
    )


def build_summary(
    rc: ReplayConfig,
    run_id: str,
    n_states: int,
    result: ReplayResult,
    pair_stats: dict[str, int],
    norm: dict[str, Any] | None,
    teachers: list[Teacher],
) -> dict[str, Any]:
    """The JSON summary of a run (no secrets: teachers appear by id, kind, model and params)."""
    st = result.stats
    kinds = dict(Counter(f.kind for f in result.failures))
    unanswered = sum(n for k, n in kinds.items() if k not in ANSWER_KINDS)
    frac = unanswered / st.jobs if st.jobs else 0.0
    return redact(
        {
            "run_id": run_id,
            "states": n_states,
            "teachers": [{"id": t.id, "kind": t.kind, "model": t.model} for t in teachers],
            "replay": st.to_dict(),
            "ok": frac <= rc.max_unanswered,
            "failures": {
                "total": len(result.failures),
                "by_kind": kinds,
                "unanswered": unanswered,
                "unanswered_fraction": frac,
                "max_unanswered": rc.max_unanswered,
                "examples": [f.message for f in result.failures[:5]],
            },
            "pairs": pair_stats,
            "normalize": norm,
            "output": str(Path(rc.output.pairs)),
        }
    )


def run_from_file(
    path: str | os.PathLike[str],
    overrides: list[str] | tuple[str, ...] = (),
    *,
    progress: bool | None = None,
    fresh_budget: bool | None = None,
) -> dict[str, Any]:
    """Load ``path`` (+ ``key=value`` overrides), validate, run; returns the summary."""
    cfg = load_config(path, overrides)
    rc = parse_config(cfg)
    teachers = build_teachers(rc.teachers, cfg)
    return run_replay(rc, cfg, teachers=teachers, progress=progress, fresh_budget=fresh_budget)
