"""The pilot's problems: a slice of train-split computations held out from the pilot's own training.

The chain study holds out 400 of the level's ~437 test-split computations (data seed 0), so the test split
has too few left for a pilot. The pilot therefore reserves its own held-out slice from the *train* split:
the train computations whose salted hash falls in 15% of the keys. ``data/tasks/gsm8k/train.jsonl`` loses
every row computing one of them (the pilot's student, teacher and RL never see them) and ``test.jsonl``
becomes 400 distinct such computations. No pilot number is measured on a problem of the study's held-out
set, and the pilot never trains on what it evaluates. Run from studies/pilot/ after ``composer-plugins prepare``:

    python pilot_tasks.py data/tasks/gsm8k
"""

from __future__ import annotations

import sys
from pathlib import Path

from composer_plugins.core.io import atomic_write_jsonl, read_jsonl
from composer_plugins.envs.arith import split_of
from composer_plugins.envs.gsm8k import GSM8KEnv
from composer_plugins.envs.steps import computation_key

SALT, FRACTION, N_TEST, PILOT_SEED, DRAW = "pilot|", 0.15, 400, 7, 20000


def main(tasks_dir: str) -> None:
    d = Path(tasks_dir)
    env = GSM8KEnv(difficulty="chain")
    study_test = {computation_key(t["solution"]) for t in env.sample_tasks(400, split="test", seed=0)}
    held = lambda k: split_of(SALT + k, FRACTION) == "test"  # noqa: E731
    train = [t for t in read_jsonl(d / "train.jsonl") if not held(computation_key(t["solution"]))]
    rows, seen = [], set()
    for t in env.sample_tasks(DRAW, split="train", seed=PILOT_SEED):
        k = computation_key(t["solution"])
        if held(k) and k not in seen and k not in study_test:
            seen.add(k)
            rows.append(t)
        if len(rows) == N_TEST:
            break
    atomic_write_jsonl(d / "train.jsonl", train, sort_keys=True)
    atomic_write_jsonl(d / "test.jsonl", rows, sort_keys=True)
    print(
        f"pilot: {len(train)} train rows, {len(rows)} held-out problems (distinct computations held out of the "
        f"pilot's train, none of the study's {len(study_test)} test computations)"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data/tasks/gsm8k")
