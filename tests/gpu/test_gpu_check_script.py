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

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

STEPS = ("setup", "tier", "kernels", "scale-0.5b", "scale-1.5b")


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=e, timeout=timeout)


def test_dry_run_prints_every_step_and_resolves_its_imports(tmp_path):
    out = tmp_path / "results"
    p = _run("--dry-run", "--out", str(out), env={"GPU_WHEELS": str(tmp_path / "no-wheels")})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    for step in STEPS:
        assert f"[gpu_check] step {step} (timeout " in p.stdout, step
        assert f"  {step}:\n" in p.stdout, step  # its imports were resolved
    assert "-m pytest" in p.stdout and "tests/gpu -m gpu" in p.stdout
    assert "-m benchmarks.bench_losses" in p.stdout and "hint_distill_liger" in p.stdout
    assert "--shapes gpu-0.5b" in p.stdout and "--shapes gpu-1.5b" in p.stdout and "topk=100" in p.stdout
    assert "teacher=ema" in p.stdout and "trl_grpo" in p.stdout
    assert "MISSING" not in p.stdout and "every step's imports resolve" in p.stdout
    assert "no wheels in" in p.stdout  # the setup step says where the wheels would come from
    assert not out.exists(), "a dry run writes nothing"


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
    """Every ``--variants`` / ``--shapes`` value the script passes is one the benchmark knows (and bad ones fail)."""
    import re

    from benchmarks import bench_losses, bench_scale

    text = SCRIPT.read_text()
    losses = re.search(r"bench_losses .*?--variants (\S+)", text, re.S)
    assert losses and set(losses.group(1).split(",")) <= set(bench_losses.VARIANTS + bench_losses.EXTRA_VARIANTS)
    assert {"hint_distill_liger", "hint_distill_chunked"} <= set(losses.group(1).split(","))
    scale = re.findall(r"bench_scale .*?--shapes (\S+) \\\s+--variants (\S+)", text, re.S)
    assert [s for s, _ in scale] == ["gpu-0.5b", "gpu-1.5b"]
    for shape, variants in scale:
        assert shape in bench_scale.SHAPES and set(variants.split(",")) <= set(bench_scale.VARIANTS)
    with pytest.raises(SystemExit):
        bench_scale.main(["--shapes", "gpu-0.7b"])
    assert "available: cpu, gpu-0.5b, gpu-1.5b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_losses.main(["--variants", "hint_distill_triton"])
    assert "hint_distill_liger" in capsys.readouterr().err


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
    budgets = {"GPU_CHECK_KERNELS_S": "2", "GPU_CHECK_SCALE05_S": "2", "GPU_CHECK_SCALE15_S": "2"}
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
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # three steps timed out
    r = json.loads((out / "gpu.json").read_text())
    status = {s["step"]: (s["rc"], s["timed_out"]) for s in r["steps"]}
    assert status == {
        "setup": (0, False),
        "tier": (0, False),
        "kernels": (124, True),
        "scale-0.5b": (124, True),
        "scale-1.5b": (124, True),
    }, r["steps"]
    assert r["tier"]["counts"] == {"skipped": 17} and r["machine"]["device"] == "no CUDA device"
    md = (out / "gpu.md").read_text()
    assert "Device: **no CUDA device**" in md and md.count("TIMED OUT") == 3
    for step in status:
        assert (out / "gpu.d" / f"{step}.log").exists()
