"""Pilot round 11: greedy split of warm starts on 600 pilot problems (../../README.md, "Pilot round 11").

The pilot's 200 problems put A at 0.225 and the study's 400 at 0.190: a 200-problem estimate has se ~0.03, too wide
to place a start in the band. This draws 600 held-out problems with the pilot's own seed, none of the study's 400,
and splits each start's greedy answers as round10/slipdiag.py does.

python round11/split600.py MODEL_DIR [MODEL_DIR ...]   # from pilot/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from composer_plugins.envs.gsm8k import GSM8KEnv

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "round10"))
from slipdiag import split


def problems(n: int = 600, seed: int = 7) -> list[dict]:
    env = GSM8KEnv(difficulty="long_columns")
    study = {t["question"] for t in env.sample_tasks(400, split="test", seed=0)}
    rows = [t for t in env.sample_tasks(3 * n, split="test", seed=seed) if t["question"] not in study]
    return rows[:n]


if __name__ == "__main__":
    torch.set_num_threads(1)
    rows = problems()
    for m in sys.argv[1:]:
        print(m, json.dumps({k: round(v, 4) for k, v in split(m, rows).items()}), flush=True)
