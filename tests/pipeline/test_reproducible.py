"""The main job reproduces bit for bit: what DVC pins holds no clock reading, git ignores every output, the locks
name the stages they pin (docs/pipeline.md, "Reproducibility"; .ci/run reproduces the CI-sized lock)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import yaml

from composer_plugins.core.io import is_wall_clock
from composer_plugins.pipeline.stage_pairs import _pinned
from composer_plugins.training.lightning.trainer import HistoryCallback

ROOT = Path(__file__).resolve().parents[2]


def test_history_and_run_metrics_keep_no_clock_reading(tmp_path: Path) -> None:
    cb = HistoryCallback(tmp_path / "history.csv")
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(_should_accumulate=lambda: False), global_step=1, global_rank=0, ckpt_path=None
    )
    module = SimpleNamespace(last_step_stats={"reward": 0.5, "teacher/wait_s": 0.02, "teacher/t/seconds": 0.01})
    cb.on_train_start(trainer, module)
    cb.on_train_batch_end(trainer, module, None, None, 0)
    assert cb.rows == [{"step": 1, "train/reward": 0.5}]
    assert (tmp_path / "history.csv").read_text().splitlines() == ["step,train/reward", "1,0.5"]
    assert not is_wall_clock("train/reward") and not is_wall_clock("train/teacher/skipped")


def test_pairs_stats_drop_elapsed_and_keep_paths_relative(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "pkg" / "recipes" / "pairs.yaml"
    summary = {
        "normalize": {"recipe": str(recipe), "elapsed_s": 1.5, "n_out": 3},
        "replay": {"elapsed_s": 9.8, "by_teacher": {"a": {"calls": 4}}},
        "examples": [{"elapsed_s": 1.0, "id": 1}],
    }
    assert _pinned(summary) == {
        "normalize": {"recipe": os.path.join("pkg", "recipes", "pairs.yaml"), "n_out": 3},
        "replay": {"by_teacher": {"a": {"calls": 4}}},
        "examples": [{"id": 1}],
    }


def _lock_stages(path: Path) -> set[str]:
    return set(yaml.safe_load(path.read_text())["stages"])


def _stage_names(params: dict) -> set[str]:
    """The stage names dvc.yaml expands to under ``params`` (its matrix: study.variants x study.seeds)."""
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    names = {n for n, s in spec.items() if "matrix" not in s}
    cells = [f"{v}-{s}" for v in params["study"]["variants"] for s in params["study"]["seeds"]]
    return names | {f"{n}@{c}" for n, s in spec.items() if "matrix" in s for c in cells}


def test_locks_pin_the_main_job_and_its_ci_size() -> None:
    from composer_plugins.pipeline.study import merge_params

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert _lock_stages(ROOT / "dvc.lock") == _stage_names(params), "regenerate dvc.lock: `dvc repro` (README)"
    ci = merge_params(params, yaml.safe_load((ROOT / "tests" / "pipeline" / "params.ci.yaml").read_text()))
    ci_lock = ROOT / "tests" / "pipeline" / "dvc.ci.lock"
    assert _lock_stages(ci_lock) == _stage_names(ci), "regenerate tests/pipeline/dvc.ci.lock (docs/pipeline.md)"


def _uncached_patterns() -> list[re.Pattern[str]]:
    """dvc.yaml's ``cache: false`` outs and metrics, as patterns over the lock's paths (``${...}`` matches anything)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    found = []
    for stage in stages.values():
        for entry in [*stage.get("outs", []), *stage.get("metrics", [])]:
            if isinstance(entry, dict):
                ((path, opts),) = entry.items()
                if (opts or {}).get("cache") is False:
                    found.append(re.compile("^" + re.sub(r"\\\$\\\{[^}]*\\\}", ".+", re.escape(path)) + "$"))
    return found


def test_cached_outputs_are_ignored_and_uncached_ones_committed() -> None:
    """The cached outputs (models, data, runs) are ignored by git; the uncached ones (metrics, evals, plots data,
    reports) are committed with the lock, so `dvc metrics diff HEAD` and `dvc exp show` have main to compare with."""
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]
    outs = sorted({o["path"] for stage in lock.values() for o in stage.get("outs", [])})
    uncached = [o for o in outs if any(p.match(o) for p in _uncached_patterns())]
    cached = [o for o in outs if o not in uncached]
    assert "metrics.json" in uncached and "results/paired.json" in uncached and "models/sft" in cached
    res = subprocess.run(["git", "check-ignore", "--no-index", *cached], cwd=ROOT, capture_output=True, text=True)
    assert sorted(res.stdout.split()) == cached, f"not ignored by git: {sorted(set(cached) - set(res.stdout.split()))}"
    res = subprocess.run(["git", "check-ignore", "--no-index", *uncached], cwd=ROOT, capture_output=True, text=True)
    assert res.stdout.split() == [], f"ignored by git, so not committed: {res.stdout.split()}"
    tracked = subprocess.run(["git", "ls-files", "--", *uncached], cwd=ROOT, capture_output=True, text=True).stdout
    missing = [o for o in uncached if not any(line == o or line.startswith(o + "/") for line in tracked.split())]
    assert not missing, f"commit them with dvc.lock: {missing}"
