"""One progress style for SFT, RL and evaluation (steps, rollouts/s, tokens/s, reward), and one switch,
``--no-progress``, that silences every bar (transformers' "Loading weights" included). Real subprocesses:
the bars are what a user's terminal (stderr) shows."""

from __future__ import annotations

import os
import sys

import pytest

from composer_plugins import procs

TINY = """
seed: 0
cache_dir: {cache}
output_dir: {out}
model:
  tiny: {{hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, num_kv_heads: 1,
          vocab_size: 300, tokenizer_corpus_size: 200}}
env: {{name: gsm8k, difficulty: trivial}}
losses: {{grpo: {{weight: 1.0}}}}
sft: {{enabled: true, steps: 4, batch_size: 8, num_examples: 64, progress: true}}
rollout: {{prompts_per_step: 2, num_generations: 2, max_new_tokens: 8}}
trainer: {{max_steps: 3, checkpoint_every_n_steps: 0, enable_progress_bar: true, num_threads: 1}}
eval: {{num_problems: 6, batch_size: 3, k: 1, num_samples: 1, at_start: false, at_end: true}}
"""


def _run(*args: str) -> procs.subprocess.CompletedProcess:  # type: ignore[name-defined]
    env = {k: v for k, v in os.environ.items() if k not in ("COMPOSER_PROGRESS", "TQDM_DISABLE")}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    env.update(COMPOSER_MLFLOW="0", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", COLUMNS="160")
    return procs.run(
        [sys.executable, "-m", "composer_plugins", *args], env=env, capture_output=True, text=True, timeout=400
    )


@pytest.mark.slow
def test_one_progress_style_and_one_switch(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY.format(cache=tmp_path / "cache", out=tmp_path / "run"))
    shown = _run("train", "-c", str(cfg))
    assert shown.returncode == 0, shown.stderr[-3000:]
    err = shown.stderr
    # SFT: optimizer steps out of sft.steps, its loss and examples/s; RL: steps out of max_steps with
    # reward, loss, rollouts/s and tokens/s; eval: held-out problems and accuracy
    assert "sft: 100%" in err and "4/4" in err and "examples/s=" in err, err[-3000:]
    assert "train: 100%" in err and "3/3" in err and "rollouts/s=" in err and "tokens/s=" in err and "reward=" in err
    assert "eval: 100%" in err and "6/6" in err and "problem" in err and "accuracy=" in err
    # none of Lightning's own bars (epochs, v_num, "Validation DataLoader 0") nor it/s units
    for noise in ("Epoch", "v_num", "DataLoader", "it/s"):
        assert noise not in err, noise

    quiet = _run("train", "--no-progress", "-c", str(cfg), "-S", f"output_dir={tmp_path / 'run2'}")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "%|" not in quiet.stderr and "Loading weights" not in quiet.stderr, quiet.stderr[-3000:]
    # the switch is the same for every command: the group-level flag silences evaluation (and model loading)
    ev = _run("--no-progress", "eval", "-c", str(cfg), "--checkpoint", str(tmp_path / "run" / "model"))
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "%|" not in ev.stderr and "Loading weights" not in ev.stderr and '"gsm8k/accuracy"' in ev.stdout
