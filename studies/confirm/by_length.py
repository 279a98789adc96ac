"""Held-out accuracy of every arm by operand length (3, 4, 5 digits) and by whether the sum ends in a carry.

Declared in README.md before any cell ran, and descriptive, not a test: it shows where each arm's accuracy comes
from (the problems whose sum carries out of the last column, which a start trained with slip 1.0 never answers
right unprompted, and the rest). Reads each start's evals/*.json (per-problem ``correct``) and
data/tasks/gsm8k/test.jsonl; writes results/by_length.md.

    python by_length.py
"""

from __future__ import annotations

import json
from pathlib import Path

DIRS = [".", "../confirm_b", "../confirm_c", "../confirm_d", "../confirm_e"]


def classes(root: Path) -> list[tuple[str, str]]:
    """Per test problem: its operand length and whether its sum carries out of the last column."""
    rows = [json.loads(x) for x in (root / "data/tasks/gsm8k/test.jsonl").read_text().splitlines() if x.strip()]
    out = []
    for r in rows:  # "Add 1234 and 5678."
        a, b = (int(w.strip(".")) for w in r["question"].split()[1::2][:2])
        out.append((f"{len(str(a))} digits", "carry out" if len(str(a + b)) > len(str(a)) else "no carry out"))
    return out


def main() -> None:
    table: dict[str, dict[str, list[float]]] = {}
    for d in DIRS:
        root = Path(d)
        cls = classes(root)
        files = sorted((root / "evals").glob("*.json"))
        if (root / "results/teacher.json").exists():
            files.append(root / "results/teacher.json")
        for f in files:
            bits = json.loads(f.read_text())["correct"]["gsm8k"]
            arm = f.stem if f.stem in ("sft", "teacher") else f.stem.rpartition("-s")[0]
            for k in sorted({c for pair in cls for c in pair}):
                got = [b == "1" for b, pair in zip(bits, cls, strict=True) if k in pair]
                table.setdefault(arm, {}).setdefault(k, []).append(sum(got) / len(got))
    ns = sorted({k for by in table.values() for k in by})
    share = {k: sum(k in pair for pair in classes(Path("."))) for k in ns}
    out = ["# Held-out accuracy by problem class (mean over the warm starts; min-max in brackets)", ""]
    out += ["| arm | " + " | ".join(f"{k} ({share[k]})" for k in ns) + " |", "|---|" + "---|" * len(ns)]
    for arm, by in table.items():
        cells = [f"{sum(v) / len(v):.3f} [{min(v):.3f}, {max(v):.3f}]" for v in (by.get(n, [float("nan")]) for n in ns)]
        out.append(f"| {arm} | " + " | ".join(cells) + " |")
    Path("results").mkdir(exist_ok=True)
    Path("results/by_length.md").write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
