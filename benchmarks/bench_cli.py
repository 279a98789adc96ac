"""How long a command that reads a config takes to answer before it trains anything (issue 41, friction 10).

Wall time of the real console script, median of ``n`` runs, for what a user meets first:

* ``train -c bad.yaml`` (a config error), ``sft -c bad.yaml``, ``eval -c bad.yaml``;
* ``train --print-config``;
* ``eval --checkpoint <missing dir>``;

against ``composer-plugins --help`` in the same run (the floor: Python, click and the plugin manager).
Each is measured twice: with the third-party plugins installed in this environment loaded (what a user's
``pip install`` gives; an example plugin that imports torch at module top costs its import here) and with
``COMPOSER_PLUGINS_LOAD=''`` (built-ins only: the project's own cost). Target: every answer in <= 2 s.

Run: ``python -m benchmarks.bench_cli [--quick]``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CLI = str(Path(sys.executable).parent / "composer-plugins")
TARGET_S = 2.0


def _time(args: list[str], env: dict[str, str], n: int, cwd: str) -> tuple[float, int]:
    times, rc = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        r = subprocess.run([CLI, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
        times.append(time.perf_counter() - t0)
        rc = r.returncode
    return statistics.median(times), rc


def run(quick: bool = False) -> dict[str, Any]:
    n = 3 if quick else 7
    with tempfile.TemporaryDirectory() as d:
        bad = Path(d) / "bad.yaml"
        bad.write_text("seed: 1\nrollout:\n  temperature: warm\n")
        cases = {
            "help": ["--help"],
            "train_config_error": ["train", "-c", str(bad)],
            "sft_config_error": ["sft", "-c", str(bad)],
            "eval_config_error": ["eval", "-c", str(bad)],
            "train_print_config": ["train", "--print-config"],
            "eval_missing_checkpoint": ["eval", "--checkpoint", str(Path(d) / "missing" / "model")],
        }
        results: dict[str, Any] = {}
        for label, extra in (("installed_plugins", {}), ("builtins_only", {"COMPOSER_PLUGINS_LOAD": ""})):
            env = {**os.environ, "COMPOSER_MLFLOW": "0", **extra}
            for name, args in cases.items():
                s, rc = _time(args, env, n, d)
                results[f"{label}/{name}_s"] = s
                results[f"{label}/{name}_rc"] = rc
    ratios: dict[str, float] = {}
    targets: dict[str, str] = {}
    for label in ("installed_plugins", "builtins_only"):
        floor = results[f"{label}/help_s"]
        for name in cases:
            if name == "help":
                continue
            ratios[f"{label}/{name}_s"] = results[f"{label}/{name}_s"]
            targets[f"{label}/{name}_s"] = f"<= {TARGET_S} (seconds, median of {n})"
            ratios[f"{label}/{name}_vs_help"] = results[f"{label}/{name}_s"] / max(floor, 1e-9)
    return {"name": "cli", "results": results, "ratios": ratios, "targets": targets}


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
