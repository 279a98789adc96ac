"""The pilot's problems: held-out (test-split) problems of the study's level that its 400 never use.

Every test-split problem's numbers are held out of train (``composer_plugins.envs.arith``), so the pilot
draws its problems from the test split too, with its own seed, and drops any the study's held-out set
(data seed 0, 400 problems) contains. Run from studies/procedural/pilot/ after ``composer-plugins prepare``:

    python pilot_tasks.py data/tasks/gsm8k
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from composer_plugins.core.io import atomic_write_jsonl
from composer_plugins.envs.gsm8k import GSM8KEnv

N_TEST, PILOT_SEED = 200, 7


def main(tasks_dir: str) -> None:
    with open("params.yaml") as f:  # the study's level (run_pilot.sh copies the study's params.yaml here)
        env = GSM8KEnv(difficulty=yaml.safe_load(f)["train"]["env"]["difficulty"])
    study = {t["question"] for t in env.sample_tasks(400, split="test", seed=0)}
    rows = [t for t in env.sample_tasks(3 * N_TEST, split="test", seed=PILOT_SEED) if t["question"] not in study]
    atomic_write_jsonl(Path(tasks_dir) / "test.jsonl", rows[:N_TEST], sort_keys=True)
    print(f"pilot: {len(rows[:N_TEST])} held-out problems, none of the study's {len(study)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data/tasks/gsm8k")
