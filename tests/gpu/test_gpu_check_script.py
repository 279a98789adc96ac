"""``scripts/gpu_check.sh`` on the CPU: the dry run end to end, the refusal without CUDA, the offline install of
missing wheels, and the report written from whatever steps ran, failed or timed out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

STEPS = ("setup", "fair", "kernels", "tier")
#: The fair benchmark's rows and phases (what the dry run must show).
ROWS = ("grpo", "trl_grpo", "full", "grpo+hint", "grpo+teacher_distill", "grpo+replay")


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=e, timeout=timeout)


def test_dry_run_prints_every_step_resolves_its_imports_and_runs_the_fair_benchmark_on_the_cpu(tmp_path):
    """The dry run: every step's command and imports, then the fair benchmark at tiny sizes on the CPU, whose
    report has every row, the phase columns (each row's phases found) and the profile table."""
    out = tmp_path / "results"
    p = _run("--dry-run", "--out", str(out), env={"GPU_WHEELS": str(tmp_path / "no-wheels")}, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    for step in STEPS:
        assert f"[gpu_check] step {step} (timeout " in p.stdout, step
        assert f"  {step}:\n" in p.stdout, step  # its imports were resolved
    assert "-m pytest" in p.stdout and "tests/gpu -m gpu" in p.stdout
    assert "-m benchmarks.bench_losses" in p.stdout and "hint_distill_liger" in p.stdout
    assert "-m benchmarks.bench_gpu --shape gpu-0.5b --steps 5 --warmup 1" in p.stdout
    assert "MISSING" not in p.stdout and "every step's imports resolve" in p.stdout
    assert "no wheels in" in p.stdout  # the setup step says where the wheels would come from
    assert sorted(x.name for x in out.iterdir()) == ["dry-run"], "a dry run writes only its CPU run"
    r = json.loads((out / "dry-run" / "gpu.json").read_text())
    fair = r["fair"]
    assert fair["shape"] == "cpu-tiny" and not fair["partial"] and fair["steps"] == 5
    assert list(fair["results"]) == list(ROWS)
    from benchmarks.bench_gpu import PHASES

    assert gpu_check.FAIR_PHASES == PHASES
    must = {"generation", "experience", "forward", "backward", "optimizer"}
    extra = {"full": {"teacher", "replay", "ema"}, "grpo+hint": {"teacher", "ema"}, "grpo+teacher_distill": {"teacher"}}
    extra["grpo+replay"] = {"replay"}
    for row in ROWS:
        v = fair["results"][row]
        assert "error" not in v, (row, v.get("error"))
        assert v["steps"] == 5 and len(v["per_step"]) == 5 and v["tokens_per_s"] > 0, row
        assert set(v["phases"]) == set(PHASES), row
        assert must | extra.get(row, set()) <= set(v["phases_seen"]), (row, v["phases_seen"])
        for step in v["per_step"]:  # exclusive phases: they add up to the step (the rest is "other")
            assert abs(sum(step["phases_s"].values()) - step["wall_s"]) < 1e-3 * max(1.0, step["wall_s"]), row
        assert v["settings"]["attn_implementation"] and v["settings"]["optimizer"] == "AdamW", row
    assert fair["ratios"]["full_speed_vs_trl"] > 0
    prof = fair["results"]["full"]["profile"]
    assert prof["by"] == "self CPU time" and len(prof["rows"]) >= 5
    assert any("mm" in k["name"] for k in prof["rows"])
    md = (out / "dry-run" / "gpu.md").read_text()
    assert "## Fair benchmark" in md and "| row | generation | experience | forward | teacher | replay |" in md
    for row in ROWS:
        assert f"| {row} | " in md, row
    assert "| kernel | calls | self CPU time ms | share |" in md and "`aten::" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA present the script runs for real")
def test_a_real_run_without_cuda_refuses_and_points_at_the_dry_run(tmp_path):
    p = _run("--out", str(tmp_path / "r"), timeout=120)
    assert p.returncode == 2 and "no CUDA device" in p.stderr and "--dry-run" in p.stderr
    assert not (tmp_path / "r").exists()
    bad = _run("--frobnicate")
    assert bad.returncode == 2 and "unknown option '--frobnicate'" in bad.stderr and "--dry-run" in bad.stderr


def test_imports_count_a_module_as_resolved_when_a_wheel_provides_it(tmp_path, capsys):
    assert gpu_check._resolve(["json", "no_such_module_gpu_check"], {}) == 1
    wheel = tmp_path / "no_such_module_gpu_check-1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    assert gpu_check._resolve(["no_such_module_gpu_check"], gpu_check.wheel_dists(tmp_path)) == 0
    assert "wheel (no_such_module_gpu_check from" in capsys.readouterr().out


def _probe_wheel(folder: Path) -> Path:
    """A minimal, valid pure wheel of a distribution this Python does not have."""
    name, version = "gpu_check_probe", "0.1"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": "VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def test_install_puts_only_missing_wheels_into_the_target_offline(tmp_path, capsys):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _probe_wheel(wheels)
    (wheels / "pytest-0.0.1-py3-none-any.whl").write_bytes(b"")  # present here: must not be installed
    target = tmp_path / "site"
    assert gpu_check.cmd_install(wheels, target, prefer_wheels=False, dry_run=False) == 0
    out = capsys.readouterr().out
    assert "gpu-check-probe 0.1: install" in out and "pytest: present" in out
    assert (target / "gpu_check_probe.py").read_text() == "VALUE = 42\n"
    assert not list(target.glob("pytest*")), "a distribution the machine has was installed"


def test_report_is_written_whatever_steps_failed_or_timed_out(tmp_path):
    d = tmp_path / "gpu.d"
    d.mkdir()
    steps = [
        {"step": "setup", "rc": 0, "seconds": 3.0, "budget_s": 40, "timed_out": False, "command": "x"},
        {"step": "tier", "rc": 1, "seconds": 80.2, "budget_s": 165, "timed_out": False, "command": "pytest"},
        {"step": "kernels", "rc": 124, "seconds": 60.0, "budget_s": 60, "timed_out": True, "command": "bench"},
        {"step": "scale-0.5b", "rc": 124, "seconds": 130.0, "budget_s": 130, "timed_out": True, "command": "s"},
    ]
    (d / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (d / "tier.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_gpu_kernels" name="test_a[cuda-fp32]" time="1.5"/>'
        '<testcase classname="tests.gpu.test_gpu_diloco" name="test_b[cuda-none]" time="0.7">'
        '<failure message="TypeError: can&apos;t convert cuda:0 device type tensor to numpy">tb</failure></testcase>'
        "</testsuite></testsuites>"
    )
    partial = {
        "name": "scale",
        "partial": True,
        "results": {"gpu-0.5b/grpo": {"step_s": 2.5, "tokens_per_s": 3000.0, "peak_cuda_gib": 9.5}},
    }
    (d / "scale-0.5b.json").write_text(json.dumps(partial))
    assert gpu_check.main(["report", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "gpu.json").read_text())
    assert r["machine"]["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
    assert r["tier"]["counts"] == {"passed": 1, "failed": 1}
    assert r["kernels"] is None and r["scale"]["1.5b"] is None and r["scale"]["0.5b"]["partial"]
    md = (tmp_path / "gpu.md").read_text()
    assert f"Device: **{r['machine']['device']}**" in md
    assert "| kernels | TIMED OUT | 60 | 60 |" in md and "| tier | FAILED (exit 1) |" in md
    assert "can't convert cuda:0" in md and "test_b[cuda-none]" in md
    assert "Partial: the step stopped" in md and "| gpu-0.5b/grpo | 2.50 | 3000.0 | 9.50 |" in md
    assert "No result (the step failed or did not run" in md


def test_the_benchmark_options_in_the_script_exist(capsys):
    """Every ``--variants`` / ``--shape`` value the script passes is one the benchmarks know (and bad ones fail)."""
    import re

    from benchmarks import bench_gpu, bench_losses

    text = SCRIPT.read_text()
    losses = re.search(r"bench_losses .*?--variants (\S+)", text, re.S)
    assert losses and set(losses.group(1).split(",")) <= set(bench_losses.VARIANTS + bench_losses.EXTRA_VARIANTS)
    assert {"hint_distill_liger", "hint_distill_chunked"} <= set(losses.group(1).split(","))
    shapes = re.findall(r"bench_gpu --shape (\S+)", text)
    assert shapes == ["gpu-0.5b", "cpu-tiny"] and set(shapes) <= set(bench_gpu.SHAPES)
    with pytest.raises(SystemExit):
        bench_gpu.main(["--rows", "grpo,dapo"])
    assert "available: grpo, trl_grpo, full, grpo+hint, grpo+teacher_distill, grpo+replay" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_losses.main(["--variants", "hint_distill_triton"])
    assert "hint_distill_liger" in capsys.readouterr().err


def test_phase_timer_counts_nested_phases_once(monkeypatch):
    """A phase nested in another takes its own time out of the outer one; the rest of the step is ``other``;
    steps outside ``record`` are dropped; the summary gives median, spread and each phase's median."""
    from benchmarks import bench_gpu

    clock = iter(range(0, 1000))
    monkeypatch.setattr(bench_gpu.time, "perf_counter", lambda: float(next(clock)))
    t = bench_gpu.PhaseTimer(cuda=False)

    class Obj:
        def inner(self):
            return "x"

    o = Obj()
    t.wrap(o, "inner", "teacher")
    for record in (False, True, True):
        t.begin_step(record=record)
        t.enter("forward")  # forward: 1 tick before the teacher, 1 after
        assert o.inner() == "x"  # teacher: 1 tick
        t.exit("forward")
        t.end_step(tokens=10)
    assert len(t.steps) == 2
    for s in t.steps:
        assert s["phases_s"] == {"other": 2.0, "forward": 2.0, "teacher": 1.0} and s["wall_s"] == 5.0
    summary = bench_gpu.summarize(t.steps)
    assert summary["step_s_median"] == 5.0 and summary["tokens_per_s"] == 2.0
    assert summary["phases"]["forward"]["s_median"] == 2.0 and summary["phases"]["replay"]["s_median"] == 0.0
    with pytest.raises(AssertionError, match="phase 'forward' closed while 'teacher' was open"):
        t.begin_step()
        t.enter("teacher")
        t.exit("forward")


def test_lzma_repacked_wheels_install_with_pip_unchanged(tmp_path, capsys):
    """``gpu_wheels.sh`` recompresses the large wheels (to fit 64 MiB): pip still installs them, byte for byte."""
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    whl = _probe_wheel(wheels)
    assert gpu_check.main(["repack", str(wheels), "--min-mib", "0"]) == 0
    assert "recompressed gpu_check_probe-0.1-py3-none-any.whl" in capsys.readouterr().out
    with zipfile.ZipFile(whl) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_LZMA}
    assert gpu_check.main(["repack", str(wheels), "--min-mib", "0"]) == 0  # idempotent
    assert "recompressed" not in capsys.readouterr().out
    assert gpu_check.cmd_install(wheels, tmp_path / "site", prefer_wheels=False, dry_run=False) == 0
    assert (tmp_path / "site" / "gpu_check_probe.py").read_text() == "VALUE = 42\n"


def test_bench_scale_runs_what_the_script_asks_for(monkeypatch, tmp_path):
    """``--shapes gpu-0.5b --hint-all``: every listed variant on that shape only (``grpo+hint`` included), the
    hint settings on both hinted configurations, and each result in the partial JSON as soon as it exists."""
    from benchmarks import bench_scale

    calls = []

    def spawn(variant, spec, model, pairs, steps, timeout, hint_options=None):
        calls.append((variant, spec, timeout, hint_options))
        if variant == "grpo+hint+replay":
            return {"error": "timed out after 90 s"}
        return {"step_s": 1.0, "tokens_per_s": 100.0, "peak_cuda_gib": 2.0, "max_prompt_tokens": 10}

    monkeypatch.setattr(bench_scale, "_spawn", spawn)
    monkeypatch.setattr(bench_scale, "_prepare", lambda tmp, shape: ("model", "pairs", 151_936))
    partial = tmp_path / "scale.json"
    res = bench_scale.run(
        quick=True,
        variants=("grpo", "grpo+hint", "grpo+hint+replay", "trl_grpo"),
        hint_options={"teacher": "ema", "topk": 100},
        shapes=("gpu-0.5b",),
        hint_all=True,
        config_timeout=90,
        partial=partial,
    )
    opts = {"teacher": "ema", "topk": 100}
    assert calls == [
        ("grpo", "gpu-0.5b", 90, None),
        ("grpo+hint", "gpu-0.5b", 90, opts),
        ("grpo+hint+replay", "gpu-0.5b", 90, opts),
        ("trl_grpo", "gpu-0.5b", 90, None),
    ]
    assert res["results"]["gpu-0.5b/grpo+hint"]["hint_options"] == opts
    assert res["results"]["gpu-0.5b/grpo+hint+replay"]["error"].startswith("timed out")
    assert res["ratios"]["gpu-0.5b/grpo_speed_vs_trl"] == 1.0 and "gpu-0.5b/grpo+hint_mem_vs_trl" in res["ratios"]
    saved = json.loads(partial.read_text())
    assert saved["partial"] and set(saved["results"]) == {f"gpu-0.5b/{v}" for v, *_ in calls}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA present the tier would run for real")
def test_every_step_is_bounded_and_the_report_is_written_when_steps_time_out(tmp_path):
    """The real flow on the CPU (``GPU_CHECK_ALLOW_CPU=1``): the tier runs (its gpu tests skip here), the
    benchmarks get a 2-second budget and are killed by ``timeout``; the report still says what happened."""
    out = tmp_path / "results"
    budgets = {"GPU_CHECK_KERNELS_S": "2", "GPU_CHECK_FAIR_S": "2"}
    p = _run(
        "--out",
        str(out),
        env={
            "GPU_CHECK_ALLOW_CPU": "1",
            "GPU_WHEELS": str(tmp_path / "none"),
            "GPU_SITE": str(tmp_path / "site"),
            **budgets,
        },
        timeout=400,
    )
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # two steps timed out
    r = json.loads((out / "gpu.json").read_text())
    status = {s["step"]: (s["rc"], s["timed_out"]) for s in r["steps"]}
    assert status == {"setup": (0, False), "fair": (124, True), "kernels": (124, True), "tier": (0, False)}, r["steps"]
    # every test of the tier (`-m gpu`) skips here, as many as pytest collects (no count to bump per CUDA case)
    q = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "gpu"), "-m", "gpu", "--collect-only", "-q"]
    listed = subprocess.run([*q, "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    tier = [ln for ln in listed.stdout.splitlines() if "::" in ln]
    assert len(tier) >= 18, listed.stdout[-2000:]  # the tier's CUDA cases as of the kernels+gpubench merge
    assert r["tier"]["counts"] == {"skipped": len(tier)} and r["machine"]["device"] == "no CUDA device"
    md = (out / "gpu.md").read_text()
    assert "Device: **no CUDA device**" in md and md.count("TIMED OUT") == 2
    assert "No result (the step failed or did not run; see the steps table and gpu.d/fair.log)" in md
    for step in status:
        assert (out / "gpu.d" / f"{step}.log").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA present the steps would run for real")
def test_gpu_check_steps_runs_only_the_named_steps(tmp_path):
    """``GPU_CHECK_STEPS="setup"``: the other steps say they were skipped, and only setup is in the report."""
    out = tmp_path / "results"
    env = {"GPU_CHECK_ALLOW_CPU": "1", "GPU_CHECK_STEPS": "setup", "GPU_WHEELS": str(tmp_path / "none")}
    p = _run("--out", str(out), env={**env, "GPU_SITE": str(tmp_path / "site")}, timeout=200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for step in ("fair", "kernels", "tier"):
        assert f"[gpu_check] step {step}: not in GPU_CHECK_STEPS, skipped" in p.stdout
    r = json.loads((out / "gpu.json").read_text())
    assert [s["step"] for s in r["steps"]] == ["setup"] and r["fair"] is None
