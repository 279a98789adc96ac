"""Docs stay complete: every hookspec has a section with its signature and a test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from composer_plugins.core import hookspecs

ROOT = Path(__file__).resolve().parents[2]
HOOKS = sorted(n for n, f in vars(hookspecs).items() if n.startswith("register_") and inspect.isfunction(f))


def test_every_hookspec_is_documented_with_its_signature():
    doc = (ROOT / "docs" / "plugins.md").read_text()
    for name in HOOKS:
        args = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert f"### {name}({args})" in doc, f"docs/plugins.md lacks a '### {name}({args})' section"


def test_every_hookspec_has_a_one_line_docstring():
    for name in HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert doc and "\n" not in doc.strip(), name


def test_every_hook_has_a_test():
    tests = "".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    missing = [h for h in HOOKS if not re.search(rf"def test_hook_{h}\b", tests)]
    assert not missing, f"hooks without a test_hook_<name>: {missing}"
