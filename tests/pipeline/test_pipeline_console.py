"""What ``dvc repro`` shows (issue 41, friction 8): one concise line per stage and a progress line every N steps,
the metrics in files; no library's bar ("Loading weights") in a stage's log. Real subprocesses, as DVC runs them."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from composer_plugins import procs

pytestmark = pytest.mark.slow

TINY = """
seed: 0
cache_dir: {cache}
output_dir: {out}
model:
  tiny: {{hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 1,
          vocab_size: 300, tokenizer_corpus_size: 200}}
env: {{name: gsm8k, difficulty: trivial}}
losses: {{grpo: {{weight: 1.0}}}}
sft: {{enabled: false}}
rollout: {{prompts_per_step: 2, num_generations: 2, max_new_tokens: 8}}
trainer: {{max_steps: 5, checkpoint_every_n_steps: 0, enable_progress_bar: false, progress_every_n_steps: 2,
          num_threads: 1}}
eval: {{at_start: false, at_end: false}}
"""


def _run(*args: str, cwd: Path) -> procs.subprocess.CompletedProcess:  # type: ignore[name-defined]
    env = {k: v for k, v in os.environ.items() if k not in ("COMPOSER_PROGRESS", "TQDM_DISABLE")}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)  # as a user's shell: library bars on unless we turn them off
    env.update(COMPOSER_MLFLOW="0", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return procs.run(
        [sys.executable, "-m", "composer_plugins", *args], env=env, capture_output=True, text=True, timeout=400, cwd=cwd
    )


def test_a_run_without_a_bar_prints_a_line_every_n_steps_and_no_library_bar(tmp_path: Path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(TINY.format(cache=tmp_path / "cache", out=tmp_path / "run"))
    r = _run("train", "-c", str(cfg), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = re.findall(
        rf"(?m)^train {re.escape(str(tmp_path / 'run'))}: step (\d)/5 reward=\S+ loss=\S+ \(\d+ s\)$", r.stderr
    )
    assert lines == ["2", "4", "5"], r.stderr[-3000:]  # every 2 steps and the last
    assert "%|" not in r.stderr and "Loading weights" not in r.stderr, r.stderr[-3000:]
    quiet = _run("--no-progress", "train", "-c", str(cfg), "--overwrite", cwd=tmp_path)
    assert quiet.returncode == 0 and ": step " not in quiet.stderr, quiet.stderr[-3000:]


def test_the_rollout_stage_prints_one_line_and_its_stats_go_to_a_file(tmp_path: Path):
    from composer_plugins.envs.gsm8k import GSM8KEnv
    from composer_plugins.testing.teacher_data import build_tiny_chat_model

    model = build_tiny_chat_model(tmp_path / "model", vocab_size=260, seed=1)
    tasks = tmp_path / "train.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in GSM8KEnv(difficulty="trivial").sample_tasks(8, "train", 0)))
    params = tmp_path / "params.yaml"
    params.write_text("rollout: {num_prompts: 8, num_generations: 2, max_new_tokens: 6, batch_size: 2}\n")
    out = tmp_path / "traces.jsonl"
    r = _run(
        "rollout", "-p", str(params), "--model", str(model), "--tasks", str(tasks), "--out", str(out), cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == [
        f"rollout: traces=16 prompts=8 reward_mean={_num(r.stdout, 'reward_mean')} "
        f"accuracy={_num(r.stdout, 'accuracy')} -> {out} (stats: {out}.stats.json)"
    ]
    assert json.loads(Path(f"{out}.stats.json").read_text())["traces"] == 16
    assert "%|" not in r.stderr and "Loading weights" not in r.stderr, r.stderr[-3000:]
    assert re.findall(r"(?m)^rollout: (\d+)/8 prompts$", r.stderr) == ["2", "4", "6"], r.stderr[-3000:]


def _num(text: str, key: str) -> str:
    m = re.search(rf"{key}=(\S+)", text)
    return m.group(1) if m else "<missing>"
