"""Imports point down only: the package map of ``docs/architecture.md`` (and ``ARCHITECTURE.md``), checked.

A small AST walk over ``composer_plugins/``: every ``import``/``from ... import`` anywhere in a module
(function-level and ``TYPE_CHECKING`` imports included) that names another package of the project must
be allowed by :data:`ALLOWED`; no package imports another's private names (``_x``) or private modules;
and the kernel (``core/`` and the package root) imports nothing beyond the stdlib, pluggy, yaml and click.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "composer_plugins"

KINDS = {"losses", "models", "envs", "teachers", "backends"}
#: package -> the project packages it may import (besides itself). ``models`` may use the chunked
#: log-prob kernels of ``losses`` (``losses.chunked``), which never import ``models`` back.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "losses": {"core"},
    "models": {"core", "losses"},
    "envs": {"core"},
    "teachers": {"core"},
    "training": {"core", "losses", "models", "envs", "teachers"},
    "diloco": {"core", "training"},
    "backends": {"core", "losses", "models", "training"},
    "testing": {"core", *KINDS, "training"},  # training: the optimizers' and callbacks' kinds
    "pipeline": {"core", "losses", "models", "envs", "teachers", "training", "diloco", "backends"},
}
#: third-party modules the kernel may import
KERNEL_THIRD_PARTY = {"pluggy", "yaml", "click"}


def _package(rel: Path) -> str:
    """``core`` for ``core/x.py`` and for the package root's own modules (the public facade)."""
    return rel.parts[0] if len(rel.parts) > 1 else "core"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(rel: Path, source: str) -> list[str]:
    """Every import of ``source`` (the module at ``composer_plugins/<rel>``) that breaks the map."""
    pkg = _package(rel)
    modparts = ["composer_plugins", *rel.with_suffix("").parts]
    if modparts[-1] == "__init__":
        modparts = modparts[:-1]
    is_pkg_init = rel.name == "__init__.py"
    out: list[str] = []
    foreign_modules: set[str] = set()  # local names bound to another package's modules

    def check(target: str, names: list[str], lineno: int) -> None:
        where = f"composer_plugins/{rel.as_posix()}:{lineno}"
        parts = target.split(".")
        if parts[0] != "composer_plugins":
            if pkg == "core" and parts[0] not in sys.stdlib_module_names and parts[0] not in KERNEL_THIRD_PARTY:
                out.append(f"{where}: the kernel imports {target!r} (only stdlib, pluggy, yaml, click)")
            return
        if len(parts) == 1:  # ``from composer_plugins import x``: the facade (core) or a subpackage
            for n in names:
                if n in ALLOWED:
                    check(f"composer_plugins.{n}", [], lineno)
            return
        other = parts[1] if parts[1] in ALLOWED else "core"
        if other == pkg:
            return
        if other not in ALLOWED[pkg]:
            out.append(f"{where}: {pkg} imports {target} ({pkg} may import: {sorted(ALLOWED[pkg]) or 'nothing'})")
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
            if t[0] == "composer_plugins" and len(t) > 1 and t[1] != pkg:
                foreign_modules.update(a.asname or a.name for a in node.names if not _private(a.name))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in foreign_modules
            and _private(node.attr)
        ):
            out.append(
                f"composer_plugins/{rel.as_posix()}:{node.lineno}: {pkg} uses the private name "
                f"{node.value.id}.{node.attr} of another package"
            )
    return out


def test_imports_point_down_only():
    found: list[str] = []
    for path in sorted(PKG.rglob("*.py")):
        found += violations(path.relative_to(PKG), path.read_text())
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
    found = violations(Path("backends/x.py"), "from composer_plugins.training.train import _channel_spec\n")
    assert found == ["composer_plugins/backends/x.py:1: backends imports the private name "
                     "composer_plugins.training.train._channel_spec"]  # fmt: skip
    found = violations(Path("backends/x.py"), "from composer_plugins.training import train\ntrain._x()\n")
    assert found and "train._x" in found[0] and ":2:" in found[0]
    assert violations(Path("core/x.py"), "import torch\n")
    assert violations(Path("core/x.py"), "from .. import training\n")
    assert not violations(
        Path("core/x.py"), "import json, pluggy, yaml, click\nfrom composer_plugins import __version__\n"
    )
    assert not violations(Path("pipeline/x.py"), "from composer_plugins.diloco.launch import launch\n")
