"""The report names what each cell used (from the cell's own config) and writes the evidence: results/paired.json,
the forest plot's rows, the held-out bars and the curves by arm; the root dvc.yaml's plots render them."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from composer_plugins.core.errors import ConfigError
from composer_plugins.pipeline import stage_report, study
from composer_plugins.pipeline.stats import t_critical

ROOT = Path(__file__).resolve().parents[2]
TEACHER = {"kind": "causal_lm", "id": "teacher", "topk": 20}
#: study "a" pools the warm start "b"; every teacher cell of both distils from b's teacher
ACC = {"a": (0.30, {0: (0.50, 0.62), 1: (0.55, 0.66)}), "b": (0.20, {2: (0.40, 0.55), 3: (0.45, 0.57)})}


def _params(teacher: str, sft_seed: int, seeds: list[int], warm: list[str]) -> dict:
    off = {"weight": 1.0, "teachers": [{**TEACHER, "model_path": teacher}]}
    return {
        "mlflow": {"enabled": False},
        "train": {"env": {"name": "gsm8k", "difficulty": "long_columns"}, "sft": {"seed": sft_seed, "steps": 1400}},
        "study": {
            "seeds": seeds,
            "warm_starts": warm,
            "baseline": "rl_only",
            "bars": {"teacher_only": 0.10, "rl_only": 0.05},
            "variants": {
                "rl_only": {"losses": {"grpo": {"weight": 1.0}}},
                "teacher_only": {
                    "rollout": {"on_policy_fraction": 0.0},
                    "losses": {"grpo": {"weight": 0.0}, "teacher_distill": off},
                },
                "grpo_other": {  # a teacher nobody measured
                    "losses": {"grpo": {"weight": 1.0}, "teacher_distill": {**off, "teachers": [{**TEACHER}]}}
                },
            },
        },
    }


def _eval(path: Path, run: str, model: str | None, acc: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    v, _, s = run.rpartition("-s")
    rec = {"run": run, "variant": v or run, "seed": int(s) if s.isdigit() else 0, "channels": "", "model": model}
    path.write_text(json.dumps({**rec, "metrics": {"gsm8k/accuracy": acc}}))


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two warm starts' studies: a (SFT seed 0, its own teacher stage measured 0.845 but used by no cell) and b
    (SFT seed 3, teacher measured 1.000); a's cells distil from ../b/models/teacher/model."""
    for d, (sft, cells) in ACC.items():
        root = tmp_path / d
        teacher = "../b/models/teacher/model" if d == "a" else "models/teacher/model"
        p = _params(teacher, 0 if d == "a" else 3, sorted(cells), ["../b"] if d == "a" else [])
        p["study"]["variants"]["grpo_other"]["losses"]["teacher_distill"]["teachers"][0]["model_path"] = "m/x"
        root.mkdir()
        (root / "params.yaml").write_text(yaml.safe_dump(p))
        _eval(root / "evals" / "sft.json", "sft", "models/sft/model", sft)
        _eval(root / "results" / "teacher.json", "teacher", "models/teacher/model", 0.845 if d == "a" else 1.0)
        for s, accs in cells.items():
            for v, acc in zip(("rl_only", "teacher_only", "grpo_other"), (*accs, accs[0] + 0.01), strict=True):
                _eval(root / "evals" / f"{v}-s{s}.json", f"{v}-s{s}", None, acc)
                run = root / "runs" / f"{v}-s{s}"
                run.mkdir(parents=True)
                rows = "".join(f"{t},{acc * t / 4 + 0.01 * s:.3f},{0.5 - 0.01 * s}\n" for t in range(1, 5))
                (run / "history.csv").write_text("step,train/reward,train/groups_with_signal\n" + rows)
    monkeypatch.chdir(tmp_path / "a")
    stage_report.report(study.load_params("params.yaml"))
    return tmp_path / "a"


def test_paired_json_names_the_starts_every_test_and_the_bars(fake: Path) -> None:
    out = json.loads((fake / "results" / "paired.json").read_text())
    assert out["metric"] == "gsm8k/accuracy" and out["baseline"] == "rl_only"
    assert out["task"] == {"name": "gsm8k", "difficulty": "long_columns"}
    a = {"study": ".", "model": "models/sft/model", "sft_seed": 0, "sft_steps": 1400, "gsm8k/accuracy": 0.3}
    b = {"study": "../b", "model": "../b/models/sft/model", "sft_seed": 3, "sft_steps": 1400, "gsm8k/accuracy": 0.2}
    assert out["starts"] == [{**a, "seeds": [0, 1]}, {**b, "seeds": [2, 3]}]
    tests = {(t["variant"], t["vs"], t["metric"]): t for t in out["tests"]}
    assert len(tests) == len(out["tests"]) == out["family"]
    assert {"variant", "vs", "effect", "lo", "hi", "verdict"} <= set(out["tests"][0])
    # teacher_only - rl_only by hand: per-seed differences 0.12, 0.11, 0.15, 0.12; its Holm-level interval
    diffs = [0.12, 0.11, 0.15, 0.12]
    mean = sum(diffs) / 4
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3 / 4)
    gap = tests[("teacher_only", "rl_only", "gsm8k/accuracy")]
    assert gap["effect"] == pytest.approx(mean, abs=1e-6)
    ps = sorted(t["p"] for t in out["tests"] if t["p"] is not None)
    level = 1 - 0.05 / (len(ps) - ps.index(gap["p"]))
    half = t_critical(3, level) * se
    assert (gap["lo"], gap["hi"]) == (pytest.approx(mean - half, abs=1e-5), pytest.approx(mean + half, abs=1e-5))
    rl = tests[("rl_only", "sft", "gsm8k/accuracy")]  # each seed's rl_only against its own start
    assert rl["effect"] == pytest.approx((0.20 + 0.25 + 0.20 + 0.25) / 4, abs=1e-6)
    # the control's bars: the gap's Holm-level lower bound against 0.10, rl_only - SFT's against 0.05
    bars = {(x["variant"], x["vs"]): x for x in out["bars"]}
    assert bars[("teacher_only", "rl_only")] == {
        "variant": "teacher_only",
        "vs": "rl_only",
        "metric": "gsm8k/accuracy",
        "bar": 0.10,
        "lo": gap["lo"],
        "passes": gap["lo"] >= 0.10,
    }
    assert bars[("rl_only", "sft")]["bar"] == 0.05 and bars[("rl_only", "sft")]["passes"] is (rl["lo"] >= 0.05)
    # the forest plot's rows: every test, named by what the arm does, with its bar
    rows = list(csv.DictReader((fake / "plots" / "effects.csv").open()))
    assert len(rows) == len(out["tests"])
    row = next(r for r in rows if r["test"] == "teacher_only (off-policy distillation) − rl_only" and r["bar"])
    assert float(row["lo"]) == gap["lo"] and float(row["bar"]) == 0.10


def test_each_cell_names_the_teacher_it_used_not_a_stage_sharing_its_name(fake: Path) -> None:
    arms = json.loads((fake / "results" / "paired.json").read_text())["arms"]
    assert arms["teacher_only"]["teachers"] == [{"model": "../b/models/teacher/model", "gsm8k/accuracy": 1.0}]
    assert arms["teacher_only"]["description"] == "off-policy distillation"
    assert arms["teacher_only"]["on_policy_fraction"] == 0.0
    assert arms["teacher_only"]["trains_on"] == "the dataset's reference completions"
    assert arms["teacher_only"]["starts"] == [".", "../b"]
    assert arms["rl_only"]["teachers"] == [] and arms["rl_only"]["description"] == "on-policy RL"
    # b's cells name their teacher relative to b: the same model, seen from a; each start's unmeasured teacher
    assert arms["grpo_other"]["teachers"] == [
        {"model": "m/x", "gsm8k/accuracy": "not measured"},
        {"model": "../b/m/x", "gsm8k/accuracy": "not measured"},
    ]
    metrics = json.loads((fake / "metrics.json").read_text())
    used = {**arms["teacher_only"], "teachers": "../b/models/teacher/model (1.000)", "starts": "., ../b"}
    assert metrics["teacher_only"]["used"] == used  # flat: `dvc metrics show` lists strings, drops lists
    assert "teacher" not in metrics  # three teachers in use: no single teacher row, each variant names its own
    md = (fake / "results" / "paired.md").read_text()
    row = "| teacher_only | off-policy distillation | teacher_distill | the dataset's reference completions | "
    assert row + "../b/models/teacher/model (1.000) | ., ../b |" in md
    assert "| ../b | ../b/models/sft/model | 3 | 1400 | 0.200 | 2, 3 |" in md
    assert "teacher_only distilled from the teacher ../b/models/teacher/model: gsm8k/accuracy 1.000" in md
    assert "grpo_other distilled from the teacher m/x: not measured" in md
    assert "own teacher stage (results/teacher.json: gsm8k/accuracy 0.845) is used by no cell" in md
    assert "on-policy distillation" not in md


def test_the_one_teacher_used_is_metrics_jsons_teacher_row(fake: Path) -> None:
    p = yaml.safe_load(Path("params.yaml").read_text())
    del p["study"]["variants"]["grpo_other"]
    Path("params.yaml").write_text(yaml.safe_dump(p))
    res = stage_report.report(study.load_params("params.yaml"))
    teacher = res["metrics"]["teacher"]
    assert teacher["model"] == "../b/models/teacher/model" and teacher["gsm8k/accuracy"]["mean"] == 1.0
    bars = list(csv.DictReader(Path("plots/heldout.csv").open()))
    assert bars[-1]["variant"] == "teacher ../b/models/teacher/model"
    mean = (0.62 + 0.66 + 0.55 + 0.57) / 4
    row = next(r for r in bars if r["variant"] == "teacher_only (off-policy distillation)")
    assert float(row["accuracy"]) == pytest.approx(mean) and float(row["lo"]) < mean < float(row["hi"])


def test_policy_in_words_and_bars_are_checked() -> None:
    assert [stage_report.policy(f) for f in (1.0, 0.0, 0.25)] == ["on-policy", "off-policy", "mixed (0.25 on-policy)"]
    p = _params("t", 0, [0], [])
    p["study"]["bars"] = {"teacher_onyl": 0.1}
    with pytest.raises(ConfigError, match="teacher_onyl") as e:
        study.bars(p)
    assert "teacher_only" in str(e.value)
    p["study"]["bars"] = {"teacher_only": "high"}
    with pytest.raises(ConfigError, match="study.bars"):
        study.bars(p)


def test_the_root_plots_show_the_forest_the_curves_by_arm_and_the_named_task(
    fake: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], check=True)
    shutil.copytree(ROOT / ".dvc" / "plots", fake / ".dvc" / "plots", dirs_exist_ok=True)
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    Path("dvc.yaml").write_text(yaml.safe_dump({"plots": plots}, allow_unicode=True))
    out = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "--json"], capture_output=True, text=True)
    shown = {k: v[0]["content"] for k, v in json.loads(out.stdout)["data"].items() if v}  # no train/accuracy here
    forest = next(c for k, c in shown.items() if k.startswith("Paired effects"))
    tests = json.loads(Path("results/paired.json").read_text())["tests"]
    values = forest["data"]["values"]
    assert len(values) == len(tests) and {v["test"] for v in values} >= {"rl_only (on-policy RL) − sft"}
    assert sorted(float(v["bar"]) for v in values if v["bar"]) == [0.05, 0.10]
    marks = [layer["mark"]["type"] for layer in forest["spec"]["layer"]]
    assert marks == ["rule", "rule", "point", "tick"]  # zero, the Holm-level interval, the effect, the bar
    assert forest["spec"]["layer"][1]["encoding"]["x2"]["field"] == "hi_"
    # curves: each arm's mean with a stderr band over seeds, titled in words, coloured by what the arm does
    curve = shown["Rollout reward per step (mean ± s.e. over seeds)"]
    band, line = curve["layer"]
    assert band["mark"]["extent"] == "stderr" and line["encoding"]["y"]["aggregate"] == "mean"
    assert curve["encoding"]["color"]["field"] == "arm_" and curve["encoding"]["color"]["legend"]["labelLimit"] == 0
    arms = {v["arm"] for v in curve["data"]["values"]}
    assert "teacher_only (off-policy distillation)" in arms and len(curve["data"]["values"]) == 3 * 4 * 4
    for k in shown:  # the directory's charts too: one per series, titled in words, not with a file path
        if k.startswith("plots/curves/"):
            assert shown[k]["title"].startswith("Every per-step series") and shown[k]["layer"][1]["mark"]["type"]
    heldout = shown["Held-out accuracy per variant"]
    assert heldout["title"] == "Held-out accuracy on the long_columns level (mean ± s.e. over seeds)"
    assert "GSM8K" not in json.dumps(shown)
