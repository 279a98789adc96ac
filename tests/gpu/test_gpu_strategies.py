"""DDP and FSDP with one process on CUDA, through the user's command (``python -m composer_plugins train``).

The CPU side of both strategies (gloo, two processes) is covered in ``tests/training/step/test_training_dp.py``;
here the NCCL process group, the CUDA placement of the policy and of the EMA teacher (FSDP wraps it as its own
unit) and a checkpoint written under each strategy are what is new.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

CONFIG = """
seed: 0
cache_dir: {cache}
output_dir: {out}
model:
  tiny: {{hidden_size: 64, intermediate_size: 128, num_layers: 2, num_heads: 2, num_kv_heads: 1,
          vocab_size: 300, tokenizer_corpus_size: 400, max_position_embeddings: 192}}
env: {{name: gsm8k, difficulty: trivial}}
hints: {{provider: {{name: template, reveal_answer: true}}}}
sft: {{enabled: false}}
losses:
  grpo: {{weight: 1.0}}
  hint_distill: {{weight: 0.5, teacher: ema, topk: 20}}
rollout: {{prompts_per_step: 2, num_generations: 4, max_new_tokens: 12, temperature: 1.0}}
trainer: {{max_steps: 2, checkpoint_every_n_steps: 1, enable_progress_bar: false, accelerator: gpu, devices: 1,
          precision: bf16-mixed, strategy: {strategy}}}
eval: {{at_start: false, at_end: false}}
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_process_strategy_trains_on_cuda(strategy, tmp_path):
    out = tmp_path / "run"
    cfg = tmp_path / "train.yaml"
    cfg.write_text(CONFIG.format(cache=tmp_path / "cache", out=out, strategy=strategy))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "composer_plugins", "train", "-c", str(cfg), "--no-progress"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = (out / "history.csv").read_text().strip().splitlines()
    assert len(rows) == 3, rows  # a header and one row per optimizer step
    m = json.loads((out / "metrics.json").read_text())
    assert m["train/hint_distill/skipped"] == 0.0 and m["train/hint/rows"] > 0, m
    assert math.isfinite(m["train/loss"]) and m["train/completion_tokens"] > 0, m
    state = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert state and all(torch.isfinite(v.float()).all() for v in state.values() if torch.is_tensor(v))
