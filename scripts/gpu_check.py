"""The Python half of ``scripts/gpu_check.sh``: resolve a step's imports, install the missing wheels, write the report.

Runs under the GPU machine's own Python (3.12, torch with CUDA preinstalled) with the repository on
``PYTHONPATH``; needs nothing but the standard library at start (torch is imported only to name the device).

* ``imports STEP... [--wheels DIR]``: import every module each STEP needs; each is ``ok`` (importable), ``wheel``
  (missing here, but a wheel in DIR provides it: the setup step installs it) or ``MISSING``. Exit 1 on MISSING.
* ``install --wheels DIR --target DIR``: ``pip install --no-deps --no-index`` of each wheel in DIR whose
  distribution is not installed (``--prefer-wheels``: also those installed at another version), into the
  target folder that ``gpu_check.sh`` puts on ``PYTHONPATH``. torch and the rest of the machine stay as they are.
* ``repack DIR [--min-mib N]``: recompress every wheel in DIR over N MiB with LZMA (zip method 14, which
  pip's installer reads; the files and their RECORD hashes stay the same), so the wheels fit the 64 MiB
  that travel to the GPU machine (``scripts/gpu_wheels.sh`` runs it).
* ``report OUT``: ``OUT/gpu.json`` and ``OUT/gpu.md`` from what the steps left in ``OUT/gpu.d/`` (``steps.jsonl``,
  the tier's JUnit XML, the benchmarks' JSON): whatever steps ran, failed or timed out.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

#: What each step imports (its command's modules and the libraries they reach on that path).
STEP_IMPORTS: dict[str, list[str]] = {
    "setup": ["pip"],
    "tier": [
        "pytest",
        "pytest_timeout",
        "torch",
        "transformers",
        "lightning",
        "pluggy",
        "yaml",
        "click",
        "composer_plugins.testing",
        "composer_plugins.procs",
        "composer_plugins.kernels.chunked",
        "composer_plugins.losses.distill",
        "composer_plugins.training.lightning.module",
        "composer_plugins.training.runs.run",
        "composer_plugins.diloco.objstore",
        "composer_plugins.training.rollout.rollouts",
        "obstore",
        "liger_kernel.chunked_loss",
        "trl",
        "datasets",
        "composer_plugins_trl.backend",
        "benchmarks.bench_scale",
        "benchmarks.bench_training",
    ],
    "kernels": ["torch", "benchmarks.bench_losses", "composer_plugins.losses.distill", "liger_kernel.chunked_loss"],
    "scale-0.5b": [
        "torch",
        "benchmarks.bench_scale",
        "benchmarks.bench_training",
        "composer_plugins.training.lightning.module",
        "lightning",
        "trl",
        "datasets",
    ],
    "scale-1.5b": [
        "torch",
        "benchmarks.bench_scale",
        "benchmarks.bench_training",
        "composer_plugins.training.lightning.module",
        "lightning",
        "trl",
        "datasets",
    ],
    "fair": [
        "torch",
        "benchmarks.bench_gpu",
        "benchmarks.bench_scale",
        "benchmarks.bench_training",
        "composer_plugins.training.lightning.module",
        "composer_plugins.teachers.scoring",
        "lightning",
        "trl",
        "datasets",
    ],
    "report": ["json", "xml.etree.ElementTree"],
}
#: Top-level module -> the distribution whose wheel provides it (for modules whose names differ).
MODULE_DISTS = {"liger_kernel": "liger-kernel", "pytest_timeout": "pytest-timeout", "yaml": "pyyaml"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_dists(wheels: Path) -> dict[str, tuple[str, Path]]:
    """Distribution (normalised) -> (version, file) of every wheel in ``wheels``."""
    out: dict[str, tuple[str, Path]] = {}
    for w in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        dist, version = w.name.split("-")[:2]
        out[_norm(dist)] = (version, w)
    return out


def cmd_imports(steps: list[str], wheels: Path) -> int:
    """Import each step's modules; print one line each; 1 if one is neither importable nor in a wheel."""
    unknown = [s for s in steps if s not in STEP_IMPORTS]
    if unknown:
        print(f"unknown step(s) {unknown}; available: {', '.join(STEP_IMPORTS)}", file=sys.stderr)
        return 2
    bad = 0
    for step in steps:
        print(f"  {step}:")
        bad += _resolve(STEP_IMPORTS[step], wheel_dists(wheels))
    return 1 if bad else 0


def _resolve(modules: list[str], have: dict[str, tuple[str, Path]]) -> int:
    bad = 0
    for mod in modules:
        try:
            importlib.import_module(mod)
            where = getattr(sys.modules[mod], "__file__", None) or "built-in"
            print(f"    import {mod}: ok ({where})")
        except ImportError as e:
            top = (getattr(e, "name", None) or mod).split(".")[0]
            dist = _norm(MODULE_DISTS.get(top, top))
            if dist in have:
                print(f"    import {mod}: wheel ({top} from {have[dist][1].name}, installed by the setup step)")
            else:
                bad += 1
                print(f"    import {mod}: MISSING ({type(e).__name__}: {e})")
        except Exception as e:  # a module that fails for another reason is a failure too
            bad += 1
            print(f"    import {mod}: MISSING ({type(e).__name__}: {e})")
    return bad


def cmd_install(wheels: Path, target: Path, prefer_wheels: bool, dry_run: bool) -> int:
    """Install the wheels whose distributions this Python lacks, with ``--no-deps`` into ``target``."""
    todo: list[Path] = []
    for dist, (version, path) in wheel_dists(wheels).items():
        try:
            have = md.version(dist)
        except md.PackageNotFoundError:
            have = None
        if have is None or (prefer_wheels and have != version):
            todo.append(path)
            print(f"    {dist} {version}: install" + (f" (present: {have})" if have else ""))
        else:
            note = "" if have == version else f" (wheel {version} not installed; GPU_CHECK_PREFER_WHEELS=1 would)"
            print(f"    {dist}: present {have}{note}")
    if not wheel_dists(wheels):
        print(f"    no wheels in {wheels} (fill it here with `bash scripts/gpu_wheels.sh`)")
    if not todo or dry_run:
        return 0
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--upgrade",
        "--target",
        str(target),
        "--disable-pip-version-check",
        "-q",
        *map(str, todo),
    ]
    print("    " + " ".join(cmd))
    return subprocess.run(cmd, check=False).returncode


def cmd_repack(wheels: Path, min_mib: float) -> int:
    """LZMA-recompress the wheels in ``wheels`` larger than ``min_mib`` MiB (idempotent)."""
    import zipfile

    for whl in sorted(wheels.glob("*.whl")):
        if whl.stat().st_size <= min_mib * 2**20:
            continue
        with zipfile.ZipFile(whl) as zi:
            if all(i.compress_type == zipfile.ZIP_LZMA for i in zi.infolist()):
                continue  # done on an earlier run
            tmp = whl.with_name(whl.name + ".tmp")
            with zipfile.ZipFile(tmp, "w") as zo:
                for info in zi.infolist():
                    out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                    out.external_attr = info.external_attr
                    out.compress_type = zipfile.ZIP_LZMA
                    zo.writestr(out, zi.read(info))
        before = whl.stat().st_size
        os.replace(tmp, whl)
        print(f"recompressed {whl.name}: {before / 2**20:.1f} -> {whl.stat().st_size / 2**20:.1f} MiB (LZMA)")
    return 0


# -- the report --------------------------------------------------------------------------------------
def _device() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("torch", "transformers", "lightning", "trl", "liger-kernel", "datasets", "obstore"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    try:
        import torch

        info["cuda"] = torch.version.cuda
        info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    except Exception as e:  # the report is written whatever is broken
        info["device"] = f"unknown ({type(e).__name__}: {e})"
    return info


def _junit(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"error": f"{path.name} not written"}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"{path.name}: {e}"}
    tests = []
    for case in root.iter("testcase"):
        outcome = "passed"
        message = ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:300]
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        tests.append({"test": name, "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message})
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"counts": counts, "tests": tests}


def _json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        return {"error": f"{path.name}: unreadable JSON ({e})"}


def build_report(out: Path) -> dict[str, Any]:
    """Everything the steps left in ``out/gpu.d``, as one dict."""
    d = out / "gpu.d"
    steps = []
    if (d / "steps.jsonl").exists():
        steps = [json.loads(line) for line in (d / "steps.jsonl").read_text().splitlines() if line.strip()]
    report: dict[str, Any] = {
        "name": "gpu_check",
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": _device(),
        "steps": steps,
        "tier": _junit(d / "tier.xml"),
        "kernels": _json(d / "kernels.json"),
        "scale": {k: _json(d / f"scale-{k}.json") for k in ("0.5b", "1.5b")},
        "fair": _json(d / "fair.json"),
    }
    git = d / "commit.txt"
    if git.exists():
        report["commit"] = git.read_text().strip()
    return report


def _fmt(v: Any, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, int | float) else "–"


def render_md(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        "# GPU check",
        "",
        f"Device: **{m.get('device')}** (CUDA {m.get('cuda')}), Python {m.get('python')}, torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}, lightning {m.get('lightning')}, trl {m.get('trl')}, "
        f"liger-kernel {m.get('liger-kernel')}; written {r['written']}"
        + (f", commit {r['commit']}" if "commit" in r else "")
        + ".",
        "",
        "## Steps",
        "",
        "| step | status | seconds | budget s |",
        "|---|---|---:|---:|",
    ]
    for s in r["steps"]:
        status = "ok" if s.get("rc") == 0 else ("TIMED OUT" if s.get("timed_out") else f"FAILED (exit {s.get('rc')})")
        lines.append(f"| {s.get('step')} | {status} | {_fmt(s.get('seconds'), '.0f')} | {s.get('budget_s')} |")
    t = r["tier"]
    lines += ["", "## gpu tier (`pytest tests/gpu -m gpu`)", ""]
    if "error" in t:
        lines.append(f"No result: {t['error']}.")
    else:
        lines.append(", ".join(f"{n} {k}" for k, n in sorted(t["counts"].items())) or "no test ran")
        lines += ["", "| test | outcome | s |", "|---|---|---:|"]
        for c in t["tests"]:
            msg = f" — {c['message']}" if c["outcome"] in ("failed", "error") and c["message"] else ""
            lines.append(f"| `{c['test']}` | {c['outcome']}{msg} | {c['seconds']:.1f} |")
    k = r["kernels"]
    lines += ["", "## Kernels against Liger (`benchmarks.bench_losses`)", ""]
    if not k:
        lines.append("No result (the step failed or did not run; see the steps table and gpu.d/kernels.log).")
    elif "error" in k:
        lines.append(k["error"])
    else:
        s = k.get("shape", {})
        lines += [
            f"Shape B={s.get('B')} T={s.get('T')} H={s.get('H')} V={s.get('V')}, chunk {k.get('chunk_size')}.",
            "",
            "| variant | peak MiB | time s | loss |",
            "|---|---:|---:|---:|",
        ]
        for name, v in k.get("results", {}).items():
            lines.append(
                f"| {name} | {_fmt(v.get('peak_mib'), '.1f')} | {_fmt(v.get('time_s'), '.4f')} | "
                f"{_fmt(v.get('loss'), '.6f')} |"
            )
        lines += ["", "| ratio | value | target |", "|---|---:|---|"]
        for name, v in k.get("ratios", {}).items():
            lines.append(f"| {name} | {_fmt(v)} | {k.get('targets', {}).get(name, '–')} |")
        for name, ok in k.get("checks", {}).items():
            lines.append(f"| {name} | {'ok' if ok else 'MISMATCH'} | same loss and gradients |")
    lines += render_fair(r.get("fair"))
    for shape, sc in r["scale"].items():
        if not sc:
            continue  # bench_scale is no longer a step of the check (the fair benchmark above replaces it)
        lines += [
            "",
            f"## Composed step vs TRL GRPOTrainer, Qwen2.5-{shape.upper()} shape (`benchmarks.bench_scale`)",
            "",
        ]
        if sc.get("partial"):
            lines.append("Partial: the step stopped before every configuration ran.")
        lines += ["| configuration | step s | tokens/s | peak CUDA GiB | note |", "|---|---:|---:|---:|---|"]
        for name, v in sc.get("results", {}).items():
            if not isinstance(v, dict):
                lines.append(f"| {name} | | | {_fmt(v, '.2f')} | fp32 logits of the batch |")
                continue
            note = v.get("error", "")[:160].replace("\n", " ").replace("|", "/")
            if v.get("hint_options"):
                note = (note + " " + json.dumps(v["hint_options"])).strip()
            lines.append(
                f"| {name} | {_fmt(v.get('step_s'), '.2f')} | {_fmt(v.get('tokens_per_s'), '.1f')} | "
                f"{_fmt(v.get('peak_cuda_gib'), '.2f')} | {note} |"
            )
        if sc.get("ratios"):
            lines += ["", "| ratio | value | target |", "|---|---:|---|"]
            for name, v in sc["ratios"].items():
                lines.append(f"| {name} | {_fmt(v)} | {sc.get('targets', {}).get(name, '–')} |")
    lines += ["", "Logs of every step: `gpu.d/<step>.log`; everything above as JSON: `gpu.json`.", ""]
    return "\n".join(lines)


#: The fair benchmark's phases, in its order (``benchmarks.bench_gpu.PHASES``; the report needs no torch).
FAIR_PHASES = ("generation", "experience", "forward", "teacher", "replay", "backward", "optimizer", "ema", "other")


def render_fair(f: dict[str, Any] | None) -> list[str]:
    """The fair benchmark's section: one row per configuration, the phase split, the profile of ``full``."""
    lines = ["", "## Fair benchmark: composed step vs TRL GRPOTrainer, steady state (`benchmarks.bench_gpu`)", ""]
    if not f:
        return [*lines, "No result (the step failed or did not run; see the steps table and gpu.d/fair.log)."]
    if "error" in f:
        return [*lines, f["error"]]
    sp = f.get("spec", {})
    lines.append(
        f"Shape {f.get('shape')} ({sp.get('model')}): {sp.get('prompts')} prompts x {sp.get('generations')} "
        f"generations x {sp.get('new_tokens')} new tokens on {sp.get('device')}; {f.get('warmup')} warm-up "
        f"step(s) dropped, {f.get('steps')} timed steps in one fit/train per row; project rollout.compile="
        f"{f.get('compile')}." + (" Partial: the step stopped before every row ran." if f.get("partial") else "")
    )
    res = f.get("results", {})
    ratios = f.get("ratios", {})
    lines += [
        "",
        "| row | step s (median) | min-max s | tokens/step | tokens/s | peak CUDA GiB | speed vs TRL | mem vs TRL "
        "| settings / note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in f.get("rows", list(res)):
        v = res.get(row)
        if v is None:
            lines.append(f"| {row} | | | | | | | | not reached |")
            continue
        if "error" in v:
            note = v["error"][:200].replace("\n", " ").replace("|", "/")
            lines.append(f"| {row} | | | | | | | | {note} |")
            continue
        st = v.get("settings", {})
        note = ", ".join(f"{k}: {st[k]}" for k in ("attn_implementation", "optimizer", "generation") if k in st)
        lines.append(
            f"| {row} | {_fmt(v.get('step_s_median'))} | {_fmt(v.get('step_s_min'))}-{_fmt(v.get('step_s_max'))} | "
            f"{_fmt(v.get('tokens_per_step'), '.0f')} | {_fmt(v.get('tokens_per_s'), '.1f')} | "
            f"{_fmt(v.get('peak_cuda_gib'), '.2f')} | {_fmt(ratios.get(f'{row}_speed_vs_trl'))} | "
            f"{_fmt(ratios.get(f'{row}_mem_vs_trl'))} | {note} |"
        )
    lines += [
        "",
        "Phase split: median seconds per step (peak CUDA GiB of the phase).",
        "",
        "| row | " + " | ".join(FAIR_PHASES) + " |",
        "|---|" + "---:|" * len(FAIR_PHASES),
    ]
    for row, v in res.items():
        if "phases" not in v:
            continue
        cells = []
        for name in FAIR_PHASES:
            ph = v["phases"].get(name, {})
            peak = ph.get("peak_gib")
            cells.append(_fmt(ph.get("s_median")) + (f" ({peak:.2f})" if isinstance(peak, int | float) else ""))
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    prof = (res.get("full") or {}).get("profile")
    lines += ["", "Profile of one step of the full composition (top kernels):", ""]
    if not prof:
        lines.append("No profile (the full row did not finish).")
    else:
        lines += [f"| kernel | calls | {prof.get('by')} ms | share |", "|---|---:|---:|---:|"]
        for k in prof.get("rows", []):
            name = str(k.get("name", "")).replace("|", "/")
            lines.append(f"| `{name}` | {k.get('calls')} | {_fmt(k.get('self_ms'), '.2f')} | {_fmt(k.get('share'))} |")
    return lines


def cmd_report(out: Path) -> int:
    report = build_report(out)
    (out / "gpu.json").write_text(json.dumps(report, indent=2))
    (out / "gpu.md").write_text(render_md(report))
    print(f"[gpu_check] wrote {out / 'gpu.json'} and {out / 'gpu.md'} (device: {report['machine'].get('device')})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("imports", help="resolve the imports of steps")
    a.add_argument("steps", nargs="+")
    a.add_argument("--wheels", type=Path, default=Path(".gpu_wheels"))
    b = sub.add_parser("install", help="install the missing wheels (--no-deps) into --target")
    b.add_argument("--wheels", type=Path, default=Path(".gpu_wheels"))
    b.add_argument("--target", type=Path, default=Path(".gpu_site"))
    b.add_argument("--prefer-wheels", action="store_true", default=os.environ.get("GPU_CHECK_PREFER_WHEELS") == "1")
    b.add_argument("--dry-run", action="store_true")
    r = sub.add_parser("repack", help="LZMA-recompress the large wheels of a folder")
    r.add_argument("wheels", type=Path)
    r.add_argument("--min-mib", type=float, default=8.0)
    c = sub.add_parser("report", help="write OUT/gpu.json and OUT/gpu.md")
    c.add_argument("out", type=Path)
    ns = p.parse_args(argv)
    if ns.cmd == "imports":
        return cmd_imports(ns.steps, ns.wheels)
    if ns.cmd == "install":
        return cmd_install(ns.wheels, ns.target, ns.prefer_wheels, ns.dry_run)
    if ns.cmd == "repack":
        return cmd_repack(ns.wheels, ns.min_mib)
    return cmd_report(ns.out)


if __name__ == "__main__":
    sys.exit(main())
