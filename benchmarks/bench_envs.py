"""Cost of the sandbox and of scoring, against unprotected baselines measured in the same run.

* ``sandbox``: a trivial Python program run ``n`` times in the sandbox (the isolation this
  machine supports) vs a plain ``subprocess.run([python, "-c", ...])``.
* ``code``: HumanEval canonical solutions scored by the ``code`` env (sandboxed, per-test
  reporting) vs each program + ``check(entry_point)`` in a plain subprocess, the way an
  unsandboxed evaluator runs them. The pass rate of the canonical solutions must be 1.0.
* ``gsm8k``: answer extraction accuracy on messy model outputs vs the common "last number"
  baseline, and rewards per second.
* ``feature_deletion``: time to build verified tasks from the fixture repo and to score a
  golden completion.

Run: ``python -m benchmarks.bench_envs [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from typing import Any

TARGETS = {
    "sandbox_overhead_ratio": "<= 4 (sandboxed / plain subprocess wall time per run)",
    "code_overhead_ratio": "<= 4 (sandboxed code env / plain subprocess per HumanEval task)",
    "gsm8k_extraction_accuracy_ratio": ">= 1.5 (ours / last-number baseline on messy outputs)",
    "code_canonical_pass_rate": "== 1.0",
}

MESSY = [
    ("The answer is 18.", "18"),
    ("Therefore the answer is: **18**", "18"),
    ("$$\\boxed{18}$$ (that took 3 steps)", "18"),
    ("Final answer: \\boxed{\\$1{,}234.50}", "1234.5"),
    ("The total is \\boxed{\\frac{3}{4}} of the cake.", "0.75"),
    ("Answer: 1,000,000 grains", "1000000"),
    ("It is −5 degrees outside.", "-5"),
    ("The answer is 3/4 of a cup", "0.75"),
    ("#### 72\n\nQuestion: Tom has 2 apples.\nAnswer: 2 + 3 = 5\n#### 5", "72"),
    ("So she pays $18.00 in total.", "18"),
    ("The answer is 42, which took 3 steps", "42"),
    ("I'm not sure, but I think eighteen.", "18"),
]


def _last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d+(?:\.\d+)?", text)
    return nums[-1] if nums else None


def bench_sandbox(n: int) -> dict[str, Any]:
    from composer_plugins.envs.sandbox import Sandbox, SandboxLimits, isolation_info

    sb = Sandbox(SandboxLimits(wall_time_s=20))
    code = "print(sum(range(1000)))"
    sb.run_code(code)  # warm-up
    t0 = time.perf_counter()
    for _ in range(n):
        assert sb.run_code(code).stdout.strip() == "499500"
    sandboxed = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    plain = (time.perf_counter() - t0) / n
    return {"isolation": isolation_info().mode, "sandboxed_s": sandboxed, "plain_s": plain}


def bench_code(n_tasks: int) -> dict[str, Any]:
    from composer_plugins.envs.code_env import CodeEnv

    env = CodeEnv(source="humaneval", per_test_timeout_s=10, timeout_s=60, num_workers=1)
    tasks = env.tasks("test")[:n_tasks]
    t0 = time.perf_counter()
    fbs = [env.score(t["canonical_solution"], t) for t in tasks]
    sandboxed = (time.perf_counter() - t0) / len(tasks)
    t0 = time.perf_counter()
    for t in tasks:
        program = t["prompt"] + t["canonical_solution"] + "\n" + t["test"] + f"\ncheck({t['entry_point']})\n"
        subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=60)
    plain = (time.perf_counter() - t0) / len(tasks)
    return {
        "tasks": len(tasks),
        "pass_rate": sum(f.reward == 1.0 for f in fbs) / len(fbs),
        "tests_counted": sum(int(f.details.get("total", 0)) for f in fbs),
        "sandboxed_s_per_task": sandboxed,
        "plain_s_per_task": plain,
    }


def bench_gsm8k(n: int) -> dict[str, Any]:
    from composer_plugins.envs.answers import extract_answer
    from composer_plugins.envs.gsm8k import GSM8KEnv

    ours = sum(extract_answer(t) == a for t, a in MESSY) / len(MESSY)
    base = sum((_last_number(t) or "").rstrip("0").rstrip(".") == a for t, a in MESSY) / len(MESSY)
    env = GSM8KEnv(difficulty=3)
    tasks = env.sample_tasks(n, seed=0)
    completions = [t["target"] if i % 2 else "#### -1" for i, t in enumerate(tasks)]
    t0 = time.perf_counter()
    rewards = env.reward([t["prompt"] for t in tasks], completions, answer=[t["answer"] for t in tasks])
    per_s = n / (time.perf_counter() - t0)
    assert rewards == [float(i % 2) for i in range(n)]
    return {"extraction_accuracy": ours, "last_number_accuracy": base, "rewards_per_s": per_s}


def bench_feature_deletion(symbols: list[str] | None) -> dict[str, Any]:
    from composer_plugins.envs.feature_deletion import FeatureDeletionEnv

    env = FeatureDeletionEnv(symbols=symbols, progress=False)
    t0 = time.perf_counter()
    tasks = env.build_tasks()
    build_s = time.perf_counter() - t0
    t = tasks[0]
    t0 = time.perf_counter()
    fb = env.score("```python\n" + t["original_source"] + "\n```", t)
    return {"tasks_built": len(tasks), "build_s": build_s, "score_s": time.perf_counter() - t0, "golden": fb.reward}


def run(quick: bool = False) -> dict[str, Any]:
    """Run every part; ``quick`` uses fewer repetitions and tasks."""
    sandbox = bench_sandbox(5 if quick else 20)
    code = bench_code(10 if quick else 164)
    gsm = bench_gsm8k(500 if quick else 5000)
    fd = bench_feature_deletion(["to_roman", "wrap"] if quick else None)
    results = {"sandbox": sandbox, "code": code, "gsm8k": gsm, "feature_deletion": fd}
    ratios = {
        "sandbox_overhead_ratio": sandbox["sandboxed_s"] / sandbox["plain_s"],
        "code_overhead_ratio": code["sandboxed_s_per_task"] / code["plain_s_per_task"],
        "gsm8k_extraction_accuracy_ratio": gsm["extraction_accuracy"] / max(gsm["last_number_accuracy"], 1e-9),
        "code_canonical_pass_rate": code["pass_rate"],
    }
    return {"name": "envs", "results": results, "ratios": ratios, "targets": TARGETS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = ap.parse_args()
    res = run(quick=args.quick)
    if args.json:
        print(json.dumps(res, indent=2))
    r = res["results"]
    print(f"isolation: {r['sandbox']['isolation']}")
    rows = [
        ("sandbox run (s)", r["sandbox"]["sandboxed_s"], r["sandbox"]["plain_s"]),
        ("HumanEval task (s)", r["code"]["sandboxed_s_per_task"], r["code"]["plain_s_per_task"]),
        ("messy-answer accuracy", r["gsm8k"]["extraction_accuracy"], r["gsm8k"]["last_number_accuracy"]),
    ]
    print(f"{'metric':<24}{'ours':>10}{'baseline':>10}")
    for name, ours, base in rows:
        print(f"{name:<24}{ours:>10.3f}{base:>10.3f}")
    print(
        f"gsm8k rewards/s: {r['gsm8k']['rewards_per_s']:.0f}; HumanEval canonical pass rate: {r['code']['pass_rate']}"
    )
    fd = r["feature_deletion"]
    print(f"feature_deletion: {fd['tasks_built']} tasks in {fd['build_s']:.1f}s, golden scored {fd['golden']}")
    for k, v in res["ratios"].items():
        print(f"{k:<34}{v:>8.3f}  target {res['targets'][k]}")


if __name__ == "__main__":
    main()
