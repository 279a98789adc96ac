"""A new user's first-hour run frictions (issue 41): a missing ``eval --checkpoint`` is named with the fix, and a hub
id that cannot be fetched (no network) is refused at once with the ways out, through the real command line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from composer_plugins.core.cli import load_commands


@pytest.mark.parametrize("ckpt", ["missing/model", "missing/checkpoints/last.ckpt", "./nowhere"])
def test_eval_names_a_missing_checkpoint_and_the_fix(tmp_path: Path, ckpt: str):
    path = str(tmp_path / ckpt)
    r = CliRunner().invoke(load_commands(), ["eval", "--checkpoint", path, "-S", f"output_dir={tmp_path}/run"])
    assert r.exit_code == 2, r.output
    assert r.output.startswith(f"Error: --checkpoint: {path} does not exist — give a "), r.output
    assert "save_pretrained" in r.output and "Repo id" not in r.output and "Traceback" not in r.output


def test_eval_refuses_a_directory_given_as_a_ckpt(tmp_path: Path):
    d = tmp_path / "last.ckpt"
    d.mkdir()
    r = CliRunner().invoke(load_commands(), ["eval", "--checkpoint", str(d)])
    assert r.exit_code == 2 and f"--checkpoint: {d} is a directory — give a Lightning checkpoint file" in r.output


def test_a_hub_id_without_network_is_refused_at_once_with_the_ways_out(tmp_path: Path):
    """Online (no ``HF_HUB_OFFLINE``) but the hub unreachable (``HF_ENDPOINT`` a closed loopback port): the
    start-of-run check probes the hub once and refuses the uncached id with the same ways out as offline."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        port = closed.getsockname()[1]
        cfg = tmp_path / "run.yaml"
        model = "model:\n  name_or_path: Qwen/Qwen2.5-0.5B\n"
        cfg.write_text(f"output_dir: {tmp_path}/run\nsft: {{enabled: false}}\n{model}")
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0",
            "HF_HOME": str(tmp_path / "hf"),
            "HF_ENDPOINT": f"http://127.0.0.1:{port}",
            "COMPOSER_MLFLOW": "0",
        }
        for k in ("HF_HUB_CACHE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
            env.pop(k, None)
        r = subprocess.run(
            [sys.executable, "-m", "composer_plugins", "train", "-c", str(cfg)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        closed.close()
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.startswith(
        f"Error: {cfg}:4: model.name_or_path: 'Qwen/Qwen2.5-0.5B' is a hub id that is not "
        f"in the Hugging Face cache ({tmp_path / 'hf' / 'hub'}), and the hub cannot be reached "
        f"(http://127.0.0.1:{port}: "
    ), r.stderr
    for way in ("— give a local directory", "hf download Qwen/Qwen2.5-0.5B", "HF_HOME", "HF_ENDPOINT"):
        assert way in r.stderr, (way, r.stderr)
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


def _sigint_default() -> None:
    """In the child: Ctrl-C handled as in a terminal, even when the test run itself ignores SIGINT (a shell's
    background job starts with SIGINT ignored, and an ignored signal is inherited through exec)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _train(cfg: Path, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "COMPOSER_MLFLOW": "0", "OMP_NUM_THREADS": "1"}
    kw.setdefault("preexec_fn", _sigint_default)
    return subprocess.Popen(
        [sys.executable, "-m", "composer_plugins", "train", "-c", str(cfg), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_names_the_step_and_the_checkpoint_exits_130_and_a_rerun_must_choose(tmp_path: Path, tiny_yaml: str):
    """A real ``train`` process sent SIGINT (what Ctrl-C sends) once it has checkpoints: it says where it stopped and
    how to continue, exits 130 with the bar closed; the same command again is refused until --resume/--overwrite."""
    import re
    import signal
    import time

    out = tmp_path / "run"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(tiny_yaml + f"output_dir: {out}\n")
    common = ["-S", "sft.enabled=false", "-S", "trainer.enable_progress_bar=true"]
    proc = _train(cfg, *common, "-S", "trainer.max_steps=400")
    try:
        deadline = time.monotonic() + 240
        while not any(p.name.startswith("step=") and p.name != "step=1.ckpt" for p in out.glob("checkpoints/*.ckpt")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint after 240 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, err[-3000:]
    m = re.search(r"(?m)^interrupted at step (\d+); last checkpoint at step (\d+); continue with `--resume last`$", err)
    assert m, err[-3000:]  # on a line of its own: the bar was closed before it
    step, ckpt = int(m.group(1)), int(m.group(2))
    assert 2 <= ckpt <= step < 400 and (out / "checkpoints" / f"step={ckpt}.ckpt").is_file()
    assert "Traceback" not in err
    # the same command again would start over on top of those checkpoints: refused, with both ways on
    again = _train(cfg, *common, "-S", "trainer.max_steps=400")
    _, err = again.communicate(timeout=120)
    assert again.returncode == 2, err[-3000:]
    assert f"already holds checkpoints of an earlier run (the last at step {ckpt})" in err
    assert "`--resume last`" in err and "`--overwrite`" in err
    # --overwrite starts over: the old checkpoints and history are gone, a fresh 1-step run is there
    fresh = _train(cfg, *common, "-S", "trainer.max_steps=1", "--overwrite")
    _, err = fresh.communicate(timeout=240)
    assert fresh.returncode == 0, err[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step=1.ckpt"]
    assert len((out / "history.csv").read_text().splitlines()) == 2


def test_an_unreachable_teacher_is_warned_about_once_per_step_and_summarised(make_cfg, capsys, monkeypatch):
    """A ``vllm`` scoring teacher on a closed loopback port: every step prints one console line naming the teacher,
    its URL (no secret) and the failed rows, and the run ends with a summary; the key never reaches the console."""
    import re

    from composer_plugins.training.runs.run import run_train

    monkeypatch.setenv("FRICTION_TEACHER_KEY", "sk-do-not-print-0123456789")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    try:
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
        cfg, src = make_cfg(
            f"""
            losses:
              grpo: {{weight: 1.0}}
              hint_distill: {{weight: 0.0}}
              teacher_distill:
                weight: 0.5
                teachers:
                  - {{kind: vllm, id: far, model: m, base_url: "{url}", api_key_env: FRICTION_TEACHER_KEY, topk: 4,
                     max_retries: 0, timeout_s: 5}}
            """,
            "sft.enabled=false",
        )
        res = run_train(cfg, src)
    finally:
        closed.close()
    err = capsys.readouterr().err
    rows = 2 * 4  # prompts_per_step x num_generations of the tiny config
    step_lines = re.findall(
        rf"(?m)^warning: teacher 'far' \({re.escape(url)}\): {rows} of {rows} rows failed this "
        r"step \((.+)\); its term is skipped for them$",
        err,
    )
    assert len(step_lines) == 2, err  # max_steps 2: once per step, not once per row or request
    assert re.search(
        rf"(?m)^warning: teacher 'far' \({re.escape(url)}\): {2 * rows} of {2 * rows} rows failed "
        r"over the run, in 2 steps; last error: .+$",
        err,
    ), err
    assert "sk-do-not-print" not in err
    assert [r["train/teacher/far/failures"] for r in res.history] == [rows, 2 * rows]
