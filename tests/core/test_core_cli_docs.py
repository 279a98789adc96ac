"""docs/cli.md shows every built-in command's --help exactly as the command prints it."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "cli.md"


def cli_reference() -> str:
    """What ``scripts/cli_docs.py`` writes to docs/cli.md."""
    spec = importlib.util.spec_from_file_location("cli_docs", ROOT / "scripts" / "cli_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.cli_reference()


def test_cli_reference_matches_the_commands_help():
    want = cli_reference() + "\n"
    have = DOC.read_text()
    diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True), "docs/cli.md", "--help", n=1))
    assert have == want, f"docs/cli.md is out of date; run `python scripts/cli_docs.py`:\n{diff[:4000]}"


def test_docs_use_the_one_override_syntax():
    """Command lines in the docs pass config overrides with -S, not with the older aliases."""
    root = DOC.parent
    for page in sorted(root.glob("*.md")):
        for i, line in enumerate(page.read_text().splitlines(), 1):
            if "composer-plugins env " in line:
                assert "--set " not in line, f"{page.name}:{i}: use -S instead of --set: {line}"
