"""Ctrl-C (a real SIGINT to the process) during ``sft`` and during a study cell (``study train``) says what was
saved and how to continue, and exits 130, as ``train``, ``replay run`` and ``diloco`` do (issue 51): ``sft``
exited 1 with Lightning's own message, a study cell with a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Proc:
    """``python -m composer_plugins ARGS`` with stderr read as it comes (a progress bar tells when a stage runs)."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = {**os.environ, "COMPOSER_MLFLOW": "0", "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen(
            [sys.executable, "-m", "composer_plugins", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_sigint_default,
        )
        self.err = ""
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for chunk in iter(lambda: self.p.stderr.read(1), ""):  # type: ignore[union-attr]
            self.err += chunk

    def interrupt_when(self, ready, what: str) -> tuple[int, str]:
        try:
            deadline = time.monotonic() + 240
            while not ready():
                assert self.p.poll() is None, self.err[-3000:]
                assert time.monotonic() < deadline, f"no {what} after 240 s: {self.err[-3000:]}"
                time.sleep(0.2)
            self.p.send_signal(signal.SIGINT)
            self.p.wait(timeout=120)
            self._t.join(timeout=30)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait(timeout=30)
        return self.p.returncode, self.err


def test_sft_ctrl_c_says_nothing_was_saved_and_exits_130(tmp_path, tiny_yaml, tiny_cache):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(tiny_yaml + f"output_dir: {tmp_path / 'run'}\n")
    proc = _Proc(["sft", "-c", str(cfg), "-S", "sft.steps=100000", "-S", "sft.progress=true"], tmp_path)
    rc, err = proc.interrupt_when(lambda: "sft:" in proc.err and "step/s" in proc.err, "SFT progress bar")
    assert rc == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == (
        f"interrupted: nothing saved (the warm start is kept in {tiny_cache} only once it finishes); "
        "run the same command again to train it from the start"
    ), err[-3000:]
    assert "Traceback" not in err and not list(Path(tiny_cache).glob("sft/.*.tmp"))


def test_study_cell_ctrl_c_names_the_checkpoint_and_how_to_continue_and_exits_130(tmp_path, tiny_cache):
    (tmp_path / "params.yaml").write_text(
        f"""
train:
  seed: 0
  cache_dir: {tiny_cache}
  model:
    tiny: {{hidden_size: 32, intermediate_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1,
            vocab_size: 300, tokenizer_corpus_size: 400, max_position_embeddings: 192}}
  env: {{name: gsm8k, difficulty: trivial}}
  data: {{train_path: null, test_path: null}}
  rollout: {{prompts_per_step: 2, num_generations: 2, max_new_tokens: 8}}
  losses: {{grpo: {{weight: 1.0}}}}
  trainer: {{max_steps: 400, checkpoint_every_n_steps: 1, enable_progress_bar: false, num_threads: 1}}
  eval: {{at_start: false, at_end: false}}
study:
  seeds: [0]
  variants:
    plain: {{}}
mlflow: {{enabled: false}}
"""
    )
    proc = _Proc(["study", "train", "--variant", "plain", "--seed", "0", "--model", "tiny", "--pairs", ""], tmp_path)
    ckpts = tmp_path / "runs" / "plain-s0" / "checkpoints"

    # only the newest step checkpoint is kept, so wait for any at step >= 2 (one step lasts ~0.1 s here)
    def at_step_2() -> bool:
        steps = (c.stem.removeprefix("step=") for c in ckpts.glob("step=*.ckpt"))
        return any(s.isdigit() and int(s) >= 2 for s in steps)

    rc, err = proc.interrupt_when(at_step_2, "checkpoint at step 2")
    assert rc == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: the cell runs/plain-s0 stopped; its last checkpoint is at step "), err[-3000:]
    assert last.endswith("; continue it with `composer-plugins train -c runs/plain-s0/config.yaml --resume last`")
    assert "Traceback" not in err
