"""Print one of README.md's two newcomer commands, as written there (stdlib only: runs before any install).

    python3 scripts/readme_commands.py main   # the first ```bash block: install + run the main job
    python3 scripts/readme_commands.py test   # the second ```bash block: install + run the tests

`.ci/run` runs exactly what this prints, so CI and the README cannot drift apart. It fails (exit 2)
unless the README's "Two commands on a fresh machine" section holds exactly two one-line bash blocks.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Two commands on a fresh machine"
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def commands(text: str) -> dict[str, str]:
    """``{"main": ..., "test": ...}``: the two bash blocks of the README's fresh-machine section."""
    start = text.find(SECTION)
    if start < 0:
        raise ValueError(f"README.md has no {SECTION!r} section")
    end = text.find("\n## ", start + len(SECTION))
    blocks = [b.strip() for b in FENCE.findall(text[start : end if end > 0 else len(text)])]
    if len(blocks) != 2 or any("\n" in b or not b for b in blocks):
        raise ValueError(f"{SECTION!r} must hold exactly two one-line ```bash blocks (main job, tests); got {blocks}")
    return {"main": blocks[0], "test": blocks[1]}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("main", "test"):
        print("usage: readme_commands.py main|test", file=sys.stderr)
        return 2
    try:
        print(commands(README.read_text())[argv[0]])
    except ValueError as e:
        print(f"{README}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
