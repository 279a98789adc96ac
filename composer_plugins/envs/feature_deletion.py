"""``feature_deletion``: synthetic "reimplement the deleted feature" tasks from any repo with pytest tests.

The recipe, the reward and what the sandbox hides (the deleted code must not be recoverable from leftovers):
docs/envs.md, "``feature_deletion``".

This module owns the env (building, caching and scoring tasks, what the sandbox hides); the source
surgery (finding, deleting and splicing back definitions) is :mod:`composer_plugins.envs.symbols`.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import random
import sys
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from composer_plugins.core.errors import ConfigError
from composer_plugins.envs.base import Env, Feedback, sample_cycling
from composer_plugins.envs.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxResult
from composer_plugins.envs.sandbox.host import probe_interpreter
from composer_plugins.envs.symbols import (
    _TEST_DIRS,
    Symbol,
    _is_test_path,
    delete_symbol,
    find_symbols,
    splice_completion,
)

__all__ = [
    "FIXTURE_REPO",
    "FeatureDeletionEnv",
    "Symbol",
    "delete_symbol",
    "find_installed_copies",
    "find_symbols",
    "splice_completion",
]

#: The small real repository shipped with the project (``textkit``: slugs, stats, Roman numerals, wrap).
FIXTURE_REPO = Path(__file__).with_name("fixtures") / "textkit"


def find_installed_copies(python: str, packages: Iterable[str], repo: str | os.PathLike[str]) -> list[str]:
    """Where ``python`` would import ``packages`` from outside ``repo`` (site-packages copies, editable links)."""
    names = sorted(set(packages))
    if not names:
        return []
    code = (
        "import importlib.util, json\n"
        "out = {}\n"
        f"for n in {names!r}:\n"
        "    try:\n"
        "        s = importlib.util.find_spec(n)\n"
        "    except Exception:\n"
        "        s = None\n"
        "    if s is not None:\n"
        "        out[n] = list(s.submodule_search_locations or []) or [s.origin]\n"
        "print(json.dumps(out))\n"
    )
    found = probe_interpreter(python, code)
    repo_r = os.path.realpath(repo)
    real = {
        os.path.realpath(loc) for locs in found.values() for loc in locs if loc and loc not in ("built-in", "frozen")
    }
    return sorted(r for r in real if not (r == repo_r or r.startswith(repo_r + os.sep)) and os.path.exists(r))


def top_level_packages(repo: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """The repo's importable top-level names and the source dirs they live in (``.`` or ``src``)."""
    repo_p = Path(repo)
    names, roots = [], []
    for root in (repo_p / "src", repo_p):
        if not root.is_dir():
            continue
        here = []
        for p in sorted(root.iterdir()):
            if p.is_dir() and (p / "__init__.py").exists() and p.name not in _TEST_DIRS:
                here.append(p.name)
            elif (
                p.suffix == ".py"
                and p.name not in ("setup.py", "conftest.py", "noxfile.py")
                and not _is_test_path(p.name)
            ):
                here.append(p.stem)
        if here:
            names.extend(here)
            roots.append(os.path.relpath(root, repo_p))
    return sorted(set(names)), roots


class FeatureDeletionEnv(Env):
    """Reimplement a function/class deleted from a real repo; reward = fail-to-pass tests fixed, no regression.

    ``repo``, ``symbols``, ``modes``, ``cache_path`` (it holds the golden code: keep it private), ``sandbox_expose``
    (``"all"`` gives the deleted code away wherever another copy of the repository is) and ``sandbox_allow``:
    docs/envs.md, "``feature_deletion``". Besides them:

    Args:
        max_tasks: how many verified tasks to build (None: all).
        min_pass_to_pass: a deletion is kept only if at least this many tests still pass.
        test_split: fraction of tasks in the ``test`` split (by a hash of the task id).
        python: interpreter that runs the tests (needs pytest); default: this one.
        timeout_s: wall-clock limit of one test run. ``isolation``: sandbox isolation.
        num_workers: test runs in parallel (building and scoring).
    """

    name = "feature_deletion"
    task_fields = ("file", "symbol", "deleted_source", "fail_to_pass", "pass_to_pass")

    def __init__(
        self,
        repo: str | os.PathLike[str] | None = None,
        *,
        symbols: Sequence[str] | None = None,
        modes: Sequence[Literal["body", "symbol"]] | str = ("body",),
        max_tasks: int | None = None,
        min_body_lines: int = 2,
        min_pass_to_pass: int = 1,
        keep_docstring: bool = True,
        test_split: float = 0.25,
        seed: int = 0,
        python: str | None = None,
        timeout_s: float = 60.0,
        memory_mb: int = 2048,
        isolation: Literal["auto", "namespaces", "guard"] = "auto",
        num_workers: int = 2,
        cache_path: str | os.PathLike[str] | None = None,
        max_turns: int = 1,
        progress: bool = True,
        sandbox_expose: Literal["all", "allowlist"] = "allowlist",
        sandbox_allow: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(max_turns=max_turns, num_workers=num_workers, **kwargs)
        if sandbox_expose not in ("all", "allowlist"):
            raise ConfigError(
                f"sandbox_expose must be 'all' or 'allowlist', got {sandbox_expose!r}",
                key="sandbox_expose",
                valid=["all", "allowlist"],
            )
        self.repo = Path(repo or FIXTURE_REPO).resolve()
        if not self.repo.is_dir():
            raise ConfigError(f"repository not found: {self.repo}", key="repo")
        modes_t = (modes,) if isinstance(modes, str) else tuple(modes)
        if not modes_t or not set(modes_t) <= {"body", "symbol"}:
            raise ConfigError(
                f"modes must be 'body' and/or 'symbol', got {list(modes_t)}", key="modes", valid=["body", "symbol"]
            )
        self.modes = modes_t
        self.symbols = list(symbols) if symbols else None
        self.max_tasks = max_tasks
        self.min_body_lines = min_body_lines
        self.min_pass_to_pass = min_pass_to_pass
        self.keep_docstring = keep_docstring
        self.test_split = test_split
        self.seed = seed
        self.python = os.path.abspath(python or sys.executable)
        self.progress = progress
        self.cache_path = Path(cache_path) if cache_path else None
        self.packages, self.src_dirs = top_level_packages(self.repo)
        self.installed_copies = find_installed_copies(self.python, self.packages, self.repo)
        hide = [str(self.repo), *self.installed_copies]
        if self.cache_path is not None:
            hide.append(str(self.cache_path.resolve()))
        if os.environ.get("PYTHONPYCACHEPREFIX"):  # (the Sandbox hides sys.pycache_prefix itself)
            hide.append(os.environ["PYTHONPYCACHEPREFIX"])
        self.sandbox = Sandbox(
            SandboxLimits(wall_time_s=timeout_s, memory_mb=memory_mb, max_processes=64, max_output_bytes=1_000_000),
            isolation=isolation,
            python=self.python,
            hide=hide,
            expose=sandbox_expose,
            allow=sandbox_allow,
        )
        self._built: list[dict[str, Any]] | None = None
        self.baseline: dict[str, str] = {}

    # -- running tests -----------------------------------------------------------------------
    def run_tests(self, overrides: Mapping[str, str] | None = None, nodeids: Sequence[str] = ()) -> SandboxResult:
        """Run pytest on a clean, read-only copy of the repo (with ``overrides`` written over files).

        ``nodeids`` restrict the run to the files that hold them (pytest aborts the whole run when a
        node id cannot be collected, which is what a deleted symbol does to its test module).
        """
        files = list(dict.fromkeys(n.split("::", 1)[0] for n in nodeids))
        argv = [
            "python",
            "-B",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "cp_pytest_reporter",
            "-o",
            "addopts=",
            "--rootdir",
            ".",
            "--color=no",
            "--continue-on-collection-errors",
            *files,
        ]
        return self.sandbox.run(
            argv,
            tree=self.repo,
            tree_overrides=overrides,
            readonly=["."],
            pythonpath=[d for d in self.src_dirs if d != "."] + ["."],
            protected_packages=self.packages,
            scripts=["cp_pytest_reporter"],
        )

    @staticmethod
    def outcomes(res: SandboxResult) -> tuple[dict[str, str], list[str], bool]:
        """``nodeid -> outcome``, collection errors, and whether tampering was detected."""
        out: dict[str, str] = {}
        collect_errors: list[str] = []
        tampered = res.forged_records > 0
        for r in res.records:
            kind = r.get("kind")
            if kind == "test":
                nid = str(r.get("nodeid"))
                if nid in out:
                    tampered = True
                out[nid] = str(r.get("outcome"))
            elif kind == "collect_error":
                collect_errors.append(f"{r.get('nodeid')}: {str(r.get('message', ''))[-400:]}")
            elif kind == "tamper":
                tampered = True
        return out, collect_errors, tampered

    # -- building tasks ---------------------------------------------------------------------
    def build_tasks(self) -> list[dict[str, Any]]:
        """Delete, verify and record tasks (cached; see ``cache_path``)."""
        if self._built is not None:
            return self._built
        if self.cache_path is not None and self.cache_path.exists():
            self._built = json.loads(self.cache_path.read_text())
            return self._built
        base = self.run_tests()
        outcomes, _errors, _ = self.outcomes(base)
        if not outcomes and "No module named pytest" in base.stdout + base.stderr:
            raise SandboxError(
                f"the feature_deletion env runs the repository's tests with pytest, which {self.python} cannot "
                "import: install it into that interpreter (`pip install pytest`; `bash scripts/install.sh` "
                "installs it with composer-plugins), or pass python= an interpreter that has it"
            )
        if base.killed or not outcomes:
            raise SandboxError(
                f"the repository's tests did not run in the sandbox ({base.killed or 'no results'}): "
                f"{(base.stdout + base.stderr)[-1500:]}"
            )
        self.baseline = outcomes
        passing = sorted(n for n, o in outcomes.items() if o == "passed")
        jobs = [(sym, mode) for sym in self._candidates() for mode in self.modes]
        built: list[dict[str, Any]] = []
        from tqdm.auto import tqdm

        desc = "feature_deletion: verifying deletions"
        with (
            tqdm(total=len(jobs), desc=desc, leave=False, disable=not self.progress) as bar,
            ThreadPoolExecutor(self.num_workers) as pool,
        ):
            for task in pool.map(lambda j: self._make_task(j[0], j[1], passing), jobs):
                bar.update(1)
                if task is not None:
                    built.append(task)
                if self.max_tasks is not None and len(built) >= self.max_tasks:
                    break
        if self.max_tasks is not None:
            built = built[: self.max_tasks]
        self._built = built
        if self.cache_path is not None:
            self.cache_path.write_text(json.dumps(built))
        return built

    def _candidates(self) -> list[Symbol]:
        found = find_symbols(self.repo, min_body_lines=self.min_body_lines)
        if self.symbols:
            chosen = []
            for want in self.symbols:
                hits = [s for s in found if want in (s.qualname, s.spec)]
                if not hits:
                    raise ConfigError(
                        f"symbol {want!r} not found (or not deletable) in {self.repo}",
                        key="symbols",
                        valid=[s.spec for s in found],
                    )
                chosen.extend(hits)
            return chosen
        random.Random(self.seed).shuffle(found)
        return found

    def _make_task(self, sym: Symbol, mode: str, passing: list[str]) -> dict[str, Any] | None:
        source = (self.repo / sym.file).read_text(encoding="utf-8")
        deleted, info = delete_symbol(source, sym.qualname, mode, self.keep_docstring)  # type: ignore[arg-type]
        res = self.run_tests({sym.file: deleted}, passing)
        outcomes, _, _ = self.outcomes(res)
        f2p = [n for n in passing if outcomes.get(n) != "passed"]
        p2p = [n for n in passing if outcomes.get(n) == "passed"]
        if not f2p or len(p2p) < self.min_pass_to_pass or res.killed == "output_limit":
            return None
        diff = "".join(
            difflib.unified_diff(
                deleted.splitlines(keepends=True), source.splitlines(keepends=True), f"a/{sym.file}", f"b/{sym.file}"
            )
        )
        task_id = f"{self.repo.name}:{sym.file}::{sym.qualname}:{mode}"
        return {
            "task_id": task_id,
            "prompt": self._prompt(sym, mode, deleted, f2p),
            # the shipped fixture by its name: a task file does not depend on where the package is installed
            "repo": "fixtures/textkit" if self.repo == FIXTURE_REPO.resolve() else str(self.repo),
            "file": sym.file,
            "symbol": sym.qualname,
            "kind": sym.kind,
            "mode": mode,
            "deleted_symbols": [sym.qualname],
            "deleted_source": deleted,
            "span": info.get("span"),
            "insert_at": info.get("insert_at"),
            "indent": info["indent"],
            "class_line": info.get("class_line"),
            "fail_to_pass": f2p,
            "pass_to_pass": p2p,
            "golden_diff": diff,
            "original_source": info["original"],
            "split": "test" if _frac_hash(task_id) < self.test_split else "train",
        }

    def _prompt(self, sym: Symbol, mode: str, deleted: str, f2p: list[str]) -> str:
        what = (
            "its body was removed (it now raises NotImplementedError)"
            if mode == "body"
            else "its whole definition was deleted"
        )
        if sym.kind == "method":
            cls, meth = sym.qualname.split(".", 1)
            ask = (
                f"Reimplement the method `{meth}` of class `{cls}`. Reply with the complete `def {meth}` "
                f"in one ```python code block; it will be placed inside the class."
            )
        else:
            ask = (
                f"Reimplement `{sym.name}`. Reply with the complete definition of `{sym.name}` in one ```python "
                f"code block (you may put new imports or helper functions above it)."
            )
        shown = "\n".join(f"- {n}" for n in f2p[:10]) + (f"\n- ... and {len(f2p) - 10} more" if len(f2p) > 10 else "")
        return (
            f"In the Python repository `{self.repo.name}`, `{sym.qualname}` in `{sym.file}` is missing: {what}.\n"
            f"These tests fail because of it:\n{shown}\n\n"
            f"`{sym.file}` now reads:\n```python\n{deleted}```\n\n{ask}"
        )

    # -- Env API ------------------------------------------------------------------------------
    def tasks(self, split: str = "train") -> list[dict[str, Any]]:
        """Built tasks of ``split`` (``"all"`` for every task)."""
        want = "test" if split in ("test", "validation", "eval") else "train"
        return [dict(t) for t in self.build_tasks() if split == "all" or t["split"] == want]

    def sample_tasks(self, n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
        """``n`` tasks of ``split`` (cycling through shuffles; all tasks if a split is empty)."""
        return sample_cycling(self.tasks(split) or self.tasks("all"), n, seed)

    def _score(self, completion: str, task: Mapping[str, Any]) -> Feedback:
        need = ("file", "symbol", "deleted_source", "fail_to_pass", "pass_to_pass")
        if any(task.get(k) is None for k in need):
            return Feedback("unscorable", f"the task lacks one of {need}", {}, None)
        f2p, p2p = list(task["fail_to_pass"]), list(task["pass_to_pass"])
        try:
            new_source = splice_completion(str(task["deleted_source"]), task, completion)
        except SyntaxError as e:
            return Feedback(
                "syntax_error",
                f"The code does not parse: {e.msg} (line {e.lineno}).",
                {"error": "SyntaxError", "message": e.msg, "lineno": e.lineno},
                0.0,
            )
        except ValueError as e:
            return Feedback("no_code", f"{str(e)[0].upper()}{str(e)[1:]}.", {"symbol": task["symbol"]}, 0.0)
        try:
            res = self.run_tests({str(task["file"]): new_source}, [*f2p, *p2p])
        except SandboxError as e:
            return Feedback("sandbox_error", str(e), {}, None)
        outcomes, collect_errors, tampered = self.outcomes(res)
        base = {
            "stdout": res.stdout[-3000:],
            "stderr": res.stderr[-1500:],
            "killed": res.killed,
            "collect_errors": collect_errors[:3],
        }
        if tampered:
            return Feedback("tampered", "The code interfered with the test runner; the run is not scored.", base, 0.0)
        fixed = [n for n in f2p if outcomes.get(n) == "passed"]
        still_failing = [n for n in f2p if outcomes.get(n) != "passed"]
        regressed = [n for n in p2p if outcomes.get(n) != "passed"]
        details = {**base, "passed": len(fixed), "total": len(f2p), "failed": still_failing, "regressed": regressed}
        messages = {r.get("nodeid"): r.get("message") for r in res.records if r.get("kind") == "test"}
        if regressed:
            first = regressed[0]
            details.update(test=first, message=messages.get(first) or "not run")
            return Feedback(
                "regression", f"{len(regressed)} test(s) that passed before now fail, e.g. {first}.", details, 0.0
            )
        reward = len(fixed) / len(f2p) if f2p else None
        if not still_failing:
            return Feedback("correct", f"All {len(f2p)} failing tests pass now.", details, reward)
        first = still_failing[0]
        msg = messages.get(first) or (collect_errors[0] if collect_errors else "not run")
        details.update(test=first, message=msg)
        if res.timed_out:
            return Feedback("timeout", f"The tests timed out; {len(fixed)}/{len(f2p)} pass.", details, reward)
        return Feedback(
            "test_failure",
            f"{len(fixed)}/{len(f2p)} tests pass; {first} still fails: {str(msg)[:300]}",
            details,
            reward,
        )


def _frac_hash(text: str) -> float:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "big") / 2**32
