"""Write docs/cli.md: every built-in command's --help, as the commands print it.

    .venv/bin/python scripts/cli_docs.py          # rewrite docs/cli.md
    .venv/bin/python scripts/cli_docs.py --check  # exit 1 when docs/cli.md is out of date

tests/core/test_core_cli_docs.py runs the check.
"""

from __future__ import annotations

import sys
from pathlib import Path

from composer_plugins.core.cli import cli_reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def main() -> int:
    text = cli_reference() + "\n"
    if "--check" in sys.argv[1:]:
        if DOC.read_text() != text:
            print(f"{DOC} is out of date: run `python scripts/cli_docs.py`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
