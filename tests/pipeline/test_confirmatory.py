"""The confirmatory design's analysis (``study.blocking: random_start``), its control's verdict on every channel,
and the prepare stage's ``exclude`` (a test set held out from a pilot's problems by construction)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from composer_plugins.core.errors import ConfigError
from composer_plugins.pipeline import paired, stage_report, study
from composer_plugins.pipeline.crossed import crossed_effect
from composer_plugins.pipeline.stage_prepare import prepare
from composer_plugins.pipeline.stats import t_critical


def test_crossed_effect_adds_the_starts_and_the_problems_variance_by_hand() -> None:
    # three starts (a: seeds 0, 1; b: 2; c: 3), four problems
    base = {0: [1, 0, 0, 1], 1: [1, 0, 1, 1], 2: [0, 0, 0, 1], 3: [1, 1, 0, 0]}
    var = {0: [1, 1, 0, 1], 1: [1, 1, 1, 1], 2: [1, 1, 0, 1], 3: [1, 1, 1, 0]}
    blocks = {0: "a", 1: "a", 2: "b", 3: "c"}
    e = crossed_effect(var, base, blocks, name="teacher_only", baseline_name="rl_only")
    # per-problem differences: a (mean of seeds 0, 1) [0, 1, 0, 0]; b [1, 1, 0, 0]; c [0, 0, 1, 0]
    # start means 0.25, 0.5, 0.25: effect 1/3; per-problem mean over starts [1/3, 2/3, 1/3, 0]
    assert e.mean == pytest.approx(1 / 3) and e.dof == 2
    s_starts = math.sqrt(((0.25 - 1 / 3) ** 2 * 2 + (0.5 - 1 / 3) ** 2) / 2 / 3)
    d = [1 / 3, 2 / 3, 1 / 3, 0.0]
    s_problems = math.sqrt(sum((x - 1 / 3) ** 2 for x in d) / 3 / 4)
    assert e.extra["se_starts"] == pytest.approx(s_starts) and e.extra["se_problems"] == pytest.approx(s_problems)
    assert e.se == pytest.approx(math.hypot(s_starts, s_problems))
    assert e.high - e.mean == pytest.approx(t_critical(2) * e.se)
    assert e.extra["blocks"]["a"] == {"seeds": [0, 1], "mean": pytest.approx(0.25)}
    assert e.variant_mean - e.baseline_mean == pytest.approx(e.mean)
    # one start: no spread of starts to estimate; mismatched problem counts and seeds of no start are errors
    assert math.isnan(crossed_effect(var, base, dict.fromkeys(range(4), "a")).se)
    with pytest.raises(ValueError, match="different numbers of problems"):
        crossed_effect({0: [1, 0]}, {0: [1, 0, 1]}, {0: "a"})
    with pytest.raises(ValueError, match=r"seed\(s\) \[3\]"):
        crossed_effect(var, base, {0: "a", 1: "a", 2: "b"})


def _start(
    root: Path, sft_seed: int, seeds: list[int], warm: list[str], cells: dict[str, str], sft: str, **more: str
) -> None:
    off = {"weight": 1.0, "teachers": [{"kind": "causal_lm", "id": "t", "topk": 20, "model_path": "m/t"}]}
    params = {
        "mlflow": {"enabled": False},
        "train": {"env": {"name": "gsm8k"}, "sft": {"seed": sft_seed, "steps": 10}},
        "study": {
            "seeds": seeds,
            "warm_starts": warm,
            "baseline": "rl_only",
            "blocking": "random_start",
            **more,
            "equivalence_margin": 0.03,
            "bars": {"teacher_only": 0.10, "rl_only": 0.05},
            "variants": {
                "rl_only": {"losses": {"grpo": {"weight": 1.0}}},
                "teacher_only": {"losses": {"grpo": {"weight": 0.0}, "teacher_distill": off}},
                "grpo_hint": {"losses": {"grpo": {"weight": 1.0}}},
            },
        },
    }
    root.mkdir(parents=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    (root / "evals").mkdir()

    def write(run: str, bits: str) -> None:
        v, _, s = run.rpartition("-s")
        rec = {"run": run, "variant": v or run, "seed": int(s) if s.isdigit() else 0, "channels": "", "model": None}
        acc = bits.count("1") / len(bits)
        (root / "evals" / f"{run}.json").write_text(
            json.dumps({**rec, "metrics": {"gsm8k/accuracy": acc}, "correct": {"gsm8k": bits}})
        )

    write("sft", sft)
    for s in seeds:
        for v, bits in cells.items():
            write(f"{v}-s{s}", bits)


def test_random_start_report_tests_only_final_accuracy_and_a_failed_control_uncalibrates_every_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 40
    # the control fails its gap bar: teacher_only is only a few problems ahead of rl_only on every start
    starts = {
        "a": (
            "0" * n,
            {"rl_only": "1" * 20 + "0" * 20, "teacher_only": "1" * 22 + "0" * 18, "grpo_hint": "1" * 30 + "0" * 10},
        ),
        "b": (
            "0" * n,
            {"rl_only": "1" * 18 + "0" * 22, "teacher_only": "1" * 21 + "0" * 19, "grpo_hint": "1" * 27 + "0" * 13},
        ),
        "c": (
            "1" + "0" * (n - 1),
            {"rl_only": "1" * 21 + "0" * 19, "teacher_only": "1" * 22 + "0" * 18, "grpo_hint": "1" * 31 + "0" * 9},
        ),
    }
    for i, (d, (sft, cells)) in enumerate(starts.items()):
        _start(tmp_path / d, 10 + i, [i], ["../b", "../c"] if d == "a" else [], cells, sft)
    monkeypatch.chdir(tmp_path / "a")
    params = study.load_params("params.yaml")
    assert study.blocking(params) == "random_start"
    stage_report.report(params)
    out = json.loads(Path("results/paired.json").read_text())
    # the family: the two channels' final accuracy and rl_only's move from its start, nothing else
    assert {(t["variant"], t["vs"]) for t in out["tests"]} == {
        ("teacher_only", "rl_only"),
        ("grpo_hint", "rl_only"),
        ("rl_only", "sft"),
    } and out["family"] == 3
    gap = next(t for t in out["tests"] if t["variant"] == "teacher_only")
    recs, _ = paired.read_study_dir([Path("."), Path("../b"), Path("../c")])
    problems = paired.problem_scores(recs, "gsm8k/accuracy")
    e = crossed_effect(problems["teacher_only"], problems["rl_only"], paired.seed_blocks(recs))
    assert gap["effect"] == pytest.approx(e.mean, abs=1e-6) and gap["per_start"] == {
        ".": 0.05,
        "../b": 0.075,
        "../c": 0.025,
    }
    assert out["control"]["passes"] is False and "fails" in out["control"]["text"]
    hint = next(t for t in out["tests"] if t["variant"] == "grpo_hint")
    assert hint["verdict"].startswith("uncalibrated: ")
    assert not next(t for t in out["tests"] if t["variant"] == "rl_only")["verdict"].startswith("uncalibrated")
    text = Path("results/paired.md").read_text()
    assert "**The positive control fails" in text and "uncalibrated" in text
    assert "Starts and problems random (study.blocking: random_start)" in text


def test_study_blocking_values() -> None:
    assert study.blocking({"study": {}}) == "none"
    assert study.blocking({"study": {"blocking": "random_start"}}) == "random_start"
    with pytest.raises(ConfigError, match=r"study.blocking.*random_start"):
        study.blocking({"study": {"blocking": "random"}})


def test_prepare_exclude_keeps_a_pilots_problems_out_of_every_split(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    env = {"name": "gsm8k", "difficulty": "columns"}
    pilot = prepare({"data": {"seed": 1, "gsm8k": {"env": env, "train": 0, "test": 50}}}, "pilot")
    assert pilot["envs"]["gsm8k"]["test"]["n"] == 50
    # the same seed: without exclude the study would draw the pilot's 50 problems again
    params = {
        "data": {"seed": 1, "gsm8k": {"env": env, "train": 20, "test": 60, "exclude": ["pilot/gsm8k/test.jsonl"]}}
    }
    man = prepare(params, "tasks")
    seen = {json.loads(x)["question"] for x in Path("pilot/gsm8k/test.jsonl").read_text().splitlines()}
    test = [json.loads(x)["question"] for x in Path("tasks/gsm8k/test.jsonl").read_text().splitlines()]
    assert len(test) == 60 and not seen & set(test)
    assert man["envs"]["gsm8k"]["exclude"] == {"files": ["pilot/gsm8k/test.jsonl"], "questions": 50}
    prepare({"data": {"seed": 1, "gsm8k": {"env": env, "train": 0, "test": 110}}}, "plain")
    plain_q = [json.loads(x)["question"] for x in Path("plain/gsm8k/test.jsonl").read_text().splitlines()]
    assert test == [q for q in plain_q if q not in seen][:60]  # the generator's stream, the pilot's left out
    with pytest.raises(ConfigError, match=r"data.gsm8k.exclude\[0\]"):
        prepare({"data": {"gsm8k": {"env": env, "train": 1, "test": 1, "exclude": ["nope.jsonl"]}}}, "x")


def test_the_confirmatory_design_is_five_starts_of_one_recipe_on_a_fresh_test_set() -> None:
    from composer_plugins.pipeline import stages
    from composer_plugins.training.config.train import train_config_from_dict

    root = Path(__file__).resolve().parents[2] / "studies"
    dirs = ["confirm", "confirm_b", "confirm_c", "confirm_d", "confirm_e"]
    ps = {d: study.load_params(root / d / "params.yaml") for d in dirs}
    main = ps["confirm"]
    assert (
        study.control(main) == "each_start"
        and study.blocking(main) == "random_start"
        and study.bars(main) == {"teacher_only": 0.10, "rl_only": 0.05}
    )
    assert main["study"]["warm_starts"] == [f"../{d}" for d in dirs[1:]]
    assert list(study.variants(main)) == [
        *("rl_only", "teacher_only", "grpo_teacher", "grpo_hint", "srpo", "grpo_step_check", "grpo_replay", "full")
    ]
    # five distinct SFT seeds and RL seeds, one recipe: every other setting is start 1's
    assert sorted(p["train"]["sft"]["seed"] for p in ps.values()) == [101, 102, 103, 104, 105]
    assert len({s for p in ps.values() for s in study.seeds(p)}) == 5
    for d, p in ps.items():
        assert {k: v for k, v in p["train"]["sft"].items() if k != "seed"} == {
            k: v for k, v in main["train"]["sft"].items() if k != "seed"
        }, d
        assert p["data"] == main["data"] and p["train"]["sft"]["slip_rate"] == 0.7
        assert p["data"]["seed"] not in (0, 5150, 2026), "a data seed an earlier run or the pilot used"
        for v in study.variants(p):  # every cell's config is valid, and every teacher cell uses start 1's teacher
            cfg = stages.train_config(p, v, study.seeds(p)[0])
            train_config_from_dict(cfg)
            for t in (cfg["losses"].get("teacher_distill") or {}).get("teachers", []):
                assert (root / d / t["model_path"]).resolve() == (root / "confirm/models/teacher/model").resolve()


def test_each_start_control_applies_the_bars_to_every_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """study.control: each_start: the control's two tests are also made within each start (the problems as the
    sample) and pass only where every start's Holm-level lower bound reaches its bar; one weak start fails it."""
    n = 200

    def bits(k: int) -> str:
        return "1" * k + "0" * (n - k)

    starts = {  # teacher_only − rl_only: +0.40, +0.35, +0.12 (c is weak); rl_only − sft: +0.30 each
        "a": (bits(20), {"rl_only": bits(80), "teacher_only": bits(160), "grpo_hint": bits(82)}),
        "b": (bits(30), {"rl_only": bits(90), "teacher_only": bits(160), "grpo_hint": bits(90)}),
        "c": (bits(40), {"rl_only": bits(100), "teacher_only": bits(124), "grpo_hint": bits(101)}),
    }
    for i, (d, (sft, cells)) in enumerate(starts.items()):
        _start(tmp_path / d, 10 + i, [i], ["../b", "../c"] if d == "a" else [], cells, sft, control="each_start")
    monkeypatch.chdir(tmp_path / "a")
    params = study.load_params("params.yaml")
    assert study.control(params) == "each_start"
    stage_report.report(params)
    out = json.loads(Path("results/paired.json").read_text())
    per = {(t["variant"], t["start"]): t for t in out["tests"] if "start" in t}
    assert set(per) == {(v, s) for v in ("teacher_only", "rl_only") for s in (".", "../b", "../c")}
    assert out["family"] == 3 + 6
    assert per[("teacher_only", "../c")]["effect"] == pytest.approx(0.12)
    # c's gap: 24 of 200 problems differ, all one way: se = sd/sqrt(200); its Holm-level bound is under 0.10
    assert per[("teacher_only", ".")]["passes"] and not per[("teacher_only", "../c")]["passes"]
    assert all(per[("rl_only", s)]["passes"] for s in (".", "../b", "../c"))
    assert out["control"]["passes"] is False
    assert "teacher_only − rl_only on each of 3 starts" in out["control"]["text"] and "../c" in out["control"]["text"]
    assert {b.get("start") for b in out["bars"]} >= {".", "../b", "../c"}
    assert "within each warm start" in Path("results/paired.md").read_text()
    with pytest.raises(ConfigError, match="study.control"):
        study.control({"study": {"control": "each_start"}})  # needs random_start
