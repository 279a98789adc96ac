"""Mutation testing of the loss, kernel, assembly and object-store code against their own tests.

Usage::

    python -m benchmarks.mutation                          # the default sample, 2 workers (~20 min on 2 cores)
    python -m benchmarks.mutation --only kernels --sample 40 --jobs 1
    python -m benchmarks.mutation --list                    # the modules, their tests and mutant counts
    python -m benchmarks.mutation --show kernels/chunked.py:core/NumberReplacer:12   # one mutant's diff
    python -m benchmarks.mutation --mutant kernels/chunked.py:core/NumberReplacer:12 # run just that one

Mutants are Cosmic Ray's (``cosmic-ray``, pinned in the ``dev`` extra): its ``core/*`` operators (binary,
comparison and unary operator replacement, ``and``/``or``, ``True``/``False``, ``not`` added, numbers
replaced, ``break``/``continue``, exception handlers replaced, decorators removed, loops made to run zero
times) enumerated with its AST walk and applied with :func:`cosmic_ray.mutating.mutate_code`. Mutants inside
type annotations are left out: every module uses ``from __future__ import annotations``, so they are never
evaluated and would be equivalent by construction.

Every module group has far more mutants than 20 minutes on 2 cores can test, so each group is a
deterministic random sample (``--seed``, ``--sample`` per group) and its score is an **estimate** of the
whole population's, reported with its Wilson 95 % interval.

Runner. The suite's tests import torch, Lightning and transformers, which cost several seconds per
process; a fresh ``pytest`` per mutant would spend most of its time importing them. Instead this process
imports the third-party modules that the selected tests import (found once by a collect-only probe), then
forks one child per mutant. The child works in its own copy of the repository (one per worker, the
files git tracks or would track), where the mutated file has been written, puts that copy first on
``sys.path`` and ``PYTHONPATH`` (subprocesses see the mutant too) and runs ``pytest -x`` in-process on the
group's own test files. ``composer_plugins`` itself is never imported in this process, so each child
imports the mutated code fresh. The child runs in its own session; a mutant that runs past its timeout
(4 × the clean run + 30 s) has its whole process group killed and counts as ``timeout``.

Outcome: pytest exit 0 = survived; a failing test, a collection error or a crash = killed; past the
timeout = timeout. Score = (killed + timeout) / total. Writes ``<out>.json`` and ``<out>.md``
(default ``results/mutation``), printing one line per mutant.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import difflib
import importlib
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PKG = "composer_plugins"


@dataclass(frozen=True)
class Group:
    """A module group: the files mutated, the tests that judge them, and the score it must reach."""

    name: str
    files: tuple[str, ...]  # relative to composer_plugins/
    tests: tuple[str, ...]  # test files relative to the repository root, fastest killers first (missing: skipped)
    target: float  # minimum score, percent
    deselect: tuple[str, ...] = ()  # node ids left out (subprocess-driven end-to-end runs, minutes each)
    sample: int = 60


GROUPS: dict[str, Group] = {
    g.name: g
    for g in (
        Group(
            "losses",
            files=(
                "losses/advantages.py",
                "losses/base.py",
                "losses/correction.py",
                "losses/distill.py",
                "losses/functional.py",
                "losses/ops.py",
                "losses/plugin.py",
                "losses/policy.py",
                "losses/preference.py",
                "losses/taid.py",
                "losses/teacher_distill.py",
            ),
            tests=(
                "tests/losses/test_losses_mutants.py",
                "tests/losses/test_losses_channels.py",
                "tests/losses/test_losses_distill.py",
                "tests/losses/test_losses_dppo.py",
                "tests/losses/test_losses_policy.py",
                "tests/losses/test_losses_preference.py",
                "tests/losses/test_losses_teacher_distill.py",
                "tests/losses/test_losses_topk.py",
                "tests/losses/test_losses_survivors.py",
                "tests/losses/test_losses_teacher_invalid.py",
            ),
            target=85.0,
        ),
        Group(
            "kernels",
            files=("kernels/chunked.py", "kernels/divergences.py", "kernels/teacher_topk.py", "kernels/fused.py"),
            tests=(
                "tests/kernels/test_kernels_structure.py",
                "tests/losses/test_kernels_mutants.py",
                "tests/losses/test_losses_distill.py",
                "tests/losses/test_losses_topk.py",
                "tests/losses/test_losses_teacher_distill.py",
                "tests/losses/test_losses_channels.py",
                "tests/losses/test_losses_policy.py",
            ),
            target=85.0,
        ),
        Group(
            "training/assemble",
            files=("training/step/assemble.py", "training/step/input_builders.py"),
            tests=(
                "tests/training/step/test_assemble_mutants.py",
                "tests/training/step/test_training_assemble.py",
                "tests/training/step/test_training_fused_logprobs.py",
            ),
            target=85.0,
            sample=40,
        ),
        Group(
            "diloco/objstore",
            files=(
                "diloco/objstore/rounds.py",
                "diloco/objstore/identity.py",
                "diloco/objstore/states.py",
                "diloco/objstore/aggregate.py",
                "diloco/objstore/callback.py",
            ),
            tests=(
                "tests/diloco/test_objstore_mutants.py",
                "tests/diloco/test_objstore_states.py",
                "tests/diloco/test_diloco_aggregate.py",
                "tests/diloco/test_diloco_store_io.py",
                "tests/diloco/test_diloco_hygiene.py",
                "tests/diloco/test_diloco_codec_faults.py",
            ),
            deselect=(
                "tests/diloco/test_diloco_store_io.py::test_64_mib_object_crosses_a_slow_link_that_one_whole_request_cannot",
            ),
            target=85.0,
        ),
    )
}


@dataclass
class Mutant:
    """One mutation: ``file`` (relative to composer_plugins/), Cosmic Ray operator and occurrence."""

    group: str
    file: str
    operator: str
    occurrence: int
    line: int
    definition: str | None
    outcome: str = ""
    seconds: float = 0.0
    detail: str = ""
    diff: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.file}:{self.operator}:{self.occurrence}"


# --------------------------------------------------------------------------- enumeration


def _in_annotation(node: Any) -> bool:
    """True when ``node`` sits in a parameter, return or variable annotation (never evaluated here)."""
    child, parent = node, node.parent
    while parent is not None:
        kind = parent.type
        if kind in ("tfpdef", "param"):
            kids = parent.children
            if child in kids:
                i = kids.index(child)
                if i >= 2 and getattr(kids[i - 1], "value", None) == ":":
                    return True
        if kind == "funcdef":
            kids = parent.children
            i = kids.index(child)
            return i >= 1 and getattr(kids[i - 1], "value", None) == "->"
        if kind == "annassign":
            return parent.children.index(child) == 1
        if kind in ("classdef", "file_input", "suite"):
            return False
        child, parent = parent, parent.parent
    return False


def _operators() -> list[tuple[str, Any]]:
    from cosmic_ray.commands.init import _operators as cr_operators

    return [(name, op) for name, _args, op in cr_operators({}) if name.startswith("core/")]


def enumerate_mutants(group: Group, root: Path = REPO_ROOT) -> list[Mutant]:
    """Every mutant of the group's files, annotations left out, in a deterministic order."""
    from cosmic_ray.ast import ast_nodes, get_ast_from_path
    from cosmic_ray.ast.ast_query import ASTQuery

    out: list[Mutant] = []
    ops = _operators()
    for rel in group.files:
        nodes = list(ast_nodes(get_ast_from_path(root / PKG / rel)))
        for name, op in ops:
            occurrence = 0
            for node in nodes:
                for start, _end in op.mutation_positions(node):
                    if not _in_annotation(node):
                        out.append(
                            Mutant(group.name, rel, name, occurrence, start[0], ASTQuery(node).get_definition_name())
                        )
                    occurrence += 1
    return out


def mutated_source(m: Mutant, root: Path = REPO_ROOT) -> tuple[str, str]:
    """``(original, mutated)`` source of ``m``'s file."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    original = (root / PKG / m.file).read_text(encoding="utf-8")
    mutated = mutate_code(original, cosmic_ray.plugins.get_operator(m.operator)(), m.occurrence)
    if mutated is None:
        raise RuntimeError(f"{m.id}: no such mutation (the file changed since the mutants were listed?)")
    return original, mutated


def _diff(m: Mutant, original: str, mutated: str) -> list[str]:
    lines = difflib.unified_diff(original.splitlines(), mutated.splitlines(), lineterm="", n=0)
    return [ln for ln in lines if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


def sample(mutants: list[Mutant], k: int, seed: int, group: str) -> list[Mutant]:
    """A deterministic random sample of ``k`` (all of them when ``k`` ≥ the population or ``k`` ≤ 0)."""
    if k <= 0 or k >= len(mutants):
        return list(mutants)
    rng = random.Random(f"{seed}:{group}")
    chosen = rng.sample(range(len(mutants)), k)
    return [mutants[i] for i in sorted(chosen)]


# --------------------------------------------------------------------------- runner


def _tracked_files(root: Path) -> list[str]:
    res = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True, text=True, check=True
    )
    return [p for p in res.stdout.splitlines() if p and (root / p).is_file()]


def make_copy(root: Path, dest: Path) -> Path:
    """Copy the repository's files (as git sees them) to ``dest`` and byte-compile them there."""
    for rel in _tracked_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    import compileall

    compileall.compile_dir(str(dest / PKG), quiet=2, workers=1)
    compileall.compile_dir(str(dest / "tests"), quiet=2, workers=1)
    return dest


def _drop_pyc(copy: Path, rel: str) -> None:
    src = copy / PKG / rel
    for pyc in (src.parent / "__pycache__").glob(src.stem + ".*.pyc"):
        pyc.unlink()


def _pytest_args(group: Group, copy: Path, basetemp: Path) -> list[str]:
    tests = [t for t in group.tests if (copy / t).is_file()]
    args = ["-x", "-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=", f"--basetemp={basetemp}"]
    for d in group.deselect:
        args += ["--deselect", d]
    return args + tests


def _child(copy: Path, args: list[str], log: Path) -> None:
    """In the forked child: run pytest in ``copy`` and exit with its code (never returns)."""
    code = 98
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(copy)
        sys.path.insert(0, str(copy))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])
        sys.dont_write_bytecode = True
        import pytest

        code = int(pytest.main(args))
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 97
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


@dataclass
class _Running:
    pid: int
    mutant: Mutant | None
    slot: int
    started: float
    deadline: float
    log: Path
    original: str | None = None


class Runner:
    """Forks one pytest child per mutant, ``jobs`` at a time, each in its own copy of the repository."""

    def __init__(self, jobs: int, workdir: Path) -> None:
        self.jobs = jobs
        self.workdir = workdir
        self.copies = [make_copy(REPO_ROOT, workdir / f"copy{i}") for i in range(jobs)]

    def run_clean(self, group: Group) -> tuple[int, float, Path]:
        """Run the group's tests unmutated in copy 0: ``(exit code, seconds, log)``."""
        log = self.workdir / f"clean-{group.name.replace('/', '_')}.log"
        t0 = time.monotonic()
        pid = self._fork(group, 0, log)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status), time.monotonic() - t0, log

    def _fork(self, group: Group, slot: int, log: Path) -> int:
        copy = self.copies[slot]
        args = _pytest_args(group, copy, self.workdir / f"basetemp{slot}")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(copy, args, log)
        return pid

    def run(self, group: Group, mutants: list[Mutant], timeout_s: float, progress: Any) -> None:
        pending = list(mutants)
        free = list(range(self.jobs))
        running: dict[int, _Running] = {}
        done = 0
        while pending or running:
            while pending and free:
                m = pending.pop(0)
                slot = free.pop(0)
                original, mutated = mutated_source(m)
                m.diff = _diff(m, original, mutated)
                (self.copies[slot] / PKG / m.file).write_text(mutated, encoding="utf-8")
                _drop_pyc(self.copies[slot], m.file)
                log = self.workdir / f"slot{slot}.log"
                now = time.monotonic()
                pid = self._fork(group, slot, log)
                running[pid] = _Running(pid, m, slot, now, now + timeout_s, log, original)
            time.sleep(0.05)
            for pid, r in list(running.items()):
                got, status = os.waitpid(pid, os.WNOHANG)
                now = time.monotonic()
                if got == 0 and now < r.deadline:
                    continue
                m = r.mutant
                assert m is not None
                if got == 0:  # past its deadline: kill the child's whole session
                    _kill_group(pid)
                    os.waitpid(pid, 0)
                    m.outcome, m.detail = "timeout", f"killed after {timeout_s:.0f}s"
                else:
                    code = os.waitstatus_to_exitcode(status)
                    _kill_group(pid)  # whatever the tests left running in its session
                    m.outcome = "survived" if code == 0 else "killed"
                    m.detail = _detail(code, r.log)
                m.seconds = now - r.started
                (self.copies[r.slot] / PKG / m.file).write_text(r.original or "", encoding="utf-8")
                _drop_pyc(self.copies[r.slot], m.file)
                del running[pid]
                free.append(r.slot)
                done += 1
                progress(done, len(mutants), m)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _detail(code: int, log: Path) -> str:
    """What killed a mutant: pytest's first failing test, or the exit code."""
    if code == 0:
        return ""
    text = log.read_text(errors="replace") if log.is_file() else ""
    for line in text.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:200]
    names = {1: "tests failed", 2: "interrupted / collection error", 3: "pytest internal error", 4: "usage error"}
    return names.get(code, f"exit {code}")


# --------------------------------------------------------------------------- preload


_PROBE = """
import json, sys
import pytest
repo = sys.argv[1]
pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *sys.argv[2:]])
mods = []
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None) or ""
    if name.split(".")[0] in ("tests", "conftest", "__main__") or "composer_plugins" in name:
        continue
    if f.startswith(repo) and "/.venv/" not in f:
        continue
    mods.append(name)
print("@@MODS@@" + json.dumps(mods))
"""


def _probe_modules(groups: list[Group]) -> list[str]:
    """Third-party modules the groups' tests import (a collect-only run in a subprocess)."""
    tests = sorted({t for g in groups for t in g.tests if (REPO_ROOT / t).is_file()})
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, str(REPO_ROOT), *tests],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in res.stdout.splitlines():
        if line.startswith("@@MODS@@"):
            return json.loads(line[len("@@MODS@@") :])
    tail = res.stdout[-3000:] + res.stderr[-3000:]
    raise RuntimeError(f"the collect-only probe failed (exit {res.returncode}):\n{tail}")


def preload(groups: list[Group]) -> int:
    """Import in this process what the tests import from outside the project, so children inherit it."""
    n = 0
    for name in _probe_modules(groups):
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            n += 1
        except Exception:  # a module that does not import on its own: the tests import it themselves
            pass
    for name in list(sys.modules):
        if name.split(".")[0] == PKG:
            raise RuntimeError(f"{name} was imported by the preload; children would not see mutants of it")
    return n


# --------------------------------------------------------------------------- report


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes out of ``n`` (percent)."""
    if n == 0:
        return (0.0, 100.0)
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (100 * max(0.0, centre - half), 100 * min(1.0, centre + half))


def summarise(group: Group, population: list[Mutant], tested: list[Mutant], clean_s: float) -> dict[str, Any]:
    counts = {k: sum(m.outcome == k for m in tested) for k in ("killed", "survived", "timeout")}
    total = len(tested)
    detected = counts["killed"] + counts["timeout"]
    lo, hi = wilson(detected, total)
    per_file: dict[str, dict[str, int]] = {}
    for rel in group.files:
        ms = [m for m in tested if m.file == rel]
        per_file[rel] = {
            "population": sum(m.file == rel for m in population),
            "tested": len(ms),
            "killed": sum(m.outcome == "killed" for m in ms),
            "survived": sum(m.outcome == "survived" for m in ms),
            "timeout": sum(m.outcome == "timeout" for m in ms),
        }
    return {
        "files": list(group.files),
        "tests": [t for t in group.tests if (REPO_ROOT / t).is_file()],
        "deselected": list(group.deselect),
        "population": len(population),
        "sampled": total,
        **counts,
        "total": total,
        "score_pct": round(100 * detected / total, 1) if total else None,
        "ci95_pct": [round(lo, 1), round(hi, 1)],
        "target_pct": group.target,
        "meets_target": bool(total) and 100 * detected / total >= group.target,
        "clean_run_s": round(clean_s, 1),
        "per_file": per_file,
        "survivors": [
            {"id": m.id, "line": m.line, "in": m.definition, "diff": m.diff} for m in tested if m.outcome == "survived"
        ],
        "mutants": [
            {"id": m.id, "line": m.line, "outcome": m.outcome, "s": round(m.seconds, 1), "detail": m.detail}
            for m in tested
        ],
    }


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_report(out: Path, report: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Mutation testing",
        "",
        f"`{report['command']}` — commit {report['commit']}, seed {report['seed']}, {report['jobs']} worker(s), "
        f"{report['wall_s']:.0f} s on {report['machine']['cpu_count']} CPU(s); Cosmic Ray {report['cosmic_ray']}.",
        "",
        "Scores are estimates from a deterministic random sample of each group's mutants (Wilson 95 % interval);",
        "score = (killed + timeout) / tested.",
        "",
        "| module | mutants | tested | killed | survived | timeout | score | 95 % CI | target |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, g in report["groups"].items():
        lo, hi = g["ci95_pct"]
        mark = "met" if g["meets_target"] else "**not met**"
        lines.append(
            f"| {name} | {g['population']} | {g['total']} | {g['killed']} | {g['survived']} | {g['timeout']} | "
            f"{g['score_pct']} % | {lo}–{hi} % | ≥ {g['target_pct']:.0f} % ({mark}) |"
        )
    for name, g in report["groups"].items():
        if not g["survivors"]:
            continue
        lines += ["", f"## Survivors: {name}", ""]
        for s in g["survivors"]:
            change = " / ".join(d.strip() for d in s["diff"])[:220]
            lines.append(f"- `{s['id']}` (line {s['line']}, in `{s['in']}`): `{change}`")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- CLI


def _find(mutant_id: str) -> Mutant:
    rel = mutant_id.split(":", 1)[0]
    for g in GROUPS.values():
        if rel in g.files:
            for m in enumerate_mutants(g):
                if m.id == mutant_id:
                    return m
            raise SystemExit(f"no mutant {mutant_id!r} (operators are named like core/NumberReplacer)")
    files = sorted(f for g in GROUPS.values() for f in g.files)
    raise SystemExit(f"{rel!r} is not a mutated file; the files are: {', '.join(files)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.mutation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated groups: " + ", ".join(GROUPS))
    ap.add_argument("--sample", type=int, default=None, help="mutants per group (0: all); default per group")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="results/mutation", help="writes <out>.json and <out>.md")
    ap.add_argument("--list", action="store_true", help="list groups, tests and mutant counts, run nothing")
    ap.add_argument("--show", metavar="ID", help="print one mutant's diff")
    ap.add_argument("--mutant", metavar="ID", action="append", default=[], help="run only these mutants")
    args = ap.parse_args(argv)

    if args.show:
        m = _find(args.show)
        print("\n".join(_diff(m, *mutated_source(m))))
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(GROUPS)
    for n in names:
        if n not in GROUPS:
            import difflib as _dl

            close = _dl.get_close_matches(n, GROUPS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SystemExit(f"--only: unknown group {n!r}; the groups are: {', '.join(GROUPS)}.{hint}")
    groups = [GROUPS[n] for n in names]
    picked = [_find(i) for i in args.mutant]
    if picked:
        groups = [GROUPS[n] for n in dict.fromkeys(m.group for m in picked)]

    populations = {g.name: enumerate_mutants(g) for g in groups}
    if args.list:
        for g in groups:
            print(f"{g.name}: {len(populations[g.name])} mutants, sample {g.sample}, target ≥ {g.target:.0f} %")
            for f in g.files:
                print(f"  {PKG}/{f}: {sum(m.file == f for m in populations[g.name])}")
            for t in g.tests:
                print(f"  test {t}{'' if (REPO_ROOT / t).is_file() else ' (missing, skipped)'}")
        return 0

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_start = time.monotonic()
    print("[mutation] preloading the tests' third-party imports ...", flush=True)
    n = preload(groups)
    print(f"[mutation] {n} modules preloaded in {time.monotonic() - t_start:.0f}s", flush=True)
    report: dict[str, Any] = {
        "command": "python -m benchmarks.mutation " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": _git_commit(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "seed": args.seed,
        "jobs": args.jobs,
        "cosmic_ray": importlib.metadata.version("cosmic-ray"),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "groups": {},
    }
    failed_clean = []
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        runner = Runner(args.jobs, Path(tmp))
        for g in groups:
            pop = populations[g.name]
            chosen = [m for m in picked if m.group == g.name] or sample(
                pop, g.sample if args.sample is None else args.sample, args.seed, g.name
            )
            code, clean_s, log = runner.run_clean(g)
            if code != 0:
                tail = log.read_text(errors="replace")[-3000:]
                print(f"[mutation] {g.name}: the unmutated tests FAIL (exit {code}); skipped\n{tail}", flush=True)
                failed_clean.append(g.name)
                continue
            timeout_s = 4 * clean_s + 30
            print(
                f"[mutation] {g.name}: {len(chosen)} of {len(pop)} mutants; clean run {clean_s:.1f}s, "
                f"timeout {timeout_s:.0f}s",
                flush=True,
            )
            t0 = time.monotonic()

            def progress(
                done: int, total: int, m: Mutant, name: str = g.name, t0: float = t0, ms: list = chosen
            ) -> None:
                killed = sum(x.outcome in ("killed", "timeout") for x in ms)
                eta = (time.monotonic() - t0) / done * (total - done)
                print(
                    f"[{name} {done}/{total}] {m.outcome:8s} {m.id} (line {m.line}, {m.seconds:.1f}s) "
                    f"score {100 * killed / done:.0f}% eta {eta:.0f}s",
                    flush=True,
                )

            runner.run(g, chosen, timeout_s, progress)
            report["groups"][g.name] = summarise(g, pop, chosen, clean_s)
            s = report["groups"][g.name]
            print(
                f"[mutation] {g.name}: score {s['score_pct']}% (95% CI {s['ci95_pct'][0]}-{s['ci95_pct'][1]}%), "
                f"{s['killed']} killed, {s['survived']} survived, {s['timeout']} timeout, target {g.target:.0f}%",
                flush=True,
            )
    report["wall_s"] = time.monotonic() - t_start
    out = Path(args.out)
    if not out.is_absolute():
        out = REPO_ROOT / out
    write_report(out, report)
    print(f"[mutation] wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}", flush=True)
    print(out.with_suffix(".md").read_text(), flush=True)
    return 1 if failed_clean else 0


if __name__ == "__main__":
    sys.exit(main())
