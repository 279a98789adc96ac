"""Tabulate the pilot: every setting's arms per seed against the pass bar (run from studies/pilot/).

    python summary.py            # prints results.md's table and writes results.json, results.md

Pass (issue 39): teacher_only - rl_only >= +0.05 and rl_only - SFT >= +0.05 on final held-out accuracy (mean over
the pilot seeds, on the pilot's own problems). The SFT start and the teacher are evaluated once (evals/sft.json,
evals/teacher.json: the teacher's held-out accuracy, measured before any arm used it). A setting that starts from
another student (settings/<name>/student.txt, e.g. ``sft300``: ``STUDENT=sft300 bash run_pilot.sh setting ...``)
is compared with that student's own evaluation, evals/<student>.json.
"""

from __future__ import annotations

import json
from pathlib import Path

BAR = 0.05
METRIC = "gsm8k/accuracy"


def _acc(path: Path, key: str = METRIC) -> float | None:
    if not path.exists():
        return None
    return json.loads(path.read_text())["metrics"].get(key)


def main() -> None:
    sft, teacher = _acc(Path("evals/sft.json")), _acc(Path("evals/teacher.json"))
    out: dict = {"sft": sft, "teacher": teacher, "bar": BAR, "settings": {}}
    for d in sorted(Path("settings").iterdir()):
        student = (d / "student.txt").read_text().strip() if (d / "student.txt").exists() else "sft"
        start = _acc(Path(f"evals/{student}.json"))
        arms: dict[str, dict[int, float]] = {}
        unseen: dict[str, dict[int, float]] = {}
        for f in sorted((d / "evals").glob("*.json")):
            arm, _, seed = f.stem.rpartition("-s")
            if not seed.isdigit():
                continue  # evals/sft.json (the report stage's SFT row)
            arms.setdefault(arm, {})[int(seed)] = _acc(f)
            unseen.setdefault(arm, {})[int(seed)] = _acc(f, "gsm8k/accuracy_unseen_line")
        mean = {a: sum(v.values()) / len(v) for a, v in arms.items()}
        row = {
            "overrides": (d / "overrides.txt").read_text().split(),
            "per_seed": arms,
            "mean": mean,
            "per_seed_unseen_line": unseen,
            "student": student,
            "sft": start,
        }
        rl, to = arms.get("rl_only", {}), arms.get("teacher_only", {})
        shared = sorted(set(rl) & set(to))
        if shared:
            row["teacher_only_minus_rl_only"] = sum(to[s] - rl[s] for s in shared) / len(shared)
        if rl and start is not None:
            row["rl_only_minus_sft"] = mean["rl_only"] - start
        if "teacher_only_minus_rl_only" in row and "rl_only_minus_sft" in row:
            row["pass"] = row["teacher_only_minus_rl_only"] >= BAR and row["rl_only_minus_sft"] >= BAR
            if len(shared) < 2:  # a one-seed probe is not a verdict: "probe pass/fail"
                row["pass"] = f"probe {'pass' if row['pass'] else 'fail'}"
        out["settings"][d.name] = row
    Path("results.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    f3 = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    s3 = lambda x: "—" if x is None else f"{x:+.3f}"  # noqa: E731
    starts = sorted({(r["student"], r["sft"]) for r in out["settings"].values()} | {("sft", sft)})
    lines = [
        f"SFT start {f3(sft)}, teacher {f3(teacher)} (pilot problems, greedy)"
        + "".join(f"; student `{n}` {f3(a)}" for n, a in starts if n != "sft"),
        "",
        "| setting | student (SFT) | overrides | seeds | rl_only | teacher_only | grpo_teacher "
        "| teacher_only − rl_only | rl_only − SFT | pass |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in out["settings"].items():
        cells = []
        for a in ("rl_only", "teacher_only", "grpo_teacher"):
            ps = r["per_seed"].get(a, {})
            cells.append(f"{f3(r['mean'].get(a))} ({', '.join(f3(ps[s]) for s in sorted(ps))})" if ps else "—")
        ovr = " ".join(r["overrides"]) or "(study settings)"
        seeds = sorted({s for ps in r["per_seed"].values() for s in ps})
        lines.append(
            f"| {name} | {r['student']} ({f3(r['sft'])}) | `{ovr}` | {', '.join(map(str, seeds))} | "
            + " | ".join(cells)
            + f" | {s3(r.get('teacher_only_minus_rl_only'))} | {s3(r.get('rl_only_minus_sft'))} | "
            + f"{r.get('pass', '—')} |"
        )
    text = "\n".join(lines) + "\n"
    Path("results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
