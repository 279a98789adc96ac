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


@pytest.mark.slow
def test_compare_paired_cli_reads_mlflow(tmp_path, monkeypatch) -> None:
    from click.testing import CliRunner
    from mlflow.tracking import MlflowClient

    from composer_plugins.core.cli import load_commands

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("study", artifact_location=str(tmp_path / "mlruns"))
    acc = {
        ("rl_only", 0): 0.10,
        ("rl_only", 1): 0.20,
        ("rl_only", 2): 0.30,
        ("hint", 0): 0.20,
        ("hint", 1): 0.30,
        ("hint", 2): 0.40,
    }
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


def _curve_study(tmp_path, curves, start=0.2):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "evals").mkdir()
    for (v, s), ys in curves.items():
        (tmp_path / "evals" / f"{v}-s{s}.json").write_text(json.dumps({"metrics": {"gsm8k/accuracy": ys[-1]}}))
        run = tmp_path / "runs" / f"{v}-s{s}"
        run.mkdir(parents=True)
        lines = ["step,train/reward,train/heldout/accuracy"]
        lines += [f"{t},0.5,{ys[t // 10 - 1] if t % 10 == 0 else ''}" for t in range(1, 31)]
        run.joinpath("history.csv").write_text("\n".join(lines) + "\n")
        if start is not None:  # what training/lightning/curves.py writes: every curve point, step 0 included
            pts = [(0, start), *((10 * (i + 1), y) for i, y in enumerate(ys))]
            run.joinpath(paired.CURVE_FILE).write_text("step,value\n" + "".join(f"{t},{y}\n" for t, y in pts))
    return paired.read_study_dir(tmp_path)[1]


CURVES = {  # (variant, seed): accuracy at steps 10, 20, 30 (step 0: 0.2, the shared start)
    ("rl_only", 0): (0.2, 0.3, 0.4),
    ("rl_only", 1): (0.1, 0.3, 0.3),
    ("fast", 0): (0.4, 0.4, 0.5),
    ("fast", 1): (0.3, 0.3, 0.4),
    ("slow", 0): (0.1, 0.2, 0.3),
    ("slow", 1): (0.1, 0.3, 0.3),
    ("never", 0): (0.1, 0.2, 0.2),
    ("never", 1): (0.1, 0.1, 0.1),
}


def test_curve_effects_auc_from_step_0_and_time_to_a_fixed_threshold(tmp_path) -> None:
    hist = _curve_study(tmp_path, CURVES)
    assert hist["fast"][0][0] == {"step": 0.0, paired.CURVE: 0.2}  # the start joins the curve at step 0
    eff = {(e.variant, e.metric.split()[-1]): e for e in paired.curve_effects(hist, "rl_only", delta=0.1)}
    # AUC from step 0 (0.2): fast s0 (3 + 4 + 4.5) / 30, rl_only s0 (2 + 2.5 + 3.5) / 30; s1 9/30 vs 6.5/30
    assert eff["fast", "auc"].diffs == pytest.approx([3.5 / 30, 2.5 / 30])
    assert eff["fast", "final"].diffs == pytest.approx([0.1, 0.1])
    # threshold 0.2 + 0.1 for both arms: rl_only reaches it at 20 and 20, fast at 10 and 10, slow at 30 and 20
    ttt = {v: eff[v, "time_to_threshold"] for v in ("fast", "slow", "never")}
    assert ttt["fast"].diffs == [-10.0, -10.0] and ttt["slow"].diffs == [10.0, 0.0]
    assert ttt["fast"].extra["threshold"] == pytest.approx(0.3) and ttt["fast"].extra["censored"] == 0
    # never reaches 0.3: censored at the last step + one interval (40) in both seeds; the baseline never is
    assert ttt["never"].diffs == [20.0, 20.0]
    assert (ttt["never"].extra["censored"], ttt["never"].extra["censored_baseline"]) == (2, 0)
    assert ttt["fast"].lower_is_better and not eff["fast", "auc"].lower_is_better


def test_time_to_threshold_is_symmetric_in_the_two_arms(tmp_path) -> None:
    """Swapping baseline and variant negates every difference (steps to the baseline's own final value did not:
    the baseline reaches its own final by construction, so both orders made the other arm look slower)."""
    hist = _curve_study(tmp_path, CURVES)
    ab = {e.variant: e for e in paired.curve_effects(hist, "rl_only", delta=0.1) if "threshold" in e.metric}
    ba = {e.variant: e for e in paired.curve_effects(hist, "slow", delta=0.1) if "threshold" in e.metric}
    assert ba["rl_only"].diffs == [-d for d in ab["slow"].diffs]
    assert ba["rl_only"].extra["censored_baseline"] == ab["slow"].extra["censored"]


def test_study_report_names_holm_and_the_threshold(tmp_path) -> None:
    _curve_study(tmp_path, CURVES)
    text = paired.study_report(tmp_path, "rl_only", delta=0.1)
    fam = len(paired.study_effects(*paired.read_study_dir(tmp_path), "rl_only", delta=0.1)["curve"]) + 3
    assert f"Holm's family-wise correction over the {fam} tests" in text
    assert "train/heldout/accuracy time_to_threshold" in text and "threshold 0.300" in text
    assert "never 2 / rl_only 0" in text
    assert "| 0 | 0.200 | 0.200 | 0.200 | 0.200 |" in text  # step 0 on the mean curve
    assert "Holm p" in text
    gap = {
        "model": "m",
        "num_prompts": 8,
        "variants": {
            "fast": {"hint": {"margin": -0.2, "fix_rate": 0.6, "coverage": 1.0}},
            "slow": {"hint": {"margin": -0.9, "fix_rate": 0.1, "coverage": 1.0}},
            "never": {"teacher:t": {"margin": -1.5, "fix_rate": 0.0, "coverage": 1.0}},
        },
    }
    text = paired.study_report(tmp_path, "rl_only", delta=0.1, gap=gap)
    assert "| fast | hint | -0.200 | 0.600 | 1.000 | +0.100 |" in text  # beside the final effect (+0.1 both seeds)
    assert "margin r = +1.00 (n = 3)" in text and "fix_rate r = " in text  # numpy.corrcoef: 0.99902


def test_holm_adjusts_the_whole_family_by_hand() -> None:
    base = paired.paired_effect({0: 0.1, 1: 0.2, 2: 0.3}, {0: 0.0, 1: 0.1, 2: 0.25})
    effects = [replace(base, variant=f"v{i}", p=p) for i, p in enumerate([0.01, 0.04, 0.03, 0.005])]
    out = paired.holm(effects)
    # sorted 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04 -> monotone 0.06)
    assert [e.p_adjusted for e in out] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert [e.verdict for e in out] == ["helps", "no measurable effect", "no measurable effect", "helps"]
    assert all(e.family == 4 and e.correction == "holm" for e in out)
    # the smallest p is tested at alpha / 4: its interval uses t(1 - 0.0125 / 2, n - 1)
    half = paired.t_critical(2, 1 - 0.05 / 4) * base.se
    assert out[3].adj_low == pytest.approx(base.mean - half) and out[3].adj_high == pytest.approx(base.mean + half)


def test_an_uncorrected_hurt_that_does_not_survive_the_family_is_no_measurable_effect() -> None:
    """grpo_sdpo of the chain study: [-0.012, -0.000] over 10 seeds read "hurts" alone, not among 18 tests."""
    rl = {s: x / 400 for s, x in enumerate([127, 114, 123, 124, 124, 123, 121, 123, 121, 133])}
    gs = {s: x / 400 for s, x in enumerate([124, 118, 116, 124, 124, 118, 116, 123, 116, 130])}
    e = paired.paired_effect(gs, rl, name="grpo_sdpo")
    assert e.high < 0 and e.verdict == "hurts" and 0.02 < e.p < 0.05
    others = [replace(e, variant=f"null{i}", p=0.5) for i in range(17)]
    corrected = paired.holm([e, *others])[0]
    assert corrected.p_adjusted == pytest.approx(min(1.0, 18 * e.p)) and corrected.verdict == "no measurable effect"


def test_a_variant_that_needs_more_steps_to_reach_the_target_hurts() -> None:
    """Steps to target: an interval above zero is slower (hurts), below zero faster (helps)."""
    slower = paired.paired_effect({0: 30.0, 1: 36.0, 2: 42.0}, {0: 18.0, 1: 24.0, 2: 24.0}, metric="steps")
    assert slower.low > 0 and slower.verdict == "helps"  # read as a score, higher would be better
    assert replace(slower, lower_is_better=True).verdict == "hurts"
    faster = replace(paired.paired_effect({0: 6.0, 1: 12.0, 2: 6.0}, {0: 18.0, 1: 24.0, 2: 24.0}), lower_is_better=True)
    assert faster.high < 0 and faster.verdict == "helps"
    assert paired.verdict(-0.05, -0.01, lower_is_better=True) == "helps"
    assert paired.verdict(-0.01, 0.02, lower_is_better=True) == "no measurable effect"


def test_an_equivalence_margin_makes_four_verdicts_by_hand() -> None:
    """study.equivalence_margin δ: not significant and the Holm-level interval inside (-δ, δ): equivalent; else
    inconclusive; steps to a threshold and the signal table (not accuracies) are never called equivalent."""
    rl = {s: 0.40 + 0.001 * s for s in range(16)}
    near = {s: rl[s] + (0.004 if s % 2 else -0.002) for s in range(16)}  # mean +0.001, sd 0.003
    noisy = {s: rl[s] + (0.06 if s % 2 else -0.058) for s in range(16)}  # mean +0.001, sd 0.06
    far = {s: rl[s] + 0.10 + 0.001 * (s % 3) for s in range(16)}
    recs = [
        {"variant": v, "seed": s, "gsm8k/accuracy": x}
        for v, t in (("rl_only", rl), ("near", near), ("noisy", noisy), ("far", far))
        for s, x in t.items()
    ]
    got = {e.variant: e.verdict for e in paired.study_effects(recs, {}, "rl_only", margin=0.03)["final"]}
    assert got == {"near": "equivalent within ±0.03", "noisy": "inconclusive", "far": "helps"}
    plain = {e.variant: e.verdict for e in paired.study_effects(recs, {}, "rl_only")["final"]}
    assert plain == {"near": "no measurable effect", "noisy": "no measurable effect", "far": "helps"}
    steps = replace(paired.paired_effect(near, rl), lower_is_better=True)
    e = paired.holm([replace(steps, margin=0.0)])[0]
    assert e.verdict == "inconclusive"


def test_equivalence_margin_is_checked_where_it_is_set() -> None:
    from composer_plugins.core.errors import ConfigError
    from composer_plugins.pipeline.study import equivalence_margin

    assert (
        equivalence_margin({"study": {}}) is None
        and equivalence_margin({"study": {"equivalence_margin": 0.03}}) == 0.03
    )
    with pytest.raises(ConfigError, match="study.equivalence_margin"):
        equivalence_margin({"study": {"equivalence_margin": 3}})


def test_two_warm_starts_pool_by_seed_each_against_its_own_start(tmp_path) -> None:
    """study.warm_starts: each SFT warm start is a study of its own seeds; the report pools them by seed, tests
    the baseline against *its seed's* start (rl_only − SFT) and puts each seed's threshold at its own start + δ."""
    a = {("rl_only", 0): (0.3, 0.4, 0.5), ("rl_only", 1): (0.3, 0.4, 0.4), ("fast", 0): (0.5, 0.5, 0.6)}
    a[("fast", 1)] = (0.4, 0.5, 0.6)
    b = {("rl_only", 2): (0.1, 0.2, 0.3), ("rl_only", 3): (0.2, 0.2, 0.3), ("fast", 2): (0.3, 0.4, 0.4)}
    b[("fast", 3)] = (0.2, 0.3, 0.4)
    _curve_study(tmp_path / "a", a, start=0.3)
    _curve_study(tmp_path / "b", b, start=0.1)
    for root, acc in (("a", 0.3), ("b", 0.1)):
        (tmp_path / root / "evals" / "sft.json").write_text(json.dumps({"metrics": {"gsm8k/accuracy": acc}}))
    recs, hist = paired.read_study_dir([tmp_path / "a", tmp_path / "b"])
    assert paired.warm_start_values(recs, "gsm8k/accuracy") == {0: 0.3, 1: 0.3, 2: 0.1, 3: 0.1}
    fam = paired.study_effects(recs, hist, "rl_only", delta=0.1, start=paired.warm_start_values(recs, "gsm8k/accuracy"))
    (control,) = fam["start"]  # rl_only's final accuracy minus its own warm start, seed by seed
    assert (control.variant, control.baseline) == ("rl_only", "sft")
    assert control.diffs == pytest.approx([0.2, 0.1, 0.2, 0.2])
    ttt = next(e for e in fam["curve"] if e.variant == "fast" and "threshold" in e.metric)
    # thresholds 0.4 (a) and 0.2 (b): rl_only reaches them at 20, 20, 20, 10; fast at 10, 10, 10, 10 (one shared
    # threshold, 0.3 + 0.1 from a's start, would have put every b seed of both arms among the censored)
    assert ttt.extra["thresholds"] == pytest.approx({0: 0.4, 1: 0.4, 2: 0.2, 3: 0.2})
    assert ttt.diffs == [-10.0, -10.0, -10.0, 0.0] and ttt.extra["censored"] == ttt.extra["censored_baseline"] == 0
    text = paired.study_report([tmp_path / "a", tmp_path / "b"], "rl_only", delta=0.1)
    assert f"SFT start (warm start {(tmp_path / 'a').as_posix()}): gsm8k/accuracy = 0.3000" in text
    assert "Does RL move the start? rl_only minus its seed's SFT warm start" in text
    assert "| rl_only | sft | gsm8k/accuracy | 4 |" in text
    assert "per seed: 0 0.400, 1 0.400, 2 0.200, 3 0.200;" in text
    # a seed run from both warm starts cannot pair: the error names both directories and the fix
    _curve_study(tmp_path / "c", {("rl_only", 0): (0.1, 0.1, 0.1)}, start=0.1)
    with pytest.raises(ValueError, match=r"seed 0 has cells in both .*a and .*c.*study.seeds"):
        paired.read_study_dir([tmp_path / "a", tmp_path / "c"])


def test_blocked_effect_is_the_mean_of_start_means_with_the_within_start_se_by_hand() -> None:
    """study.blocking: warm_start: two starts whose effects differ (0.31 and 0.12) are one effect, 0.215, whose
    noise is the seeds' spread around their own start's mean, not the gap between the starts."""
    base = dict.fromkeys(range(6), 0.2)
    var = {0: 0.50, 1: 0.52, 2: 0.51, 3: 0.30, 4: 0.32, 5: 0.34}
    blocks = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "b"}
    e = paired.paired_effect(var, base, name="teacher_only", baseline_name="rl_only", blocks=blocks)
    # block means 0.31, 0.12: mean 0.215; within SS 0.0002 + 0.0008 = 0.001 on 6 - 2 = 4 df: s² 0.00025;
    # se = sqrt(s² (1/3 + 1/3)) / 2 = 0.0064550; t(0.975, 4) = 2.7764451
    assert e.mean == pytest.approx(0.215) and e.dof == 4
    assert e.se == pytest.approx(math.sqrt(0.00025 * 2 / 3) / 2)
    assert e.low == pytest.approx(0.215 - 2.7764451 * e.se) and e.high == pytest.approx(0.215 + 2.7764451 * e.se)
    assert e.variant_mean - e.baseline_mean == pytest.approx(e.mean)
    assert e.extra["blocks"]["a"] == {"seeds": [0, 1, 2], "mean": pytest.approx(0.31)}
    pooled = paired.paired_effect(var, base)  # the same seeds as one sample: the gap between starts is noise
    assert pooled.mean == pytest.approx(0.215) and pooled.se > 6 * e.se and pooled.dof == 5
    # Holm's interval takes the blocked test's degrees of freedom (4, not 5)
    (h,) = paired.holm([e])
    assert h.adj_high - h.mean == pytest.approx(paired.t_critical(4, 0.95) * e.se)
    # one start only: the plain paired test; unequal starts weigh the same, not by their seed count
    assert paired.paired_effect(var, base, blocks=dict.fromkeys(range(6), "a")) == pooled
    u = paired.paired_effect({0: 0.3, 1: 0.5, 2: 0.7}, {0: 0.2, 1: 0.2, 2: 0.2}, blocks={0: "a", 1: "a", 2: "b"})
    # block means 0.2 and 0.5: mean 0.35; within SS 0.02 on 1 df; se = sqrt(0.02 (1/2 + 1)) / 2
    assert u.mean == pytest.approx(0.35) and u.dof == 1 and u.se == pytest.approx(math.sqrt(0.03) / 2)
    # one seed a start: no within-start spread, no interval; a seed of no start is an error naming it
    assert math.isnan(paired.paired_effect({0: 0.3, 1: 0.5}, {0: 0.2, 1: 0.2}, blocks={0: "a", 1: "b"}).se)
    with pytest.raises(ValueError, match=r"seed\(s\) \[1\]"):
        paired.paired_effect({0: 0.3, 1: 0.5}, {0: 0.2, 1: 0.2}, blocks={0: "a"})


def test_study_report_blocks_by_warm_start_when_asked(tmp_path) -> None:
    a = {("rl_only", 0): (0.3, 0.4, 0.5), ("rl_only", 1): (0.3, 0.4, 0.4), ("fast", 0): (0.5, 0.5, 0.9)}
    a[("fast", 1)] = (0.4, 0.5, 0.8)
    b = {("rl_only", 2): (0.1, 0.2, 0.3), ("rl_only", 3): (0.2, 0.2, 0.3), ("fast", 2): (0.3, 0.4, 0.4)}
    b[("fast", 3)] = (0.2, 0.3, 0.5)
    _curve_study(tmp_path / "a", a, start=0.3)
    _curve_study(tmp_path / "b", b, start=0.1)
    for root, acc in (("a", 0.3), ("b", 0.1)):
        (tmp_path / root / "evals" / "sft.json").write_text(json.dumps({"metrics": {"gsm8k/accuracy": acc}}))
    roots = [tmp_path / "a", tmp_path / "b"]
    recs, _ = paired.read_study_dir(roots)
    assert paired.seed_blocks(recs) == {
        s: (tmp_path / r).as_posix() for s, r in ((0, "a"), (1, "a"), (2, "b"), (3, "b"))
    }
    plain = paired.study_report(roots, "rl_only", delta=0.1)
    text = paired.study_report(roots, "rl_only", delta=0.1, blocking=True)
    assert "Blocked by warm start" not in plain and "Blocked by warm start (study.blocking)" in text
    assert "Each warm start's mean difference" in text
    # fast − rl_only: a's seeds +0.4, +0.4 and b's +0.1, +0.2: each start's mean, then their mean +0.275
    row = next(line for line in text.splitlines() if line.startswith("| fast | rl_only | +"))
    assert row.rstrip(" |").split(" | ")[2:5] == ["+0.400", "+0.150", "+0.275"]


def test_study_blocking_is_checked_where_it_is_set() -> None:
    from composer_plugins.core.errors import ConfigError
    from composer_plugins.pipeline.study import blocking

    assert blocking({"study": {}}) == "none" and blocking({"study": {"blocking": "warm_start"}}) == "warm_start"
    with pytest.raises(ConfigError, match=r"study.blocking.*warm_start"):
        blocking({"study": {"blocking": "warmstart"}})
