"""The prepare stage: held-out and training tasks of every env of the study as JSONL, with the split's overlap."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_plugins.core.errors import ConfigError
from composer_plugins.core.io import read_jsonl
from composer_plugins.pipeline.common import SPLITS, env_key, file_sha256, param_error, section, write_jsonl

#: Keys of one ``data.<env>`` entry.
DATA_KEYS = ("env", "source", "train", "test", "hf_id", "hf_config", "path", "test_path", "seed", "exclude")
SOURCES = ("embedded", "hf", "file")


def data_envs(params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``data`` section as ``{env_key: settings}`` (``data.seed`` is the shared default seed)."""
    data = section(params, "data")
    out: dict[str, dict[str, Any]] = {}
    for k, v in data.items():
        if k == "seed":
            continue
        if not isinstance(v, Mapping):
            raise param_error(params, f"data.{k}", "expected a mapping like {train: 256, test: 64}")
        unknown = sorted(set(v) - set(DATA_KEYS))
        if unknown:
            raise param_error(params, f"data.{k}.{unknown[0]}", "unknown key.", valid=DATA_KEYS)
        src = v.get("source", "embedded")
        if src not in SOURCES:
            raise param_error(params, f"data.{k}.source", f"must be one of {', '.join(SOURCES)}, got {src!r}.")
        if src == "hf" and not v.get("hf_id"):
            raise param_error(params, f"data.{k}.hf_id", "source: hf needs hf_id (e.g. openai/gsm8k).")
        if src == "file" and not v.get("path"):
            raise param_error(
                params, f"data.{k}.path", "source: file needs path (a GSM8K-format .jsonl/.json/.parquet)."
            )
        for split in SPLITS:
            n = v.get(split, 0)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise param_error(params, f"data.{k}.{split}", f"must be an integer >= 0, got {n!r}.")
        ex = v.get("exclude") or []
        if not isinstance(ex, list) or not all(isinstance(x, str) and x for x in ex):
            raise param_error(params, f"data.{k}.exclude", f"must be a list of JSONL paths, got {ex!r}.")
        for i, x in enumerate(ex):
            if not Path(x).is_file():
                raise param_error(params, f"data.{k}.exclude[{i}]", f"{x!r} is not a file (relative to {os.getcwd()}).")
        out[str(k)] = {"seed": int(data.get("seed", 0)), **dict(v)}
    return out


def env_spec_for(params: Mapping[str, Any], key: str, settings: Mapping[str, Any] | None = None) -> Any:
    """The registry spec of env ``key``: ``settings['env']``, else ``data.<key>.env``, else ``train.env``
    when its name is ``key`` (so prepare, train and eval use one env configuration), else ``key``."""
    if settings and settings.get("env") is not None:
        return settings["env"]
    data_env = ((params.get("data") or {}).get(key) or {}).get("env")
    if data_env is not None:
        return data_env
    train_env = (params.get("train") or {}).get("env")
    if train_env is not None and env_key(train_env) == key:
        return train_env
    return key


def source_spec(spec: Any, settings: Mapping[str, Any]) -> Any:
    """``spec`` with the env's ``source`` set from ``data.<env>`` (hf id or local file); unchanged if embedded."""
    src = settings.get("source", "embedded")
    if src == "embedded":
        return spec
    base: dict[str, Any] = {"name": spec} if isinstance(spec, str) else dict(spec)
    if src == "hf":
        base.update(source="hf", dataset_id=settings["hf_id"])
        if settings.get("hf_config"):
            base["dataset_config"] = settings["hf_config"]
    else:
        path = str(settings["path"])
        base["source"] = {"train": path, "test": str(settings["test_path"])} if settings.get("test_path") else path
    return base


def build_env(spec: Any) -> Any:
    """Build an env from its registry spec (``"gsm8k"`` or ``{"name": ..., **kwargs}``)."""
    from composer_plugins.core.config import build_component

    return build_component("envs", spec, key="env")


def sample_tasks(env: Any, n: int, split: str, seed: int) -> list[dict[str, Any]]:
    """``n`` seeded tasks of ``split`` from the env's generator (``sample_tasks`` or ``sample``)."""
    fn = getattr(env, "sample_tasks", None) or getattr(env, "sample", None)
    if fn is None:
        raise ConfigError(f"env {type(env).__name__} has no sample_tasks(n, split, seed); it cannot generate tasks")
    return [dict(t) for t in fn(n, split=split, seed=seed)]


def excluded_questions(paths: Sequence[str]) -> set[str]:
    """The ``question`` of every task in the JSONL files ``data.<env>.exclude`` names (a pilot's problems, a
    benchmark that must not leak): prepare draws none of them, in any split."""
    return {str(t.get("question")) for p in paths for t in read_jsonl(p)}


def prepare(params: Mapping[str, Any], out_dir: str | os.PathLike[str] = "data/tasks") -> dict[str, Any]:
    """Write ``<out_dir>/<env>/{train,test}.jsonl`` for every env in ``params['data']``; returns the manifest.

    ``source: embedded`` draws ``n`` seeded tasks with the env's generator (train and test use
    different generator streams). ``source: hf`` / ``file`` hand the dataset id / path to the env
    (its loader validates the GSM8K format, naming file and line), shuffle the split with
    ``data.seed`` and keep ``n`` tasks (``0``: all of them).
    """
    out = Path(out_dir)
    manifest: dict[str, Any] = {"envs": {}}
    for key, s in data_envs(params).items():
        spec = source_spec(env_spec_for(params, key, s), s)
        env = build_env(spec)
        entry: dict[str, Any] = {"env": spec, "source": s.get("source", "embedded")}
        banned = excluded_questions(s.get("exclude") or [])
        if banned:
            entry["exclude"] = {"files": list(s["exclude"]), "questions": len(banned)}
        for split in SPLITS:
            n = int(s.get(split, 0))
            seed = int(s.get("seed", 0))
            if entry["source"] == "embedded":
                # the generator's stream is deterministic: drawing n + |excluded| and dropping the excluded keeps
                # the first n of the rest (the same tasks whatever else the stream holds)
                tasks = sample_tasks(env, n + len(banned), split, seed) if n else []
                tasks = [t for t in tasks if str(t.get("question")) not in banned][:n]
            else:
                tasks = [dict(t) for t in env.tasks(split) if str(t.get("question")) not in banned]
                random.Random(seed).shuffle(tasks)
                tasks = tasks[:n] if n else tasks
            path = out / key / f"{split}.jsonl"
            write_jsonl(path, tasks)
            entry[split] = {"n": len(tasks), "path": path.as_posix(), "sha256": file_sha256(path)}
        if entry["train"]["n"] and entry["test"]["n"]:
            entry.update(split_overlap(out / key / "train.jsonl", out / key / "test.jsonl"))
        manifest["envs"][key] = entry
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def computation_of(task: Mapping[str, Any]) -> str | None:
    """What ``task`` computes: its solution's equations' operands and operators (``3*4;7+12``).

    ``None`` when the task states no equation (then only its prompt text can be compared).
    """
    from composer_plugins.envs.steps import computation_key

    text = task.get("solution") or task.get("target")
    if not isinstance(text, str):
        return None
    return computation_key(text) or None


def split_overlap(train: Path, test: Path) -> dict[str, Any]:
    """How much of ``test`` occurs in ``train``, by prompt text and by computed tuple.

    ``overlap``: test rows whose prompt is a train prompt; ``computation_overlap``: test rows whose
    computation (:func:`computation_of`) is one of train's, ``computation_overlap_distinct`` the
    distinct such computations; ``test_distinct`` / ``test_distinct_computations``: distinct test prompts
    and computations (a test row without equations counts by its prompt).
    """
    from composer_plugins.training.rollout.rewards import task_prompt

    train_rows, test_rows = read_jsonl(train), read_jsonl(test)
    prompts = {task_prompt(t) for t in train_rows}
    comps = {c for c in map(computation_of, train_rows) if c}
    test_comps = [computation_of(t) or f"prompt:{task_prompt(t)}" for t in test_rows]
    shared = [c for c in test_comps if c in comps]
    return {
        "overlap": sum(task_prompt(t) in prompts for t in test_rows),
        "computation_overlap": len(shared),
        "computation_overlap_distinct": len(set(shared)),
        "test_distinct": len({task_prompt(t) for t in test_rows}),
        "test_distinct_computations": len(set(test_comps)),
        **line_overlap(train_rows, test_rows),
        **procedure_overlap(train_rows, test_rows),
    }


def _column_roles(task: Mapping[str, Any]) -> tuple[list[str], dict[str, tuple[int, ...]]] | None:
    """A ``columns`` task's single-step facts and its numbers by role (``None`` for a task of another level)."""
    from composer_plugins.envs.arith import column_numbers
    from composer_plugins.envs.steps import parse_columns

    cols = parse_columns(str(task.get("solution") or task.get("target") or ""))
    if not cols:
        return None
    a, b = (int("".join(str(getattr(c, k)) for c in reversed(cols))) for k in ("a", "b"))
    return [c.fact for c in cols], column_numbers(a, b)


def procedure_overlap(
    train_rows: Sequence[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]]
) -> dict[str, int]:
    """At the ``columns`` level, how much of each test problem occurs in train, level by level (``{}`` elsewhere).

    ``fact_overlap``: test rows every single-step fact of which (a column line with its true sum) is one of
    train's (of ``fact_rows``); ``operand_overlap`` / ``intermediate_overlap`` / ``answer_number_overlap``: test
    rows with an operand / intermediate result / answer that is any number (operand, intermediate, answer) of a
    train problem. The split is meant to give ``fact_rows`` / 0 / 0 / 0: only the procedure transfers.
    """
    train = [r for r in map(_column_roles, train_rows) if r]
    test = [r for r in map(_column_roles, test_rows) if r]
    if not train or not test:
        return {}
    facts = {f for fs, _ in train for f in fs}
    numbers = {n for _, roles in train for ns in roles.values() for n in ns}
    out = {"fact_overlap": sum(set(fs) <= facts for fs, _ in test), "fact_rows": len(test)}
    for role, key in (("operands", "operand"), ("intermediate", "intermediate"), ("answer", "answer_number")):
        out[f"{key}_overlap"] = sum(any(n in numbers for n in roles[role]) for _, roles in test)
    return out


def solution_lines(task: Mapping[str, Any]) -> list[str]:
    """The worked lines of a task's solution (stripped, without the ``#### answer`` line)."""
    text = task.get("solution") or task.get("target")
    if not isinstance(text, str):
        return []
    return [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not ln.strip().startswith("####")]


def line_novelty(train_rows: Iterable[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]]) -> list[bool | None]:
    """Per test row: is its second worked line absent from every train solution? (``None``: it has no second line).

    The computation split keeps every test *tuple* out of train, yet a test line (``14 + 8 = 22``) may occur
    verbatim in train; a test row whose second line is new tests composition beyond recall of lines.
    """
    seen = {ln for t in train_rows for ln in solution_lines(t)}
    return [None if len(lines) < 2 else lines[1] not in seen for lines in map(solution_lines, test_rows)]


def line_overlap(train_rows: Sequence[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many test rows' first line, second line and answer occur verbatim in train (any train line / answer).

    ``first_line_overlap`` / ``second_line_overlap`` count test rows whose first / second worked line is a line of
    some train solution; ``answer_overlap`` those whose answer is some train problem's; ``second_line_rows``
    the test rows that have a second line.
    """
    seen = {ln for t in train_rows for ln in solution_lines(t)}
    answers = {str(t.get("answer")) for t in train_rows if t.get("answer") is not None}
    lines = [solution_lines(t) for t in test_rows]
    return {
        "first_line_overlap": sum(bool(ls) and ls[0] in seen for ls in lines),
        "second_line_overlap": sum(len(ls) > 1 and ls[1] in seen for ls in lines),
        "second_line_rows": sum(len(ls) > 1 for ls in lines),
        "answer_overlap": sum(t.get("answer") is not None and str(t.get("answer")) in answers for t in test_rows),
    }
