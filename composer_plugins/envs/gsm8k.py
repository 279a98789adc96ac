"""``gsm8k``: grade-school math word problems with an exact-match reward on the final number.

Sources (the seeded :mod:`composer_plugins.envs.arith` generator, the hub or local files) and the malformed-file
errors: docs/envs.md, "``gsm8k``".
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from composer_plugins.core.errors import ComposerPluginsError, ConfigError
from composer_plugins.core.io import atomic_write_jsonl, iter_jsonl
from composer_plugins.envs.answers import extract_answer_value, format_number
from composer_plugins.envs.arith import generate_problems, resolve_difficulty
from composer_plugins.envs.base import Env, Feedback, sample_cycling

__all__ = ["GSM8KEnv", "load_gsm8k_file", "load_gsm8k_hf"]

DEFAULT_PROMPT = "Question: {question}\nAnswer:"


def _split_name(split: str) -> str:
    return "test" if split in ("test", "validation", "eval") else "train"


def _row_to_task(row: Mapping[str, Any], where: str, template: str, index: int, split: str) -> dict[str, Any]:
    question, solution = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: field 'question' must be a non-empty string, got {question!r}")
    if not isinstance(solution, str):
        raise ValueError(f"{where}: field 'answer' must be a string ending in '#### <number>', got {solution!r}")
    if "####" not in solution:
        raise ValueError(f"{where}: field 'answer' has no final '#### <number>' line (GSM8K format)")
    value = extract_answer_value(solution[solution.find("####") :])
    if value is None:
        raise ValueError(f"{where}: the text after '####' is not a number: {solution.split('####', 1)[1][:40]!r}")
    return {
        "task_id": f"gsm8k-{split}-{index}",
        "prompt": template.format(question=question.strip()),
        "question": question.strip(),
        "answer": format_number(value),
        "solution": solution,
        "target": " " + solution,
        "source": "gsm8k",
    }


def load_gsm8k_file(
    path: str | os.PathLike[str], split: str = "train", template: str = DEFAULT_PROMPT
) -> list[dict[str, Any]]:
    """Tasks from one GSM8K-format file; errors name the file and line/row."""
    p = str(path)
    if not os.path.isfile(p):
        raise ConfigError(f"GSM8K file not found: {p}", file=p)
    rows: Iterable[tuple[str, int | None, Any]]  # (where, line, row), read lazily
    if p.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq

            table = pq.read_table(p)
        except Exception as e:
            raise ConfigError(f"cannot read parquet file: {e}", file=p) from e
        missing = {"question", "answer"} - set(table.column_names)
        if missing:
            raise ConfigError(
                f"parquet file lacks column(s) {sorted(missing)}; GSM8K rows need 'question' and 'answer' "
                f"(found {table.column_names})",
                file=p,
            )
        rows = ((f"row {i + 1}", None, row) for i, row in enumerate(table.to_pylist()))
    else:
        opener = gzip.open if p.endswith(".gz") else open
        with opener(p, "rt", encoding="utf-8") as f:  # type: ignore[operator]
            text = f.read()
        if p.endswith(".json") and text.lstrip().startswith("["):
            try:
                items = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"invalid JSON: {e.msg}", file=p, line=e.lineno) from None
            rows = ((f"item {i}", None, row) for i, row in enumerate(items))
        else:
            rows = (("line", lineno, row) for lineno, row in iter_jsonl(text.splitlines(), p))
    tasks: list[dict[str, Any]] = []
    for where, line, row in rows:
        if not isinstance(row, Mapping):  # a JSON array's item (jsonl and parquet rows are objects)
            raise ConfigError(f"{where} must be an object with 'question' and 'answer'", file=p)
        try:
            tasks.append(_row_to_task(row, where, template, len(tasks), split))
        except ValueError as e:
            raise ConfigError(str(e).removeprefix("line: "), file=p, line=line) from None
    return tasks


def load_gsm8k_hf(
    split: str = "train",
    dataset_id: str = "openai/gsm8k",
    config: str = "main",
    template: str = DEFAULT_PROMPT,
    **load_kwargs: Any,
) -> list[dict[str, Any]]:
    """Tasks from the hub dataset (``datasets.load_dataset(dataset_id, config, split=split)``)."""
    try:
        from datasets import load_dataset

        ds = load_dataset(dataset_id, config, split=_split_name(split), **load_kwargs)
    except Exception as e:
        raise ComposerPluginsError(
            f"cannot load {dataset_id!r} ({config}) from the Hugging Face hub: {type(e).__name__}: {e}. "
            "HINT: without hub access use source='generator', or download the dataset once and pass "
            "source='/path/to/gsm8k' (a directory with main/train-*.parquet or train.jsonl)."
        ) from e
    return [_row_to_task(row, f"{dataset_id} row {i}", template, i, split) for i, row in enumerate(ds)]


def _files_for_split(directory: str, split: str) -> list[str]:
    s = _split_name(split)
    pats = [
        f"main/{s}-*.parquet",
        f"{s}-*.parquet",
        f"{s}.parquet",
        f"{s}.jsonl",
        f"{s}.jsonl.gz",
        f"{s}.json",
        f"data/{s}-*.parquet",
        f"main/{s}.jsonl",
    ]
    for pat in pats:
        hits = sorted(glob.glob(os.path.join(directory, pat)))
        if hits:
            return hits
    raise ConfigError(f"no {s} split found in directory (looked for {', '.join(pats)})", file=directory)


class GSM8KEnv(Env):
    """GSM8K math word problems (hub, local file or seeded generator); exact-match reward on the final number.

    The arguments are tabled in docs/envs.md, "``gsm8k``"; ``dataset_id``, ``dataset_config``: the hub dataset for
    ``source="hf"``; ``max_turns``: :class:`~composer_plugins.envs.base.Env`'s.
    """

    name = "gsm8k"
    task_fields = (("answer", "solution"),)

    def __init__(
        self,
        source: str | Mapping[str, str] = "generator",
        *,
        difficulty: int | str = 1,
        annotations: bool | None = None,
        prompt_template: str = DEFAULT_PROMPT,
        strict_format: bool = False,
        dataset_id: str = "openai/gsm8k",
        dataset_config: str = "main",
        max_turns: int = 1,
        chat: bool = False,
        system_prompt: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(max_turns=max_turns, **kwargs)
        if not isinstance(chat, bool):
            raise ConfigError(f"chat must be true or false, got {chat!r}", key="chat")
        if system_prompt is not None and not chat:
            raise ConfigError(
                "system_prompt is only used with chat: true (text prompts have no system turn); "
                "set chat: true or drop system_prompt",
                key="system_prompt",
            )
        self.chat, self.system_prompt = chat, system_prompt
        if "{question}" not in prompt_template:
            raise ConfigError("prompt_template must contain '{question}'", key="prompt_template")
        self.source = source
        self.difficulty = resolve_difficulty(difficulty)
        self.annotations = annotations
        self.prompt_template = prompt_template
        self.strict_format = strict_format
        self.dataset_id, self.dataset_config = dataset_id, dataset_config
        self._loaded: dict[str, list[dict[str, Any]]] = {}
        if isinstance(source, str) and source not in ("generator", "hf") and not os.path.exists(source):
            raise ConfigError(
                f"source must be 'generator', 'hf' or an existing file/directory; {source!r} does not exist",
                key="source",
            )

    # -- tasks ------------------------------------------------------------------------------
    def _as_chat(self, task: dict[str, Any]) -> dict[str, Any]:
        """``task`` with its prompt as chat messages when ``chat`` is on (unchanged otherwise)."""
        if self.chat and isinstance(task.get("prompt"), str):
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            task["prompt"] = [*system, {"role": "user", "content": task["prompt"]}]
        return task

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Every task of ``split`` for file/hub sources (the generator has no fixed set)."""
        s = _split_name(split)
        if self.source == "generator":
            raise ValueError("the generator has no fixed task list; use sample_tasks(n, split, seed)")
        if s not in self._loaded:
            self._loaded[s] = self._load(s)
        return self._loaded[s]

    def _load(self, split: str) -> list[dict[str, Any]]:
        src = self.source
        if src == "hf":
            tasks = load_gsm8k_hf(split, self.dataset_id, self.dataset_config, self.prompt_template)
            return [self._as_chat(t) for t in tasks]
        if isinstance(src, Mapping):
            if split not in src:
                raise ConfigError(f"no file given for split {split!r}", key=f"source.{split}", valid=list(src))
            files = [str(src[split])]
        elif os.path.isdir(src):
            files = _files_for_split(src, split)
        else:
            files = [src]
        tasks: list[dict[str, Any]] = []
        for f in files:
            for t in load_gsm8k_file(f, split, self.prompt_template):
                t["task_id"] = f"gsm8k-{split}-{len(tasks)}"
                tasks.append(self._as_chat(t))
        return tasks

    def sample_tasks(self, n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
        if self.source != "generator":
            return sample_cycling(self.tasks(split), n, seed)
        s = _split_name(split)
        problems = generate_problems(n, self.difficulty, seed, s, self.annotations)
        return [
            self._as_chat(
                {
                    "task_id": f"arith-d{self.difficulty}-{s}-{seed}-{i}",
                    "prompt": self.prompt_template.format(question=p.question),
                    "question": p.question,
                    "answer": str(p.answer),
                    "solution": p.solution,
                    "target": " " + p.solution,
                    "difficulty": p.difficulty,
                    "source": "generator",
                }
            )
            for i, p in enumerate(problems)
        ]

    # -- reward -------------------------------------------------------------------------------
    def _score(self, completion: str, task: Mapping[str, Any]) -> Feedback:
        gold_text = task.get("answer", task.get("solution"))
        gold = extract_answer_value(str(gold_text)) if gold_text is not None else None
        if gold is None:
            return Feedback("unscorable", "the task has no numeric gold answer", {"task_answer": gold_text}, None)
        expected = format_number(gold)
        text = completion
        if self.strict_format:
            text = completion[completion.find("####") :] if "####" in completion else ""
        pred = extract_answer_value(text)
        if pred is None:
            how = "a final line '#### <number>'" if self.strict_format else "a final number"
            return Feedback(
                "no_answer", f"No final answer found; end with {how}.", {"expected": expected, "got": None}, 0.0
            )
        got = format_number(pred)
        if pred == gold:
            return Feedback("correct", f"Correct: {got}.", {"expected": expected, "got": got}, 1.0)
        return Feedback(
            "wrong_answer",
            f"The final answer {got} is wrong.",
            {"expected": expected, "got": got, "question": task.get("question")},
            0.0,
        )


def write_gsm8k_jsonl(path: str | os.PathLike[str], rows: list[Mapping[str, Any]]) -> Path:
    """Write ``rows`` (``question``/``answer`` or generator tasks) as GSM8K jsonl; returns the path."""
    p = Path(path)
    records = ({"question": r.get("question"), "answer": r.get("solution", r.get("answer"))} for r in rows)
    atomic_write_jsonl(p, records, ensure_ascii=True)
    return p
