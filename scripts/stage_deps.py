"""Check that every DVC stage's deps cover all the project code its command runs, and every path it reads elsewhere.

A stage's deps are written by hand in dvc.yaml; this derives what they must hold and names what they miss.

* **Code.** Each stage runs one or more ``composer-plugins ...`` commands (``&&``-joined). What a command runs is
  (a) every ``composer_plugins`` module loaded when the command line starts (it loads every built-in plugin:
  losses, teachers, envs, backends, diloco, pipeline), recorded from ``sys.modules`` in this process after
  :func:`composer_plugins.core.cli.load_commands`, and (b) the static closure of the imports the command's
  callback makes: every ``import``/``from ... import`` of a ``composer_plugins`` module in the callback's body,
  then in each module reached, at any depth (a lazy import inside a function counts: it runs when that path
  is taken, and a static walk cannot know which paths are). Each module's file must lie under one of the
  stage's deps (a directory dep covers everything under it).
* **Paths read from another study.** A study's cells may read a teacher model from another study's directory
  (``model_path: ../confirm/models/teacher/model``) and its report may pool other studies
  (``study.warm_starts``): each such ``../`` path in the study's params must lie under one of the deps of the
  stage that reads it (``train`` for a variant's paths; ``report`` for each warm start's ``evals`` and ``runs``
  and the ``results/teacher.json`` of every study whose teacher a cell used).

    .venv/bin/python scripts/stage_deps.py                    # root dvc.yaml and every studies/*/dvc.yaml
    .venv/bin/python scripts/stage_deps.py studies/confirm    # one project
    .venv/bin/python scripts/stage_deps.py --json ...         # what each stage imports, as JSON

Exits 1 naming each stage and what its deps miss. tests/pipeline/test_stage_deps.py runs it.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import shlex
import sys
import textwrap
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "composer_plugins"


@cache
def module_file(name: str) -> Path | None:
    """The ``.py`` file of module ``name`` (a package's ``__init__.py``), or None when it is not a module."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin).resolve()


def imported_modules(tree: ast.AST) -> set[str]:
    """Every ``composer_plugins`` module ``tree`` imports, at any depth (``from a import b``: ``a.b`` if a module)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] == PACKAGE and module_file(n) is not None}


def closure(start: set[str]) -> set[str]:
    """``start`` and every module it imports, transitively, with each module's parent packages."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(module_imports(name))
    return seen


@cache
def module_imports(name: str) -> frozenset[str]:
    """What module ``name``'s file imports (:func:`imported_modules`), parsed once."""
    path = module_file(name)
    return frozenset(imported_modules(ast.parse(path.read_text(), str(path)))) if path else frozenset()


@cache
def _callback_modules(fn: Any) -> frozenset[str]:
    body = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return frozenset(closure(imported_modules(body) | {fn.__module__}))


def command_modules(group: Any, argv: list[str], where: str) -> set[str]:
    """The modules command line ``argv`` (without ``composer-plugins``) reaches from its callback."""
    cmd = group
    for tok in argv:
        if tok.startswith("-"):
            continue
        sub = getattr(cmd, "commands", {}).get(tok)
        if sub is None:
            break
        cmd = sub
    if cmd is group or cmd.callback is None:
        raise SystemExit(f"{where}: {' '.join(argv)!r} names no composer-plugins command")
    return set(_callback_modules(inspect.unwrap(cmd.callback)))


def stage_commands(stage: dict[str, Any], where: str) -> list[list[str]]:
    """The ``composer-plugins`` command lines of a stage's ``cmd`` (``&&``-joined), each without the program name."""
    cmd = stage["cmd"]
    out = []
    for part in cmd if isinstance(cmd, list) else [cmd]:
        for one in str(part).split("&&"):
            argv = shlex.split(one)
            if not argv or argv[0] != "composer-plugins":
                raise SystemExit(f"{where}: cmd {one.strip()!r} is not a composer-plugins command")
            out.append(argv[1:])
    return out


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() or "." if path.is_relative_to(ROOT) else str(path)


def covered(path: Path, deps: list[Path]) -> bool:
    return any(path == d or d in path.parents for d in deps)


def external_reads(params: dict[str, Any]) -> dict[str, set[str]]:
    """``{stage: {path}}``: the ``../`` paths a study's params make a stage read from outside its directory."""
    out: dict[str, set[str]] = {"train": set(), "report": set()}

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
        elif isinstance(value, str) and value.startswith("../"):
            out["train"].add(value)

    study = params.get("study") or {}
    walk(study.get("variants") or {})
    walk(params.get("train") or {})
    # the report pools each warm start's evals and curves, and names the accuracy of every teacher a cell used
    out["report"].update(f"{ws}/{sub}" for ws in study.get("warm_starts") or [] for sub in ("evals", "runs"))
    out["report"].update(f"../{Path(p).parts[1]}/results/teacher.json" for p in out["train"] if len(Path(p).parts) > 2)
    return out


def check(project: Path, start: set[str], group: Any) -> tuple[list[str], dict[str, list[str]]]:
    """Problems of ``project``'s dvc.yaml (one line each), and what each stage imports (repository-relative)."""
    dvc = project / "dvc.yaml"
    stages = yaml.safe_load(dvc.read_text())["stages"]
    params_file = project / "params.yaml"
    params = yaml.safe_load(params_file.read_text()) if params_file.is_file() else {}
    reads = external_reads(params)
    problems: list[str] = []
    imports: dict[str, list[str]] = {}
    for name, stage in stages.items():
        where = f"{_rel(dvc)}: stage {name}"
        deps = [(project / str(d)).resolve() for d in stage.get("deps") or [] if "${item" not in str(d)]
        mods = set(start)
        for argv in stage_commands(stage, where):
            mods |= command_modules(group, argv, where)
        files = sorted({f for m in mods if (f := module_file(m)) is not None})
        imports[name] = [_rel(f) for f in files]
        missing = sorted({_rel(f.parent) for f in files if not covered(f, deps)})
        if missing:
            problems.append(f"{where}: deps miss code it runs, under {', '.join(missing)} (add those packages)")
        for path in sorted(reads.get(name, ())):
            if not covered((project / path).resolve(), deps):
                problems.append(f"{where}: reads {path} (params.yaml) but no dep covers it: add it to its deps")
    return problems, imports


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args
    targets = [a for a in args if not a.startswith("--")]
    projects = [(ROOT / t).resolve() for t in targets] or [
        ROOT,
        *sorted(p.parent for p in ROOT.glob("studies/*/dvc.yaml")),
    ]
    from composer_plugins.core.cli import load_commands

    group = load_commands()
    start = {m for m in sys.modules if m.split(".")[0] == PACKAGE}  # loaded by every command at start-up
    problems: list[str] = []
    report: dict[str, Any] = {}
    for project in projects:
        found, imports = check(project, start, group)
        problems += found
        report[_rel(project)] = imports
    if as_json:
        print(json.dumps(report, indent=1))
    for line in problems:
        print(line, file=sys.stderr)
    if not problems and not as_json:
        print(f"every stage's deps cover its code and reads ({len(projects)} DVC projects)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
