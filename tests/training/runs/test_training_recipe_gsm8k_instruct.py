"""The one-GPU recipe (examples/gsm8k-instruct) runs end to end here, at a tiny shape, from local files.

The recipe's own config and command (``composer-plugins train -c examples/gsm8k-instruct/config.yaml``),
with the hub replaced by local files on the same code path: ``model.name_or_path`` a ``save_pretrained``
directory of a Qwen2-architecture model with a Qwen2.5-style chat template (``from_pretrained``, as for
``Qwen/Qwen2.5-0.5B-Instruct``), ``env.source`` a directory laid out like the ``openai/gsm8k`` repository
(``main/{train,test}-00000-of-00001.parquet``), and the shape overrides the README lists for a CPU smoke run.
The TRL route of ``run.sh`` (``backend run trl``, here without vLLM) runs the same config too.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "examples" / "gsm8k-instruct"


def tiny_overrides() -> list[str]:
    """The CPU smoke-run overrides of the recipe's README (its "Tiny local run" command), read from it."""
    section = (RECIPE / "README.md").read_text().split("## Tiny local run", 1)[1]
    paths = ("model.name_or_path=", "env.source=", "output_dir=")
    return [o for o in re.findall(r"-S (\S+)", section) if not o.startswith(paths)]


@pytest.mark.timeout(900)
def test_the_recipe_trains_and_evaluates_at_a_tiny_shape_from_local_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from composer_plugins.testing.chat_model import build_instruct_model, gsm8k_like_rows

    model_dir = build_instruct_model(tmp_path / "Qwen2.5-0.5B-Instruct")
    data = tmp_path / "gsm8k" / "main"  # the hub repository's layout
    data.mkdir(parents=True)
    for split, rows in (("train", gsm8k_like_rows(32, 0)), ("test", gsm8k_like_rows(8, 1))):
        pq.write_table(pa.Table.from_pylist(rows), data / f"{split}-00000-of-00001.parquet")
    out = tmp_path / "run"
    overrides = tiny_overrides()
    assert {"trainer.accelerator=cpu", "trainer.precision=32-true"} <= set(overrides)
    cmd = [
        sys.executable,
        "-m",
        "composer_plugins",
        "--no-progress",
        "train",
        "-c",
        str(RECIPE / "config.yaml"),
        "-S",
        f"model.name_or_path={model_dir}",
        "-S",
        f"env.source={data.parent}",
        "-S",
        f"output_dir={out}",
        "-S",
        f"cache_dir={tmp_path / 'cache'}",
        *[a for o in overrides for a in ("-S", o)],
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COMPOSER_PLUGINS_LOAD": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "history.csv") as f:
        history = list(csv.DictReader(f))
    steps = [r for r in history if r.get("train/loss")]
    assert len(steps) == 2
    for r in steps:
        assert float(r["train/grpo/skipped"]) == 0.0 and float(r["train/hint_distill/skipped"]) == 0.0
    metrics = json.loads((out / "metrics.json").read_text())
    assert any(k.endswith("accuracy") for k in metrics), sorted(metrics)
    # the exported model carries the chat template it was trained with
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "model")
    msgs = [{"role": "user", "content": "Q?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True).endswith("<|im_start|>assistant\n")


@pytest.mark.timeout(600)
def test_the_recipe_runs_in_the_trl_backend_too(tmp_path):
    pytest.importorskip("composer_plugins_trl")  # packages/composer-plugins-trl (install.sh dev), as tests/backends
    from composer_plugins.testing.chat_model import build_instruct_model, write_gsm8k_like

    model_dir = build_instruct_model(tmp_path / "model")
    data = write_gsm8k_like(tmp_path / "gsm8k", n_train=16, n_test=4)
    out = tmp_path / "run"
    overrides = [o for o in tiny_overrides() if not o.startswith(("eval.", "trainer.val_every"))]
    cmd = [
        sys.executable,
        "-m",
        "composer_plugins",
        "--no-progress",
        "backend",
        "run",
        "trl",
        "-c",
        str(RECIPE / "config.yaml"),
        "-S",
        f"model.name_or_path={model_dir}",
        "-S",
        f"env.source={data}",
        "-S",
        f"output_dir={out}",
        *[a for o in overrides for a in ("-S", o)],
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COMPOSER_PLUGINS_LOAD": "composer-plugins-trl"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train/composer/grpo/skipped"] == 0.0 and metrics["train/composer/hint_distill/skipped"] == 0.0
    assert metrics["train/composer/hint/rows"] > 0  # failed rows got a hinted teacher context
