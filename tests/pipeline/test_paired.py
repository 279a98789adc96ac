"""Paired statistics of the study (composer_plugins.pipeline.paired) against hand-computed cases."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from composer_plugins.pipeline import paired


def test_paired_effect_matches_hand_computation() -> None:
    base = {0: 0.10, 1: 0.20, 2: 0.30, 3: 0.40, 4: 0.50}
    var = {0: 0.12, 1: 0.24, 2: 0.30, 3: 0.46, 4: 0.53, 9: 0.99}  # seed 9 has no pair: ignored
    e = paired.paired_effect(var, base, name="hint", baseline_name="rl_only", metric="gsm8k/accuracy")
    # diffs 0.02 0.04 0.00 0.06 0.03: mean 0.03, squared deviations sum 0.002, sd sqrt(0.0005), se 0.01
    assert e.seeds == [0, 1, 2, 3, 4]
    assert e.diffs == pytest.approx([0.02, 0.04, 0.0, 0.06, 0.03])
    assert e.mean == pytest.approx(0.03)
    assert e.se == pytest.approx(0.01)
    # t(0.975, df=4) = 2.7764451 (statistical tables)
    assert e.low == pytest.approx(0.03 - 0.027764451, abs=1e-7)
    assert e.high == pytest.approx(0.03 + 0.027764451, abs=1e-7)
    assert e.verdict == "helps"
    assert e.variant_mean == pytest.approx(0.33) and e.baseline_mean == pytest.approx(0.30)


def test_t_critical_values_and_verdicts() -> None:
    assert paired.t_critical(1) == pytest.approx(12.7062047, abs=1e-6)
    assert paired.t_critical(9) == pytest.approx(2.2621572, abs=1e-6)
    with pytest.raises(ValueError, match="degree of freedom"):
        paired.t_critical(0)
    assert paired.verdict(-0.01, 0.02) == "no measurable effect"
    assert paired.verdict(-0.05, -0.01) == "hurts"
    assert paired.verdict(math.nan, math.nan) == "too few seeds"


def test_one_seed_has_no_interval_and_disjoint_seeds_are_an_error() -> None:
    e = paired.paired_effect({3: 0.5}, {3: 0.25})
    assert e.mean == 0.25 and math.isnan(e.se) and e.verdict == "too few seeds"
    with pytest.raises(ValueError, match="share no seed"):
        paired.paired_effect({0: 0.5}, {1: 0.5}, name="a", baseline_name="b")


def test_heldout_se_is_binomial() -> None:
    assert paired.heldout_se(0.5, 400) == pytest.approx(0.025)
    assert paired.heldout_se(0.1, 900) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="at least one problem"):
        paired.heldout_se(0.5, 0)


def test_paired_rows_from_records_and_table() -> None:
    recs = [
        {"variant": "rl_only", "seed": 0, "gsm8k/accuracy": 0.10},
        {"variant": "rl_only", "seed": 1, "gsm8k/accuracy": 0.20},
        {"variant": "hint", "seed": 0, "gsm8k/accuracy": 0.10},
        {"variant": "hint", "seed": 1, "gsm8k/accuracy": 0.30},
        {"variant": "hint", "seed": 1, "gsm8k/accuracy": 0.90},  # an older run of the same cell: ignored
        {"variant": "sft", "seed": 0, "gsm8k/accuracy": 0.05},
    ]
    (e,) = paired.paired_rows(recs, "gsm8k/accuracy", "rl_only")
    assert e.variant == "hint" and e.diffs == pytest.approx([0.0, 0.1])
    # se = sd/sqrt(2) = 0.05; t(0.975, 1) = 12.706
    assert e.se == pytest.approx(0.05) and e.high == pytest.approx(0.05 + 12.7062047 * 0.05, abs=1e-6)
    md = paired.format_paired([e], "markdown", heldout_n=400)
    assert "| hint | rl_only | gsm8k/accuracy | 2 |" in md and "no measurable effect" in md
    assert "held-out se (m=400)" in md
    with pytest.raises(ValueError, match="variants: \\['hint', 'rl_only', 'sft'\\]"):
        paired.paired_rows(recs, "gsm8k/accuracy", "full")


def test_study_report_reads_evals_and_histories(tmp_path) -> None:
    (tmp_path / "evals").mkdir()
    acc = {("rl_only", 0): 0.10, ("rl_only", 1): 0.20, ("hint", 0): 0.15, ("hint", 1): 0.25}
    for (v, s), a in acc.items():
        (tmp_path / "evals" / f"{v}-s{s}.json").write_text(json.dumps({"metrics": {"gsm8k/accuracy": a}}))
        run = tmp_path / "runs" / f"{v}-s{s}"
        run.mkdir(parents=True)
        sig = 0.5 if v == "hint" else 0.25
        run.joinpath("history.csv").write_text(f"step,groups_with_signal\n1,{sig}\n2,{sig / 2}\n")
    (tmp_path / "evals" / "sft.json").write_text(json.dumps({"metrics": {"gsm8k/accuracy": 0.05}}))
    text = paired.study_report(tmp_path, "rl_only", heldout_n=100)
    assert "SFT start: gsm8k/accuracy = 0.0500 (held-out se 0.0218)" in text
    assert "| hint | rl_only | gsm8k/accuracy | 2 | 0.200 | 0.150 | 0.036 | +0.050 | 0.000 |" in text
    assert "| hint | rl_only | train/groups_with_signal (run mean) | 2 | 0.375 | 0.188 | +0.188 |" in text
    assert "| step | hint | rl_only |" in text and "| 1 | 0.500 | 0.250 |" in text  # sorted run dirs
    # the command line: the same report, and both plots under the given prefix
    paired.main([str(tmp_path), "rl_only", "100", "--plots", str(tmp_path / "img"), "--prefix", "medium"])
    for name in ("medium_accuracy.png", "medium_groups_with_signal.png"):
        assert (tmp_path / "img" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="--prefix needs a value"):
        paired.main([str(tmp_path), "--plots", str(tmp_path / "img"), "--prefix"])


def test_compare_paired_cli_reads_mlflow(tmp_path, monkeypatch) -> None:
    from click.testing import CliRunner
    from mlflow.tracking import MlflowClient

    from composer_plugins.core.cli import load_commands

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("study", artifact_location=str(tmp_path / "mlruns"))
    acc = {("rl_only", 0): 0.10, ("rl_only", 1): 0.20, ("rl_only", 2): 0.30,
           ("hint", 0): 0.20, ("hint", 1): 0.30, ("hint", 2): 0.40}  # fmt: skip
    for (v, s), a in acc.items():
        r = client.create_run(exp_id, tags={"dvc.stage": f"eval@{v}-s{s}"})
        for k, x in (("study.channels", v), ("study.seed", s), ("study.variant", v)):
            client.log_param(r.info.run_id, k, x)
        client.log_metric(r.info.run_id, "gsm8k/accuracy", a)
        client.set_terminated(r.info.run_id, "FINISHED")
    monkeypatch.chdir(tmp_path)
    cli = load_commands()
    args = ["compare", "--tracking-uri", uri, "--experiment", "study", "--paired", "--format", "json"]
    res = CliRunner().invoke(cli, [*args, "--baseline-variant", "rl_only"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)
    assert row["variant"] == "hint" and row["n"] == 3 and row["mean"] == pytest.approx(0.1)
    assert row["se"] == pytest.approx(0.0, abs=1e-9) and row["verdict"] == "helps"
    bad = CliRunner().invoke(cli, [*args, "--baseline-variant", "full"])
    assert bad.exit_code != 0 and "variants: ['hint', 'rl_only']" in bad.output


def test_an_effect_below_the_heldout_error_is_flagged() -> None:
    e = paired.paired_effect({0: 0.008, 1: 0.0085, 2: 0.009}, {0: 0.005, 1: 0.005, 2: 0.0055})
    assert e.verdict == "helps"
    assert "helps (but |effect| < held-out se)" in paired.format_paired([e], "text", heldout_n=400)
    assert "(but" not in paired.format_paired([e], "text", heldout_n=40000)


def test_curve_auc_and_steps_to_target_by_hand() -> None:
    pts = [(10, 0.2), (20, 0.4), (30, 0.4)]
    assert paired.curve_auc(pts) == pytest.approx((10 * 0.3 + 10 * 0.4) / 20)
    assert paired.curve_auc(pts, start=0.0) == pytest.approx((10 * 0.1 + 10 * 0.3 + 10 * 0.4) / 30)
    assert paired.curve_auc([(5, 0.7)]) == 0.7 and math.isnan(paired.curve_auc([]))
    assert paired.steps_to_target(pts, 0.4) == (20.0, True)
    assert paired.steps_to_target(pts, 0.5) == (40.0, False)  # censored: last step + one interval
    rows = [{"step": 1.0, "train/reward": 0.1}, {"step": 10.0, paired.CURVE: 0.2}, {"step": 20.0, paired.CURVE: 0.4}]
    assert paired.curve_points(rows) == [(10, 0.2), (20, 0.4)]


def test_curve_effects_pair_auc_and_steps_to_the_baselines_final_value(tmp_path) -> None:
    curves = {  # (variant, seed): accuracy at steps 10, 20, 30
        ("rl_only", 0): (0.2, 0.3, 0.4), ("rl_only", 1): (0.1, 0.3, 0.3),
        ("fast", 0): (0.4, 0.4, 0.5), ("fast", 1): (0.3, 0.3, 0.4),
        ("slow", 0): (0.1, 0.2, 0.3), ("slow", 1): (0.1, 0.3, 0.3),
    }  # fmt: skip
    (tmp_path / "evals").mkdir()
    for (v, s), ys in curves.items():
        (tmp_path / "evals" / f"{v}-s{s}.json").write_text(json.dumps({"metrics": {"gsm8k/accuracy": ys[-1]}}))
        run = tmp_path / "runs" / f"{v}-s{s}"
        run.mkdir(parents=True)
        lines = ["step,train/reward,train/heldout/accuracy"]
        lines += [f"{t},0.5,{ys[t // 10 - 1] if t % 10 == 0 else ''}" for t in range(1, 31)]
        run.joinpath("history.csv").write_text("\n".join(lines) + "\n")
    _, hist = paired.read_study_dir(tmp_path)
    eff = {(e.variant, e.metric.split()[-1]): e for e in paired.curve_effects(hist, "rl_only")}
    fast_auc = [(0.4 + 0.4) / 2 * 0.5 + (0.4 + 0.5) / 2 * 0.5, (0.3 + 0.3) / 2 * 0.5 + (0.3 + 0.4) / 2 * 0.5]
    base_auc = [(0.25 + 0.35) / 2, (0.2 + 0.3) / 2]
    assert eff["fast", "auc"].diffs == pytest.approx([f - b for f, b in zip(fast_auc, base_auc, strict=True)])
    assert eff["fast", "final"].diffs == pytest.approx([0.1, 0.1])
    # rl_only reaches its own final value at step 30 (seed 0) and 20 (seed 1); fast at 10 and 10
    assert (
        eff["fast", "steps_to_target"].diffs == [-20.0, -10.0] and eff["fast", "steps_to_target"].extra["censored"] == 0
    )
    # slow never reaches 0.4 at seed 0: censored at 40
    assert eff["slow", "steps_to_target"].diffs == [10.0, 0.0] and eff["slow", "steps_to_target"].extra["censored"] == 1
    # fewer steps is better: only steps_to_target reads its interval the other way round
    assert eff["fast", "steps_to_target"].lower_is_better and not eff["fast", "auc"].lower_is_better
    text = paired.study_report(tmp_path, "rl_only")
    assert "train/heldout/accuracy auc" in text and "censored (never reached the target): fast 0, slow 1" in text
    assert "| 10 | 0.350 | 0.150 | 0.100 |" in text  # the mean curve per evaluated step


def test_a_variant_that_needs_more_steps_to_reach_the_target_hurts() -> None:
    """Steps to target: an interval above zero is slower (hurts), below zero faster (helps)."""
    slower = paired.paired_effect({0: 30.0, 1: 36.0, 2: 42.0}, {0: 18.0, 1: 24.0, 2: 24.0}, metric="steps")
    assert slower.low > 0 and slower.verdict == "helps"  # read as a score, higher would be better
    assert replace(slower, lower_is_better=True).verdict == "hurts"
    faster = replace(paired.paired_effect({0: 6.0, 1: 12.0, 2: 6.0}, {0: 18.0, 1: 24.0, 2: 24.0}), lower_is_better=True)
    assert faster.high < 0 and faster.verdict == "helps"
    assert paired.verdict(-0.05, -0.01, lower_is_better=True) == "helps"
    assert paired.verdict(-0.01, 0.02, lower_is_better=True) == "no measurable effect"
