"""Greedy accuracy of pilot evals by operand length (pilot round 3, ../README.md): python bylen.py EVAL.json ..."""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(paths: list[str]) -> None:
    with open("data/tasks/gsm8k/test.jsonl") as f:
        lengths = [len(json.loads(line)["question"].split()[1]) for line in f][:200]
    for path in paths:
        with open(path) as f:
            correct = json.load(f)["correct"]["gsm8k"]
        by: dict[int, list[int]] = defaultdict(list)
        for n, c in zip(lengths, correct, strict=False):
            by[n].append(int(c))
        cells = "  ".join(f"{n} digits {sum(v) / len(v):.3f} (n={len(v)})" for n, v in sorted(by.items()))
        print(f"{path}: all {correct.count('1') / len(correct):.3f}  {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
