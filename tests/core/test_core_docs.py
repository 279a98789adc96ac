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


def test_the_changelog_heads_with_this_version_and_names_the_channel_contract_change():
    """CHANGELOG.md's newest release is the package's version, with Keep a Changelog's sections, and its Deprecated
    section names the two-argument channel form that 0.2 still serves (the plugin contract's change)."""
    import composer_plugins

    root = Path(__file__).resolve().parents[2]
    text = (root / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[([^\]]+)\]", text, flags=re.M)
    assert releases and releases[0] == composer_plugins.__version__
    newest = text.split("\n## [", 2)[1]
    assert {"Added", "Changed", "Deprecated", "Removed", "Fixed"} <= set(re.findall(r"^### (\w+)", newest, flags=re.M))
    deprecated = newest.split("### Deprecated", 1)[1].split("\n### ", 1)[0]
    assert "forward(model_outputs, batch)" in deprecated and "3.0" in deprecated
