"""Run every ``benchmarks/bench_*.py`` and write one JSON report and a short markdown table of ratios.

Usage::

    python -m benchmarks.run_all [--quick] [--out results/benchmarks] [--only losses,diloco] [--timeout 900]

Each benchmark runs in its own subprocess (so memory peaks, thread settings and crashes of
one do not leak into another) and must expose ``run(quick: bool = False) -> dict`` returning
``{"name", "results", "ratios", "targets"}``. A benchmark that fails or times out is
reported with its error; the others still run, and the exit code is 1.

No benchmark can hang the run: each has a timeout (default :data:`DEFAULT_TIMEOUT_S`, by mode;
``--timeout`` overrides, ``0`` turns it off). A benchmark runs as its own session that dies with this
process (``PR_SET_PDEATHSIG``) and carries a tag in its environment that its own children inherit.
On timeout its Python stacks are dumped (``SIGUSR1`` + ``faulthandler``), the report says what it was
waiting for and which processes were still running, and the whole tree is SIGKILLed: its process
group, its descendants and anything else carrying the tag (children in sessions of their own). Processes
a finished benchmark left behind are killed and reported too. Each benchmark's stdout and stderr are
kept in ``<out>.logs/<name>.{stdout,stderr}.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer_plugins import procs

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
PREFIX = "bench_"

#: Seconds each benchmark may run, by mode, unless ``--timeout`` says otherwise. Quick benchmarks take
#: well under a minute each on a 2-core laptop (``bench_scale --quick`` about 4 minutes); full runs longer.
DEFAULT_TIMEOUT_S = {"quick": 900.0, "full": 3600.0}

_CHILD = r"""
import faulthandler, json, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_all asks for the stacks before a timeout kill
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


def default_timeout(quick: bool) -> float:
    """The per-benchmark timeout when none is given: :data:`DEFAULT_TIMEOUT_S` for the mode."""
    return DEFAULT_TIMEOUT_S["quick" if quick else "full"]


def run_one(
    module: str,
    quick: bool,
    timeout: float | None = None,
    in_process: bool = False,
    log_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run one benchmark module; returns its result dict plus ``module``, ``wall_s`` and ``ok``/``error``.

    ``timeout``: seconds (``None``: :func:`default_timeout`; ``0`` or less: none; not enforced
    ``in_process``). ``log_dir``: keep the benchmark's stdout and stderr there (else a temporary
    directory, removed afterwards).
    """
    t0 = time.perf_counter()
    if timeout is None:
        timeout, source = default_timeout(quick), f"the default for {'--quick' if quick else 'full'} runs"
    else:
        source = "--timeout"
    try:
        if in_process:
            mod = importlib.import_module(module)
            res = dict(mod.run(quick=quick))
        else:
            with tempfile.TemporaryDirectory() as td:
                logs = Path(log_dir) if log_dir is not None else Path(td)
                res = _run_child(module, quick, timeout if timeout > 0 else None, source, Path(td), logs)
        res = _validate(module, res)
        res.setdefault("wall_s", time.perf_counter() - t0)
        res.update(module=module, ok=True)
        return res
    except Exception as e:
        err = str(e) if isinstance(e, BenchmarkTimeout) else f"{type(e).__name__}: {e}"
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


class BenchmarkTimeout(RuntimeError):
    """A benchmark ran past its timeout (the message says what it was waiting for)."""


def _say(msg: str) -> None:
    print(f"[run_all] {msg}", flush=True)


def _run_child(module: str, quick: bool, timeout: float | None, source: str, td: Path, logs: Path) -> dict[str, Any]:
    name = short_name(module)
    logs.mkdir(parents=True, exist_ok=True)
    out, status = td / "result.json", td / "waiting_for.txt"
    out_log, err_log = logs / f"{name}.stdout.log", logs / f"{name}.stderr.log"
    tag = procs.new_tag(f"bench-{name}")
    env = procs.tag_env(tag)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env[procs.WAIT_STATUS_ENV] = str(status)
    with open(out_log, "wb") as fo, open(err_log, "wb") as fe:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, module, "1" if quick else "0", str(out)],
            cwd=str(REPO_ROOT),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=fo,
            stderr=fe,
            start_new_session=True,  # its own process group: killed as one, and no terminal signals
            preexec_fn=procs.die_with_parent(signal.SIGKILL),
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise BenchmarkTimeout(_timed_out(name, proc, timeout or 0.0, source, tag, status, err_log))
            time.sleep(0.1)
    finally:  # also on Ctrl-C: nothing of the benchmark outlives this call
        leftover = _leftovers(tag) if proc.returncode is not None else []
        procs.kill_tree(proc.pid if proc.returncode is None else None, tag=tag)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
    if leftover and proc.returncode is not None:
        _say(f"{name} left {len(leftover)} process(es) behind; killed them:\n  " + "\n  ".join(leftover))
    stdout = out_log.read_text(errors="replace")
    if stdout.strip():
        print(stdout.rstrip(), flush=True)
    if proc.returncode != 0 or not out.exists():
        tail = procs.tail(err_log, 40, max_chars=8000)
        raise RuntimeError(f"{procs.exit_description(proc.returncode)} (stderr: {err_log}):\n{tail}")
    return json.loads(out.read_text())


def _leftovers(tag: str, grace_s: float = 1.0) -> list[str]:
    """Processes of a finished benchmark still alive after ``grace_s`` (children dying with it get that long)."""
    deadline = time.monotonic() + grace_s
    while True:
        pids = procs.tagged_pids(tag)
        if not pids or time.monotonic() > deadline:
            return procs.describe(pids)
        time.sleep(0.1)


_THREAD_RE = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*most recent call first")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def main_thread_frames(stderr_text: str, n: int = 4) -> str:
    """From a ``faulthandler`` dump, the innermost ``n`` frames of the thread running the benchmark."""
    blocks: list[tuple[str, list[tuple[str, str, str]]]] = []
    for line in stderr_text.splitlines():
        if _THREAD_RE.match(line):
            blocks.append((line, []))
        elif blocks and (m := _FRAME_RE.match(line)):
            blocks[-1][1].append(m.groups())
    if not blocks:
        return ""
    # the last dump only: it starts at the last "Current thread" block or a "Thread" block right before
    main = next((frames for _, frames in reversed(blocks) if any(f[0] == "<string>" for f in frames)), None)
    if main is None:
        main = next((frames for head, frames in reversed(blocks) if head.startswith("Current")), blocks[-1][1])
    out = []
    for file, line, func in main[:n]:
        with contextlib.suppress(ValueError):
            file = str(Path(file).relative_to(REPO_ROOT))
        out.append(f"{file}:{line} in {func}")
    return " <- ".join(out)


def _timed_out(
    name: str, proc: subprocess.Popen[bytes], timeout: float, source: str, tag: str, status: Path, err_log: Path
) -> str:
    """Find out what the benchmark was waiting for, report it, and kill its whole tree."""
    size = err_log.stat().st_size if err_log.exists() else 0
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGUSR1)  # faulthandler: every thread's Python stack to its stderr
    for _ in range(20):
        time.sleep(0.1)
        if err_log.exists() and err_log.stat().st_size > size:
            time.sleep(0.2)  # let the dump finish
            break
    waiting = status.read_text().strip() if status.exists() else ""
    with open(err_log, "rb") as f:
        f.seek(size)
        frames = main_thread_frames(f.read().decode(errors="replace"))
    live = procs.describe([proc.pid, *procs.descendants(proc.pid), *procs.tagged_pids(tag)])
    killed = procs.kill_tree(proc.pid, tag=tag)
    _say(f"{name} TIMED OUT after {timeout:.0f}s ({source}); killed its process group and {len(killed)} process(es)")
    msg = f"timed out after {timeout:.0f}s ({source})"
    if waiting:
        msg += f"; waiting for {waiting}"
    details = []
    if frames:
        details.append(f"in: {frames}")
    if live:
        details.append("processes still running then:\n  " + "\n  ".join(live))
    details.append(f"full stderr (with every thread's stack): {err_log}")
    return msg + "\n" + "\n".join(details)


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
    log_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run the discovered benchmarks (filtered by ``only``/``exclude`` short names) and return the report.

    ``timeout``: seconds per benchmark; ``None``: :func:`default_timeout` for the mode; ``0``: none.
    """
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
        r = run_one(m, quick, timeout=timeout, in_process=in_process, log_dir=log_dir)
        status = "ok" if r["ok"] else "FAILED: " + str(r["error"]).splitlines()[0]
        print(f"[{i}/{len(mods)}] {m}: {status} in {r['wall_s']:.1f}s", flush=True)
        if not r["ok"] and len(str(r["error"]).splitlines()) > 1:
            print("    " + "\n    ".join(str(r["error"]).splitlines()[1:]), flush=True)
        results.append(r)
    return {
        "created": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "quick": quick,
        "timeout_s": (default_timeout(quick) if timeout is None else timeout) if not in_process else None,
        "machine": machine_info(),
        "wall_s": time.perf_counter() - t0,
        "benchmarks": results,
        "ratios": {f"{r['name']}/{k}": v for r in results if r.get("ok") for k, v in (r.get("ratios") or {}).items()},
    }


def _base(out: str | os.PathLike[str]) -> Path:
    base = Path(out)
    return base.with_suffix("") if base.suffix in (".json", ".md") else base


def write_report(report: dict[str, Any], out: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``<out>.json`` and ``<out>.md``; returns both paths."""
    base = _base(out)
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
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"seconds per benchmark; 0 = none (default: {DEFAULT_TIMEOUT_S['quick']:.0f} with --quick, "
        f"{DEFAULT_TIMEOUT_S['full']:.0f} without)",
    )
    ap.add_argument("--in-process", action="store_true", help="import and run in this process (no isolation)")
    ap.add_argument("--list", action="store_true", help="list discovered benchmarks and exit")
    args = ap.parse_args(argv)
    if args.list:
        for m in discover():
            print(short_name(m))
        return 0
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    log_dir = Path(f"{_base(args.out)}.logs")
    report = run_all(args.quick, split(args.only), split(args.exclude), args.timeout, args.in_process, log_dir=log_dir)
    jpath, mpath = write_report(report, args.out)
    print()
    print(mpath.read_text())
    print(f"wrote {jpath} and {mpath} ({report['wall_s']:.1f}s); each benchmark's output is in {log_dir}/")
    return 0 if all(b["ok"] for b in report["benchmarks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
