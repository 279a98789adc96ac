"""Run every ``benchmarks/bench_*.py`` and write one JSON report and a short markdown table of ratios.

Usage::

    python -m benchmarks.run_all [--quick] [--out results/benchmarks] [--only losses,diloco] [--timeout 900]

Each benchmark runs in its own subprocess (so memory peaks, thread settings and crashes of
one do not leak into another) and must expose ``run(quick: bool = False) -> dict`` returning
``{"name", "results", "ratios", "targets"}``. A benchmark that fails or times out is
reported with its error; the others still run, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
PREFIX = "bench_"

_CHILD = r"""
import json, sys, time
mod_name, quick, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
import importlib
mod = importlib.import_module(mod_name)
t0 = time.perf_counter()
res = mod.run(quick=quick)
res = dict(res)
res.setdefault("wall_s", time.perf_counter() - t0)
with open(out, "w") as f:
    json.dump(res, f, default=str)
"""


def discover(bench_dir: Path = BENCH_DIR) -> list[str]:
    """Module names (``benchmarks.bench_x``) of every ``bench_*.py`` file, sorted."""
    return sorted(f"{bench_dir.name}.{p.stem}" for p in bench_dir.glob(f"{PREFIX}*.py") if p.is_file())


def short_name(module: str) -> str:
    """``benchmarks.bench_losses`` -> ``losses``."""
    return module.rsplit(".", 1)[-1].removeprefix(PREFIX)


def _validate(module: str, res: Any) -> dict[str, Any]:
    if not isinstance(res, dict):
        raise TypeError(f"{module}.run() returned {type(res).__name__}, expected a dict")
    missing = [k for k in ("name", "results", "ratios", "targets") if k not in res]
    if missing:
        raise KeyError(f"{module}.run() result lacks key(s) {missing}; expected name, results, ratios, targets")
    return res


def run_one(module: str, quick: bool, timeout: float | None = None, in_process: bool = False) -> dict[str, Any]:
    """Run one benchmark module; returns its result dict plus ``module``, ``wall_s`` and ``ok``/``error``."""
    t0 = time.perf_counter()
    try:
        if in_process:
            mod = importlib.import_module(module)
            res = dict(mod.run(quick=quick))
        else:
            with tempfile.TemporaryDirectory() as td:
                out = Path(td) / "result.json"
                env = dict(os.environ)
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
                proc = subprocess.run(
                    [sys.executable, "-c", _CHILD, module, "1" if quick else "0", str(out)],
                    cwd=str(REPO_ROOT),
                    env=env,
                    timeout=timeout,
                    capture_output=True,
                    text=True,
                )
                if proc.stdout.strip():
                    print(proc.stdout.rstrip(), flush=True)
                if proc.returncode != 0 or not out.exists():
                    tail = "\n".join((proc.stderr or "").strip().splitlines()[-15:])
                    raise RuntimeError(f"exit code {proc.returncode}:\n{tail}")
                res = json.loads(out.read_text())
        res = _validate(module, res)
        res.setdefault("wall_s", time.perf_counter() - t0)
        res.update(module=module, ok=True)
        return res
    except subprocess.TimeoutExpired:
        err = f"timed out after {timeout:.0f}s"
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    return {
        "name": short_name(module),
        "module": module,
        "ok": False,
        "error": err,
        "results": {},
        "ratios": {},
        "targets": {},
        "wall_s": time.perf_counter() - t0,
    }


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def markdown(report: dict[str, Any]) -> str:
    """A short markdown table: one row per ratio of every benchmark, with its target."""
    lines = [
        f"# Benchmarks ({'quick' if report['quick'] else 'full'} run, {report['created']})",
        "",
        f"Machine: {report['machine']['cpu_count']} CPUs, {report['machine']['platform']}, "
        f"python {report['machine']['python']}, torch {report['machine'].get('torch', '?')}, "
        f"commit {report['machine'].get('git_commit', '?')[:12]}. Ratios are measured against a baseline "
        "in the same run.",
        "",
        "| benchmark | ratio | value | target | wall s |",
        "|---|---|---|---|---|",
    ]
    for b in report["benchmarks"]:
        if not b.get("ok"):
            err = str(b.get("error", "")).splitlines()[0][:100].replace("|", "\\|")
            lines.append(f"| {b['name']} | FAILED | {err} | | {b['wall_s']:.1f} |")
            continue
        ratios = b.get("ratios") or {}
        targets = b.get("targets") or {}
        if not ratios:
            lines.append(f"| {b['name']} | (none) | | | {b['wall_s']:.1f} |")
        for i, (k, v) in enumerate(ratios.items()):
            tgt = str(targets.get(k, "")).replace("|", "\\|")
            wall = f"{b['wall_s']:.1f}" if i == 0 else ""
            lines.append(f"| {b['name']} | {k} | {_fmt(v)} | {tgt} | {wall} |")
    return "\n".join(lines) + "\n"


def machine_info() -> dict[str, Any]:
    """CPU count, platform, python/torch versions and the git commit (for the report header)."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        pass
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = "unknown"
    return info


def run_all(
    quick: bool = False,
    only: Sequence[str] = (),
    exclude: Sequence[str] = (),
    timeout: float | None = None,
    in_process: bool = False,
    modules: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run the discovered benchmarks (filtered by ``only``/``exclude`` short names) and return the report."""
    mods = list(modules) if modules is not None else discover()
    if only:
        unknown = sorted(set(only) - {short_name(m) for m in mods})
        if unknown:
            raise SystemExit(
                f"unknown benchmark(s) {unknown}; available: {', '.join(short_name(m) for m in mods) or '(none)'}"
            )
        mods = [m for m in mods if short_name(m) in only]
    mods = [m for m in mods if short_name(m) not in set(exclude)]
    t0 = time.perf_counter()
    results = []
    for i, m in enumerate(mods, 1):
        print(f"[{i}/{len(mods)}] {m} ({'quick' if quick else 'full'}) ...", flush=True)
        r = run_one(m, quick, timeout=timeout, in_process=in_process)
        status = "ok" if r["ok"] else "FAILED: " + str(r["error"]).splitlines()[0]
        print(f"[{i}/{len(mods)}] {m}: {status} in {r['wall_s']:.1f}s", flush=True)
        results.append(r)
    return {
        "created": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "quick": quick,
        "machine": machine_info(),
        "wall_s": time.perf_counter() - t0,
        "benchmarks": results,
        "ratios": {f"{r['name']}/{k}": v for r in results if r.get("ok") for k, v in (r.get("ratios") or {}).items()},
    }


def write_report(report: dict[str, Any], out: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``<out>.json`` and ``<out>.md``; returns both paths."""
    base = Path(out)
    if base.suffix in (".json", ".md"):
        base = base.with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    jpath, mpath = base.with_suffix(".json"), base.with_suffix(".md")
    jpath.write_text(json.dumps(report, indent=2, default=str) + "\n")
    mpath.write_text(markdown(report))
    return jpath, mpath


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns 0 when every benchmark succeeded."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (each benchmark's quick mode)")
    ap.add_argument("--out", default="results/benchmarks", help="output path without suffix (.json and .md written)")
    ap.add_argument("--only", default="", help="comma-separated short names (e.g. losses,diloco)")
    ap.add_argument("--exclude", default="", help="comma-separated short names to skip")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per benchmark (default: none)")
    ap.add_argument("--in-process", action="store_true", help="import and run in this process (no isolation)")
    ap.add_argument("--list", action="store_true", help="list discovered benchmarks and exit")
    args = ap.parse_args(argv)
    if args.list:
        for m in discover():
            print(short_name(m))
        return 0
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    report = run_all(args.quick, split(args.only), split(args.exclude), args.timeout, args.in_process)
    jpath, mpath = write_report(report, args.out)
    print()
    print(mpath.read_text())
    print(f"wrote {jpath} and {mpath} ({report['wall_s']:.1f}s)")
    return 0 if all(b["ok"] for b in report["benchmarks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
