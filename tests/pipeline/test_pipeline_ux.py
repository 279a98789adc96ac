"""What a DVC/MLflow user sees: one metric naming scheme, a plot per channel series, compare with the baseline
beside each experiment, and `dvc metrics show` without warnings. Real DVC and a real MLflow (sqlite) store."""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from composer_plugins import procs
from composer_plugins.core.cli import load_commands
from composer_plugins.pipeline import stages, study

ROOT = Path(__file__).resolve().parents[2]
DVC = Path(sys.executable).parent / "dvc"


def test_old_metric_names_map_onto_the_one_scheme():
    c = study.canonical_metric
    assert c("gsm8k/pass@1") == c("gsm8k/pass_at_1") == "gsm8k/pass_at_1"
    assert c("code_pass_at_1") == "code/pass_at_1" and c("gsm8k_accuracy") == "gsm8k/accuracy"
    assert c("train/reward_mean_all") == "train/reward_mean_over_steps"
    assert c("feature_deletion/reward") == "feature_deletion/mean_reward"
    h = study.history_column
    assert h("grpo/loss") == "train/grpo/loss" and h("hint/rows") == "train/hint/rows"
    assert h("train/reward") == "train/reward" and h("step") == "step"
    # every headline name is MLflow-safe (letters, digits, _ - . / space)
    assert all(set(m) <= set("abcdefghijklmnopqrstuvwxyz0123456789_-./ ") for m in study.HEADLINE_METRICS)


def _write_history(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _dvc_repo(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for args in (["git", "init", "-q"], [str(DVC), "init", "-q"], [str(DVC), "config", "core.analytics", "false"]):
        procs.run(args, cwd=path, check=True, capture_output=True, timeout=120)


def _dvc(path: Path, *args: str) -> procs.subprocess.CompletedProcess:  # type: ignore[name-defined]
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    return procs.run([str(DVC), *args], cwd=path, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_a_plot_per_channel_series_third_party_channels_included(tmp_path):
    repo = tmp_path / "repo"
    _dvc_repo(repo)
    runs = repo / "runs"
    # a run in today's names, with a third-party channel; and one written before the naming scheme
    _write_history(
        runs / "full-s0" / "history.csv",
        [
            {
                "step": s,
                "train/reward": 0.1 * s,
                "train/loss": 1.0 / s,
                "train/accuracy": 0.2,
                "train/groups_with_signal": 0.5,
                "train/hint/rows": 3,
                "train/grpo/loss": 0.1,
                "train/grpo/clip_ratio/low_mean": 0.0,
                "train/focal_pg/loss": 0.3,
                "train/replay/loss": 0.6,
                "train/replay/pairs": 4,
                "train/replay/skipped": 0,
            }
            for s in (1, 2)
        ],
    )
    _write_history(
        runs / "old-s0" / "history.csv",
        [{"step": float(s), "reward": 0.5, "loss": 0.2, "grpo/loss": 0.1, "replay/pairs": 2} for s in (1, 2)],
    )
    n = stages.write_curves(runs, repo / "plots" / "train_curves.csv", repo / "plots" / "curves")
    assert n == 4
    files = sorted(p.name for p in (repo / "plots" / "curves").iterdir())
    assert files == sorted(
        [
            "train.reward.csv",
            "train.loss.csv",
            "train.accuracy.csv",
            "train.groups_with_signal.csv",
            "train.hint.rows.csv",
            "train.grpo.loss.csv",
            "train.focal_pg.loss.csv",
            "train.replay.loss.csv",
            "train.replay.pairs.csv",
        ]
    )  # clip ratios and skip flags are in history.csv and MLflow, not plotted
    pairs = list(csv.DictReader((repo / "plots" / "curves" / "train.replay.pairs.csv").open()))
    assert [(r["run"], r["step"], r["train/replay/pairs"]) for r in pairs] == [
        ("full-s0", "1", "4.0"),
        ("full-s0", "2", "4.0"),
        ("old-s0", "1", "2.0"),
        ("old-s0", "2", "2.0"),
    ]
    # the project's own dvc.yaml plots definition renders every file of the directory
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"plots": plots}))
    (repo / "params.yaml").write_text("train: {env: {difficulty: columns}}\n")  # the held-out bars' title reads it
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots", dirs_exist_ok=True)
    out = _dvc(repo, "plots", "show", "--json")
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)["data"]
    assert {f"plots/curves/{f}" for f in files} <= set(shown)
    rendered = shown["plots/curves/train.focal_pg.loss.csv"][0]["content"]
    assert rendered["layer"][1]["encoding"]["y"]["field"] == "train/focal_pg/loss"  # y: the file's last column
    assert rendered["layer"][1]["encoding"]["y"]["aggregate"] == "mean"  # each variant's mean over seeds
    assert {v["run"] for v in rendered["data"]["values"]} == {"full-s0"}


@pytest.mark.slow
def test_metrics_show_after_a_default_repro_does_not_warn_about_benchmarks(tmp_path):
    """The DVC project holds only what `dvc repro` runs: no other dvc.yaml outside the studies (each its own DVC
    project, with its own .dvc/), so `dvc status`/`dvc metrics show` after the README's command list nothing stale."""
    others = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("dvc.yaml") if ".venv" not in p.parts]
    assert sorted(p for p in others if not p.startswith("studies/")) == ["dvc.yaml"], others
    assert all((ROOT / p).parent.joinpath(".dvc").is_dir() for p in others if p.startswith("studies/"))
    repo = tmp_path / "repo"
    _dvc_repo(repo)
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"metrics": ["metrics.json"]}))
    (repo / "metrics.json").write_text(json.dumps({"full": {"gsm8k/accuracy": {"mean": 0.5, "std": 0.1}}}))
    out = _dvc(repo, "metrics", "show")
    assert out.returncode == 0 and "full.gsm8k/accuracy.mean" in out.stdout
    assert "failed to load" not in out.stdout + out.stderr, out.stdout + out.stderr


def _eval_run(uri: str, variant: str, seed: int, lr: float, acc: float) -> str | None:
    params = {"mlflow": {"enabled": True, "tracking_uri": uri, "experiment": "cmp"}}
    train_cfg = {
        "seed": seed,
        "env": {"name": "gsm8k"},
        "optim": {"lr": lr},
        "output_dir": f"runs/{variant}-s{seed}",
        "losses": {"grpo": {"weight": 1.0}, "hint_distill": {"weight": 1.0 if variant == "full" else 0.0}},
    }
    channels = "grpo+hint_distill" if variant == "full" else "grpo"
    result = {
        "run": f"{variant}-s{seed}",
        "variant": variant,
        "seed": seed,
        "channels": channels,
        "channel_flags": {"grpo": True, "hint_distill": variant == "full"},
        "metrics": {"gsm8k/accuracy": acc, "code/pass_at_1": 0.0, "feature_deletion/mean_reward": 0.0},
    }
    return stages.log_eval_run(params, train_cfg, result)


@pytest.mark.slow
def test_compare_shows_the_baseline_beside_each_experiment(tmp_path, monkeypatch):
    import mlflow

    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "COMPOSER_MLFLOW", "DVC_EXP_NAME", "DVC_STAGE"):
        monkeypatch.delenv(k, raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = [_eval_run(uri, v, s, 2e-5, 0.5 + 0.01 * s) for v in ("full", "rl_only") for s in (0, 1)]
    monkeypatch.setenv("DVC_EXP_NAME", "lr-up")  # what `dvc exp run -S train.optim.lr=4e-5` sets
    exp = [_eval_run(uri, v, s, 4e-5, 0.7) for v in ("full", "rl_only") for s in (0, 1)]
    monkeypatch.delenv("DVC_EXP_NAME")
    client = mlflow.MlflowClient(uri)
    assert client.get_run(base[0]).info.run_name == "eval@full-s0"
    assert client.get_run(exp[0]).info.run_name == "eval@full-s0 [lr-up]"
    cli = load_commands()
    args = ["compare", "--tracking-uri", uri, "--experiment", "cmp", "-p", str(tmp_path / "none.yaml")]
    r = CliRunner().invoke(cli, [*args, "--format", "json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = [
        (x["variant"], x["channels"], x["train.optim.lr"], x["exp"], x["n"], round(x["gsm8k/accuracy"]["mean"], 3))
        for x in json.loads(r.output)
    ]
    assert rows == [
        ("full", "grpo+hint_distill", "2e-05", "baseline", 2, 0.505),
        ("full", "grpo+hint_distill", "4e-05", "lr-up", 2, 0.7),
        ("rl_only", "grpo", "2e-05", "baseline", 2, 0.505),
        ("rl_only", "grpo", "4e-05", "lr-up", 2, 0.7),
    ]
    text = CliRunner().invoke(cli, args, catch_exceptions=False).output
    header = text.splitlines()[0].split()
    assert header[:4] == ["variant", "channels", "train.optim.lr", "exp"], text
    # with the study's params, rows follow results/ablation.md: sft, then study.variants in their order
    (tmp_path / "params.yaml").write_text("study:\n  variants:\n    rl_only: {}\n    full: {}\n")
    r = CliRunner().invoke(cli, [*args[:-1], str(tmp_path / "params.yaml"), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert [(x["variant"], x["exp"]) for x in json.loads(r.output)] == [
        ("rl_only", "baseline"),
        ("rl_only", "lr-up"),
        ("full", "baseline"),
        ("full", "lr-up"),
    ]
    # an explicit --group-by keeps the old behaviour (the newest run per channels and seed)
    r = CliRunner().invoke(cli, [*args, "--group-by", "channels", "--format", "json"], catch_exceptions=False)
    assert [x["n"] for x in json.loads(r.output)] == [2, 2]
    # the old metric spellings are accepted for --metric
    r = CliRunner().invoke(cli, [*args, "--metric", "gsm8k/accuracy", "--metric", "code/pass@1"])
    assert r.exit_code == 0 and "code/pass_at_1" in r.output
