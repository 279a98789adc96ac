"""Imports point down only: the package map of ``docs/architecture.md`` (and ``ARCHITECTURE.md``), checked.

A small AST walk over ``composer_plugins/``: every ``import``/``from ... import`` anywhere in a module
(function-level and ``TYPE_CHECKING`` imports included) that names another package of the project must
be allowed by :data:`ALLOWED` (no exceptions); no package imports another's private names (``_x``) or private
modules; the kernel (``core/`` and the package root) imports nothing beyond the stdlib, pluggy, yaml and click
(``procs/``: nothing beyond the stdlib; ``kernels/``, the LM-head kernels: nothing beyond the stdlib and torch).

The backend distributions under ``packages/`` (``composer_plugins_trl`` ...) are walked too, as backends that
live outside: they may import what ``backends`` may (and ``backends`` itself), and no private name or module
of ``composer_plugins`` at all.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "composer_plugins"
#: the separate distributions that hold the upstream backends
DISTS = ROOT / "packages"

KINDS = {"losses", "models", "envs", "teachers", "backends"}
#: package -> the project packages it may import (besides itself), from the ground up.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "procs": set(),  # child processes that never outlive their parent: stdlib only, beside the kernel, below its users
    "chat": {"core"},  # prompts rendered for a model, env-step results read: below envs, teachers and training
    "catalog": {"core"},  # the `list` and `plugins` commands over the registry
    "kernels": {"core"},  # the chunked LM-head kernels: below models and losses, which both import them
    "losses": {"core", "kernels"},
    "models": {"core", "kernels"},
    "envs": {"core", "procs", "chat"},
    "teachers": {"core", "procs", "chat"},
    "training": {"core", "procs", "chat", "losses", "models", "envs", "teachers"},
    "diloco": {"core", "procs", "training"},
    "backends": {"core", "procs", "losses", "training"},  # models and envs through training's public functions
    "testing": {"core", "procs", "chat", *KINDS, "training", "diloco"},  # the optimizers', callbacks' and codecs' kinds
    "api": {"core", *KINDS, "training", "diloco"},  # the plugin surface: every contract, from where it lives
    "pipeline": {"core", "procs", "chat", "kernels", *KINDS, "training", "diloco"},
}
#: third-party modules the kernel may import
KERNEL_THIRD_PARTY = {"pluggy", "yaml", "click"}
#: packages that may import only the stdlib (and these third-party modules) besides the project packages above
STDLIB_ONLY: dict[str, set[str]] = {
    "core": KERNEL_THIRD_PARTY,
    "procs": set(),
    "chat": set(),
    "catalog": {"click"},
    "kernels": {"torch"},
}


def _package(rel: Path) -> str:
    """``core`` for ``core/x.py`` and for the package root's own modules (the public facade); ``api`` for
    ``api.py``, the plugin surface."""
    return rel.parts[0] if len(rel.parts) > 1 else (rel.stem if rel.stem in ALLOWED else "core")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(rel: Path, source: str, external: str | None = None) -> list[str]:
    """Every import of ``source`` (the module at ``composer_plugins/<rel>``) that breaks the map.

    ``external``: ``source`` is the module at ``<external>/<rel>`` of a backend distribution (``packages/``),
    checked as a backend outside the core: every ``composer_plugins`` package it imports is foreign to it.
    """
    pkg = "backends" if external else _package(rel)
    allowed = ALLOWED[pkg] | ({pkg, "api"} if external else set())
    modparts = [*([] if external else ["composer_plugins"]), *rel.with_suffix("").parts]
    label = f"{external}/{rel.as_posix()}" if external else f"composer_plugins/{rel.as_posix()}"
    if modparts[-1] == "__init__":
        modparts = modparts[:-1]
    is_pkg_init = rel.name == "__init__.py"
    out: list[str] = []
    foreign_modules: set[str] = set()  # local names bound to another package's modules

    def check(target: str, names: list[str], lineno: int) -> None:
        where = f"{label}:{lineno}"
        parts = target.split(".")
        if parts[0] != "composer_plugins":
            if pkg in STDLIB_ONLY and parts[0] not in sys.stdlib_module_names and parts[0] not in STDLIB_ONLY[pkg]:
                also = "".join(f", {m}" for m in sorted(STDLIB_ONLY[pkg]))
                out.append(f"{where}: {pkg} imports {target!r} (only stdlib{also})")
            return
        if len(parts) == 1:  # ``from composer_plugins import x``: the facade (core) or a subpackage
            for n in names:
                if n in ALLOWED:
                    check(f"composer_plugins.{n}", [], lineno)
            return
        other = parts[1] if parts[1] in ALLOWED else "core"
        if other == pkg and not external:
            return
        if other not in allowed:
            out.append(f"{where}: {pkg} imports {target} ({pkg} may import: {sorted(allowed) or 'nothing'})")
        if any(_private(p) for p in parts[2:]):
            out.append(f"{where}: {pkg} imports the private module {target}")
        for n in names:
            if _private(n):
                out.append(f"{where}: {pkg} imports the private name {target}.{n}")

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                check(a.name, [], node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = modparts if is_pkg_init else modparts[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            check(target, names, node.lineno)
            t = target.split(".")
            if t[0] == "composer_plugins" and len(t) > 1 and (t[1] != pkg or external):
                foreign_modules.update(a.asname or a.name for a in node.names if not _private(a.name))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in foreign_modules
            and _private(node.attr)
        ):
            out.append(
                f"{label}:{node.lineno}: {pkg} uses the private name {node.value.id}.{node.attr} of another package"
            )
    return out


def test_imports_point_down_only():
    found: list[str] = []
    for path in sorted(PKG.rglob("*.py")):
        found += violations(path.relative_to(PKG), path.read_text())
    assert not found, "imports that break the package map:\n  " + "\n  ".join(found)


def test_backend_distributions_use_only_public_names_of_composer_plugins():
    found: list[str] = []
    modules = sorted(DISTS.glob("*/composer_plugins_*/**/*.py"))
    assert {p.parent.name for p in modules} >= {
        "composer_plugins_trl",
        "composer_plugins_verl",
        "composer_plugins_prime_rl",
        "composer_plugins_monarch",
    }
    for path in modules:
        dist = path.relative_to(DISTS).parts[0]
        found += violations(path.relative_to(DISTS / dist), path.read_text(), external=f"packages/{dist}")
    assert not found, "imports that break the package map:\n  " + "\n  ".join(found)


def test_every_package_is_on_the_map():
    pkgs = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert pkgs <= set(ALLOWED), f"packages missing from the map: {sorted(pkgs - set(ALLOWED))}"


def test_the_check_catches_upward_private_and_kernel_imports():
    """The walker itself: each kind of violation is found, at any depth, with file:line."""
    src = (
        "import os\n"
        "def f():\n"
        "    from composer_plugins.training.train import run_train\n"  # envs -> training: upward
        "    from ..core.config import Config\n"  # relative, allowed
        "    return run_train, Config\n"
    )
    found = violations(Path("envs/x.py"), src)
    assert len(found) == 1 and "composer_plugins/envs/x.py:3: envs imports composer_plugins.training.train" in found[0]
    found = violations(Path("backends/x.py"), "from composer_plugins.models.tiny import load_policy\n")
    assert found and "backends imports composer_plugins.models.tiny" in found[0]  # through training's functions
    found = violations(Path("backends/x.py"), "from composer_plugins.training.train import _channel_spec\n")
    assert found == [
        "composer_plugins/backends/x.py:1: backends imports the private name "
        "composer_plugins.training.train._channel_spec"
    ]
    found = violations(Path("backends/x.py"), "from composer_plugins.training import train\ntrain._x()\n")
    assert found and "train._x" in found[0] and ":2:" in found[0]
    assert violations(Path("core/x.py"), "import torch\n")
    assert violations(Path("core/x.py"), "from .. import training\n")
    assert not violations(
        Path("core/x.py"), "import json, pluggy, yaml, click\nfrom composer_plugins import __version__\n"
    )
    assert not violations(Path("pipeline/x.py"), "from composer_plugins.diloco.launch import launch\n")
    # procs: stdlib only, below its users; the kernel does not import it
    assert violations(Path("procs/x.py"), "import yaml\n") and violations(Path("procs/x.py"), "import torch\n")
    assert violations(Path("core/x.py"), "from composer_plugins import procs\n")
    assert violations(Path("procs/x.py"), "from composer_plugins.envs import sandbox\n")
    assert not violations(Path("envs/x.py"), "from composer_plugins import procs\n")
    # the LM-head kernels: below models and losses, which import them; they import only core and torch
    assert not violations(Path("models/x.py"), "from composer_plugins.kernels.chunked import chunked_logprobs\n")
    assert not violations(Path("losses/x.py"), "from composer_plugins.kernels.divergences import make_kernel\n")
    assert not violations(Path("kernels/x.py"), "import math\nimport torch\nfrom .divergences import _up\n")
    found = violations(Path("models/x.py"), "from composer_plugins.losses.functional import chunked_logprobs\n")
    assert found and "models imports composer_plugins.losses.functional" in found[0]
    found = violations(Path("kernels/x.py"), "from composer_plugins.models.logprobs import lm_head_weight\n")
    assert found and "kernels imports composer_plugins.models.logprobs" in found[0]
    found = violations(Path("kernels/chunked.py"), "import torch\nimport numpy as np\n")
    assert found == ["composer_plugins/kernels/chunked.py:2: kernels imports 'numpy' (only stdlib, torch)"]
    # a backend distribution: public names of backends/training are fine, private ones and upward imports are not
    ext = "packages/composer-plugins-x"
    ok = "from composer_plugins.backends import rollout\nfrom composer_plugins.backends.base import Backend\n"
    assert not violations(Path("cp_x/backend.py"), ok + "from . import plugin\n", ext)
    found = violations(Path("cp_x/backend.py"), "from composer_plugins.backends import _rollout\n", ext)
    assert found == [
        "packages/composer-plugins-x/cp_x/backend.py:1: backends imports the private name "
        "composer_plugins.backends._rollout"
    ]
    found = violations(Path("cp_x/backend.py"), "import os\nfrom composer_plugins.backends import base\nbase._x\n", ext)
    assert found and ":3:" in found[0] and "base._x" in found[0]
    assert violations(Path("cp_x/backend.py"), "from composer_plugins.pipeline import stages\n", ext)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(name: str, source: str, modules: set[str], is_pkg: bool = False) -> list[tuple[str, int]]:
    """``(module imported, line)`` for every import of ``source`` (module ``name``) that names one of ``modules``.

    Every import counts, wherever it is: module level, inside a function (lazy), under ``TYPE_CHECKING``.
    ``from pkg import name`` is an import of the submodule ``pkg.name`` when that is a module, else of ``pkg``.
    """
    base_parts = name.split(".") if is_pkg else name.split(".")[:-1]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base_parts[: len(base_parts) - (node.level - 1)]
                target = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in modules:
                    out.append((sub, node.lineno))
                elif target in modules:
                    out.append((target, node.lineno))
    return [(m, line) for m, line in out if m != name]


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module in ``{module: {imported: line}}`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def project_import_graph(roots: list[Path]) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    files = {_module_name(p, r.parent): p for r in roots for p in sorted(r.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        edges = import_edges(name, path.read_text(), set(files), is_pkg=path.name == "__init__.py")
        graph[name] = {}
        for m, line in edges:
            graph[name].setdefault(m, line)
    return graph, files


def test_no_import_circles():
    """No circle of imports among the project's modules (the backend distributions included).

    Lazy (function-level) and ``TYPE_CHECKING`` imports count: a circle broken only by importing late is
    still two rooms that each need the other. A lower module that needs a behaviour from above takes a
    callable or declares a hook.
    """
    graph, files = project_import_graph([PKG, *sorted(p for p in DISTS.glob("*/composer_plugins_*") if p.is_dir())])
    msgs = []
    for group in import_circles(graph):
        inside = set(group)
        where = [
            f"{files[a].relative_to(ROOT)}:{line} imports {b}"
            for a in group
            for b, line in graph[a].items()
            if b in inside
        ]
        msgs.append(" <-> ".join(group) + "\n    " + "\n    ".join(where))
    assert not msgs, "import circles:\n  " + "\n  ".join(msgs)


def test_the_circle_check_finds_lazy_and_type_checking_circles():
    mods = {"p", "p.a", "p.b", "p.c"}
    a = "def f():\n    from p.b import g\n"  # lazy
    b = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\n"  # type-only, submodule form
    c = "from . import b\nfrom .b import g\n"  # relative; c -> b only: no circle
    graph = {
        "p.a": dict(import_edges("p.a", a, mods)),
        "p.b": dict(import_edges("p.b", b, mods)),
        "p.c": dict(import_edges("p.c", c, mods)),
    }
    assert graph["p.a"] == {"p.b": 2} and graph["p.b"] == {"p.a": 3} and graph["p.c"] == {"p.b": 2}
    assert import_circles(graph) == [["p.a", "p.b"]]
    assert import_circles({"p.a": {"p.b": 1}, "p.b": {"p.c": 1}, "p.c": {}}) == []


#: The most lines a module of ``training/`` may have, and the Lightning module's file (the step only).
TRAINING_FILE_LINES = 500
MODULE_FILE_LINES = 400


def test_training_files_are_small():
    """Every file of ``training/`` is at most 500 lines, and ``module.py`` (``ComposerModule``, the Lightning
    step only) at most 400: rollout, multi-turn, step record, input assembly and evaluation have their own."""
    big = []
    for path in sorted((PKG / "training").rglob("*.py")):
        n = len(path.read_text().splitlines())
        limit = MODULE_FILE_LINES if path.name == "module.py" else TRAINING_FILE_LINES
        if n > limit:
            big.append(f"{path.relative_to(ROOT)}: {n} lines (at most {limit})")
    assert not big, "split these:\n  " + "\n  ".join(big)


#: The most lines any other module of the package may have (measured on ``ruff format``-ted source).
PACKAGE_FILE_LINES = 700
#: ``# fmt: skip`` is for a table the formatter would scramble, never for meeting a size limit.
FMT_SKIPS = 20


def test_package_files_are_small():
    """Every module of ``composer_plugins/`` outside ``training/`` is at most 700 lines: a bigger one is split
    along its purposes (the size is the formatted size: ``ruff format --check`` runs in CI)."""
    big = []
    for path in sorted(PKG.rglob("*.py")):
        if PKG / "training" in path.parents:
            continue
        n = len(path.read_text().splitlines())
        if n > PACKAGE_FILE_LINES:
            big.append(f"{path.relative_to(ROOT)}: {n} lines (at most {PACKAGE_FILE_LINES})")
    assert not big, "split these along their purposes:\n  " + "\n  ".join(big)


def test_formatter_skips_are_few_and_give_a_reason():
    """At most 20 ``# fmt: skip`` in the tree, each followed by its reason (``# fmt: skip  (why)``)."""
    skips, bare = 0, []
    for path in sorted(ROOT.rglob("*.py")):
        if any(part.startswith(".") or part in ("build", "node_modules") for part in path.relative_to(ROOT).parts):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "# fmt: skip" in line:
                skips += 1
                if not line.split("# fmt: skip", 1)[1].strip():
                    bare.append(f"{path.relative_to(ROOT)}:{i}")
    assert skips <= FMT_SKIPS, f"{skips} '# fmt: skip' in the tree (at most {FMT_SKIPS})"
    assert not bare, "'# fmt: skip' without a reason:\n  " + "\n  ".join(bare)


def test_channel_inputs_are_assembled_in_one_place():
    """The backend adapters build channel inputs through the one assembler (``training/step/assemble.py``, reached
    through the backend surface): each imports it, and none defines its own padding or hint/pair input helpers."""
    helpers = re.compile(r"^\s*def (_?(right|left)_pad|_hint_inputs|_pair_inputs|_all_inputs)\b", re.M)
    for dist in ("trl", "verl", "prime_rl"):
        (path,) = DISTS.glob(f"*/composer_plugins_{dist}/backend.py")
        source = path.read_text()
        uses = re.search(
            r"from composer_plugins\.backends\.surface import [^)]*\b(assemble_inputs|StepPolicy)\b", source
        )
        assert uses, f"{path.relative_to(ROOT)} bypasses the assembler"
        assert not helpers.search(source), f"{path.relative_to(ROOT)} defines its own channel-input helper"
    monarch = next(DISTS.glob("*/composer_plugins_monarch/backend.py")).read_text()
    assert ".loss_on(" in monarch  # the native module's step: record, then the assembler


#: The most lines ``core/`` (the plugin kernel) may have, and any package's ``__init__.py``.
CORE_LINES = 2000
INIT_LINES = 150


def test_the_kernel_and_every_package_init_are_small():
    """``core/`` holds the plugin kernel only (at most 2,000 lines: what is not the kernel lives with its users),
    and no ``__init__.py`` is over 150 lines (a package's modules are split by purpose, not kept in its init)."""
    core = sum(len(p.read_text().splitlines()) for p in (PKG / "core").glob("*.py"))
    assert core <= CORE_LINES, f"composer_plugins/core/ is {core} lines (at most {CORE_LINES})"
    big = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sorted(PKG.rglob("__init__.py"))
        if (n := len(p.read_text().splitlines())) > INIT_LINES
    ]
    assert not big, f"__init__.py over {INIT_LINES} lines:\n  " + "\n  ".join(big)


#: Modules that moved out of the kernel: the old path serves each name with a PluginDeprecationWarning until 0.3.0.
MOVED = {
    "composer_plugins.core.chat": ("composer_plugins.chat.render", "render_prompt"),
    "composer_plugins.core.steps": ("composer_plugins.chat.env_step", "step_result"),
}


def test_moved_modules_warn_and_name_their_new_home():
    import importlib
    import warnings

    import pytest

    from composer_plugins.core.errors import PluginDeprecationWarning

    for old, (new, name) in MOVED.items():
        src = (PKG.parent / (old.replace(".", "/") + ".py")).read_text()
        assert "import" not in src.split("moved_module", 1)[1], f"{old} must only point to {new}"
        with pytest.warns(PluginDeprecationWarning, match=rf"{old}\.{name} moved to {new}\.{name}") as rec:
            value = getattr(importlib.import_module(old), name)
        assert value is getattr(importlib.import_module(new), name)
        assert rec[0].filename == __file__  # the warning points at the caller's line
        with warnings.catch_warnings(), pytest.raises(AttributeError, match="nope"):
            warnings.simplefilter("ignore")
            importlib.import_module(old).nope  # noqa: B018


def docs_map(text: str) -> dict[str, set[str]]:
    """``{package: the project packages its "may import" cell names}`` from the table of docs/architecture.md."""
    section = text.split("## Packages, from the ground up", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            pkg = cells[0].strip("`/").removesuffix(".py")
            out[pkg] = {w for w in re.findall(r"[a-z_]+", cells[2]) if w in ALLOWED and w != pkg}
    return out


def test_docs_architecture_table_is_the_map():
    """docs/architecture.md's "may import" column says what :data:`ALLOWED` enforces, row for row."""
    have = docs_map((ROOT / "docs" / "architecture.md").read_text())
    assert set(have) == set(ALLOWED), (
        f"rows missing: {set(ALLOWED) - set(have)}; not packages: {set(have) - set(ALLOWED)}"
    )
    wrong = [
        f"{p}: docs say {sorted(have[p])}, the test allows {sorted(ALLOWED[p])}"
        for p in ALLOWED
        if have[p] != ALLOWED[p]
    ]
    assert not wrong, "docs/architecture.md disagrees with ALLOWED:\n  " + "\n  ".join(wrong)
    assert docs_map("## Packages, from the ground up\n| `x/` | owns | core, y (z) |\n") == {"x": {"core"}}


#: The two modules a backend distribution under ``packages/`` may import: the plugin contracts and the backend surface.
SURFACE = ("composer_plugins.api", "composer_plugins.backends.surface")


def surface_violations(label: str, source: str) -> list[str]:
    """Every import in ``source`` of a ``composer_plugins`` module other than the two of :data:`SURFACE`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        targets = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            targets = [node.module or ""]
        for t in targets:
            if t.split(".")[0] == "composer_plugins" and t not in SURFACE:
                out.append(f"{label}:{node.lineno}: imports {t} (a backend imports only {' and '.join(SURFACE)})")
    return out


def test_backend_distributions_import_only_the_declared_surface():
    found = []
    for path in sorted(DISTS.glob("*/composer_plugins_*/**/*.py")):
        found += surface_violations(str(path.relative_to(ROOT)), path.read_text())
    assert not found, "imports outside the declared surface:\n  " + "\n  ".join(found)
    bad = "import composer_plugins.training.step.record\nfrom composer_plugins import build\n"
    bad += "from composer_plugins.api import hookimpl\nfrom composer_plugins_x import y\n"
    assert [v.split(": ")[1] for v in surface_violations("x.py", bad)] == [
        "imports composer_plugins.training.step.record (a backend imports only composer_plugins.api and "
        "composer_plugins.backends.surface)",
        "imports composer_plugins (a backend imports only composer_plugins.api and composer_plugins.backends.surface)",
    ]


def test_the_surfaces_reexport_each_name_from_a_room_they_may_import():
    """``api`` and ``backends.surface`` re-export names lazily (by module path, not by ``import``): each path is
    in a room its module may import, each name is the object at its home, and none is private."""
    import importlib

    from composer_plugins.core import hookspecs

    for module, room in (("composer_plugins.api", "api"), ("composer_plugins.backends.surface", "backends")):
        mod = importlib.import_module(module)
        for home, names in mod._EXPORTS.items():
            parts = home.split(".")
            if parts[0] == "composer_plugins" and len(parts) > 1:
                assert parts[1] in ALLOWED[room] | {room}, f"{module} re-exports from {home} ({room} may not import it)"
            for n in names:
                assert not _private(n) and getattr(mod, n) is getattr(importlib.import_module(home), n), (module, n)
        assert set(mod.__all__) == {n for names in mod._EXPORTS.values() for n in names}
    hooks = {n for n in vars(hookspecs) if n.startswith("register_")}
    api = importlib.import_module("composer_plugins.api")
    assert set(api.CONTRACTS) == hooks, (
        f"hooks without a contract in composer_plugins.api: {hooks - set(api.CONTRACTS)}"
    )


#: ``training/``'s sub-packages, from the ground up: each imports only those before it.
TRAINING_ORDER = ("config", "rollout", "step", "lightning", "runs")
#: The upward imports inside ``training/`` that are left, each with its reason (module, imported sub-package).
TRAINING_UPWARD = {
    ("config/inputs.py", "rollout"): "PROMPT_KEYS: the chat-template keys a channel input may name",
    ("config/sections.py", "rollout"): "a section checks its chat template (lazy)",
    ("config/sections.py", "step"): "a section checks its optimizer name against the registry (lazy)",
    ("config/sections.py", "lightning"): "a section checks its callback names against the registry (lazy)",
    ("step/policy.py", "runs"): "a missing warm start is built by SFT before the step loads it",
}
#: The most modules a sub-package of ``training/`` may hold (``__init__.py`` aside).
TRAINING_SUBPACKAGE_MODULES = 12


def test_training_is_split_by_job_and_points_down():
    """``training/`` holds only sub-packages (each with a docstring saying what it owns, at most 12 modules), and
    a sub-package imports only those below it in :data:`TRAINING_ORDER`, except the listed, reasoned imports."""
    tr = PKG / "training"
    assert [p.name for p in tr.glob("*.py")] == ["__init__.py"], "training/ holds sub-packages only"
    subs = sorted(p.name for p in tr.iterdir() if (p / "__init__.py").is_file())
    assert subs == sorted(TRAINING_ORDER)
    found, used = [], set()
    for sub in TRAINING_ORDER:
        init = tr / sub / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(ROOT)} says what it owns"
        modules = [p for p in (tr / sub).glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= TRAINING_SUBPACKAGE_MODULES, f"training/{sub}: {len(modules)} modules"
        for path in modules:
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for name in names:
                    parts = name.split(".")
                    if parts[:2] != ["composer_plugins", "training"] or len(parts) < 3 or parts[2] == sub:
                        continue
                    key = (f"{sub}/{path.name}", parts[2])
                    if TRAINING_ORDER.index(parts[2]) > TRAINING_ORDER.index(sub):
                        if key in TRAINING_UPWARD:
                            used.add(key)
                        else:
                            found.append(f"training/{key[0]}:{node.lineno}: {sub} imports {name}")
    assert not found, "imports inside training/ point down only:\n  " + "\n  ".join(found)
    assert used == set(TRAINING_UPWARD), f"no longer needed, drop from TRAINING_UPWARD: {set(TRAINING_UPWARD) - used}"


def hookimpl_lines(source: str) -> list[int]:
    """The lines where ``source`` defines a hook implementation pluggy would register from the module: a module- or
    class-level function decorated with ``hookimpl`` (``@hookimpl``, ``@hookimpl(...)``, ``@hookspecs.hookimpl``) or
    a name bound to ``hookimpl(...)``/``builtin_hook(...)``. A function made inside another one (``builtin_hook``'s
    own) is no module's registration; ``pytest.hookimpl`` is pytest's."""

    def ours(expr: ast.expr) -> bool:
        expr = expr.func if isinstance(expr, ast.Call) else expr
        if isinstance(expr, ast.Name):
            return expr.id in ("hookimpl", "builtin_hook")
        root = expr
        while isinstance(root, ast.Attribute):
            root = root.value
        pytest_marker = isinstance(root, ast.Name) and root.id == "pytest"
        return isinstance(expr, ast.Attribute) and expr.attr in ("hookimpl", "builtin_hook") and not pytest_marker

    out: list[int] = []
    body = list(ast.parse(source).body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(map(ours, node.decorator_list)):
            out.append(node.lineno)
        elif isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Call) and ours(node.value):
            out.append(node.lineno)
        elif isinstance(node, ast.ClassDef | ast.If | ast.Try):
            body += [*node.body, *getattr(node, "orelse", [])]
    return sorted(out)


def plugin_module_problems(sources: dict[Path, str], defaults: tuple[str, ...]) -> list[str]:
    """What breaks "one registration module per package" in ``{path under composer_plugins/: source}``: a hook
    implementation outside a module named ``plugin.py``, two such modules in one top-level package, or
    ``defaults`` (``DEFAULT_PLUGINS``) other than exactly those modules."""
    out: list[str] = []
    modules: dict[str, list[str]] = {}
    for rel, source in sorted(sources.items()):
        lines = hookimpl_lines(source)
        if not lines:
            continue
        if rel.name != "plugin.py":
            out += [f"composer_plugins/{rel.as_posix()}:{n}: a hookimpl outside the package's plugin.py" for n in lines]
            continue
        modules.setdefault(rel.parts[0], []).append(".".join(["composer_plugins", *rel.with_suffix("").parts]))
    for pkg, names in sorted(modules.items()):
        if len(names) > 1:
            out.append(f"{pkg}: {len(names)} registration modules ({', '.join(names)}), one plugin.py at most")
    found = {n for names in modules.values() for n in names}
    twice = sorted({d for d in defaults if defaults.count(d) > 1})
    if set(defaults) != found or twice:
        out.append(
            f"DEFAULT_PLUGINS lists exactly the registration modules: missing {sorted(found - set(defaults))}, "
            f"registering nothing {sorted(set(defaults) - found)}, listed twice {twice}"
        )
    return out


def test_one_registration_module_per_package():
    """Every ``@hookimpl`` of the project lives in its package's one ``plugin.py`` (``training``'s is
    ``training/runs/plugin.py``: ``training/`` holds sub-packages only), and ``DEFAULT_PLUGINS`` lists exactly those."""
    from composer_plugins.core.plugins import DEFAULT_PLUGINS

    sources = {p.relative_to(PKG): p.read_text() for p in sorted(PKG.rglob("*.py"))}
    found = plugin_module_problems(sources, DEFAULT_PLUGINS)
    assert not found, "built-in registration outside one plugin.py per package:\n  " + "\n  ".join(found)


def test_the_registration_check_catches_stray_hookimpls():
    """The check itself: each kind of hook implementation is found (with its line), and each breach is reported."""
    src = (
        "from x import hookimpl, builtin_hook\n"
        "@hookimpl\ndef register_envs(register): ...\n"  # line 3 (the def)
        "@hookspecs.hookimpl(tryfirst=True)\ndef register_commands(cli): ...\n"  # 5
        "register_codecs = builtin_hook('m', {})\n"  # 6
        "class P:\n    @hookimpl\n    def register_teachers(self, register): ...\n"  # 9
        "@pytest.hookimpl(wrapper=True)\ndef pytest_runtest_call(item): ...\n"  # pytest's
    )
    factory = "def builtin_hook(m, t):\n    @hookspecs.hookimpl\n    def hook(register): ...\n    return hook\n"
    assert hookimpl_lines(src) == [3, 5, 6, 9] and hookimpl_lines(factory) == []
    ok = {Path("envs/plugin.py"): src, Path("envs/x.py"): "def f(): ...\n", Path("core/registry.py"): factory}
    defaults = ("composer_plugins.envs.plugin",)
    assert plugin_module_problems(ok, defaults) == []
    stray = plugin_module_problems({**ok, Path("envs/sub/cli.py"): src}, defaults)
    assert len(stray) == 4 and all(s.startswith("composer_plugins/envs/sub/cli.py:") for s in stray)
    two = plugin_module_problems({**ok, Path("envs/sub/plugin.py"): src}, defaults)
    assert len(two) == 2 and "envs: 2 registration modules" in two[0] and "composer_plugins.envs.sub.plugin" in two[1]
    assert plugin_module_problems(ok, (*defaults, "composer_plugins.envs.x"))  # lists a module that registers nothing
    assert plugin_module_problems(ok, ())  # lacks one
    assert plugin_module_problems(ok, defaults * 2)  # names one twice
