"""End to end: the DVC pipeline on the reduced params file, in a temporary copy of the repository.

One module-scoped fixture builds a fresh repo (``git init`` + ``dvc init``, the pipeline files,
params.yaml merged with tests/pipeline/params.ci.yaml, the package sources that stages hash as
dependencies), commits it and runs ``dvc repro``. The tests then check the produced metrics,
the MLflow store, that a second repro is a no-op, and that changing one param re-runs only the
stages downstream of it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from composer_plugins import procs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CI_PARAMS = Path(__file__).with_name("params.ci.yaml")
RUN_RE = re.compile(r"Running stage '([^']+)'")

UPSTREAM = {"prepare", "sft", "teacher", "eval_teacher", "eval_sft", "rollout", "replay", "pairs"}


def _env(repo: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "COMPOSER_MLFLOW", "DVC_ROOT", "DVC_STAGE"):
        env.pop(k, None)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        DVC_NO_ANALYTICS="1",
        GIT_AUTHOR_NAME="ci",
        GIT_AUTHOR_EMAIL="ci@localhost",
        GIT_COMMITTER_NAME="ci",
        GIT_COMMITTER_EMAIL="ci@localhost",
        MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false",
    )
    return env


def run(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command in ``repo``; on failure the assertion shows its output.

    Bounded below the suite's pytest-timeout (600 s), and the whole tree is killed on a timeout or any
    interruption (``dvc repro`` runs the stages, and ``study train`` the DiLoCo replicas, as grandchildren).
    """
    proc = procs.run(list(args), cwd=repo, env=_env(repo), capture_output=True, text=True, timeout=570)
    if check:
        tail = f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{tail}"
    return proc


def ran_stages(output: str) -> set[str]:
    """Stage names that ``dvc repro`` / ``dvc exp run`` actually executed."""
    return set(RUN_RE.findall(output))


def _new_repo(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """An empty git + DVC repository (analytics and autostage off)."""
    repo = tmp_path_factory.mktemp(name) / "repo"
    repo.mkdir()
    run(repo, "git", "init", "-q")
    run(repo, str(BIN / "dvc"), "init", "-q")
    run(repo, str(BIN / "dvc"), "config", "core.analytics", "false")
    run(repo, str(BIN / "dvc"), "config", "core.autostage", "false")
    return repo


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A fresh copy of the pipeline with CI-sized params, after one ``dvc repro``."""
    from composer_plugins.pipeline.study import write_merged_params

    repo = _new_repo(tmp_path_factory, "pipeline")
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    shutil.copy(ROOT / ".dvcignore", repo / ".dvcignore")
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    shutil.copytree(
        ROOT / "composer_plugins",
        repo / "composer_plugins",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    write_merged_params(ROOT / "params.yaml", CI_PARAMS, repo / "params.yaml")
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-q", "-m", "pipeline")
    out = run(repo, str(BIN / "dvc"), "repro")
    return repo, out.stdout + out.stderr


def _params(repo: Path) -> dict:
    return yaml.safe_load((repo / "params.yaml").read_text())


def test_repro_runs_every_stage_and_writes_metrics(repo: tuple[Path, str]) -> None:
    path, log = repo
    params = _params(path)
    cells = [f"{v}-{s}" for v in params["study"]["variants"] for s in params["study"]["seeds"]]
    expected = UPSTREAM | {"report"} | {f"train@{c}" for c in cells} | {f"eval@{c}" for c in cells}
    assert ran_stages(log) == expected
    # each baseline evaluation under its own label: the teacher's is not printed as the SFT start's
    assert re.search(r"^eval@teacher: ", log, re.M) and len(re.findall(r"^eval@sft: ", log, re.M)) == 1
    assert json.loads((path / "results" / "teacher.json").read_text())["run"] == "teacher"

    metrics = json.loads((path / "metrics.json").read_text())
    assert set(metrics) == {"sft", "teacher", *params["study"]["variants"]}  # the external teacher: measured
    for row in metrics.values():
        acc = row["gsm8k/accuracy"]["mean"]
        assert 0.0 <= acc <= 1.0
        assert row["n"] == (1 if row in (metrics["sft"], metrics["teacher"]) else len(params["study"]["seeds"]))
        assert "code/pass_at_1" in row and "feature_deletion/mean_reward" in row

    for name in [f"{v}-s{s}" for v in params["study"]["variants"] for s in params["study"]["seeds"]]:
        run_dir = path / "runs" / name
        assert (run_dir / "model" / "config.json").exists()
        assert (run_dir / "config.yaml").exists()
        hist = (run_dir / "history.csv").read_text().splitlines()
        assert hist[0].startswith("step") and len(hist) == 1 + params["train"]["trainer"]["max_steps"]
        assert "train/reward" in hist[0].split(",") and hist[1].split(",")[0] == "1"  # docs/metrics.md names
        ev = json.loads((path / "evals" / f"{name}.json").read_text())
        assert {"gsm8k/accuracy", "code/pass_at_1", "feature_deletion/mean_reward"} <= set(ev["metrics"])
        assert not [k for k in ev["metrics"] if "@" in k]

    # the no_hint variant really trains without the hint channel
    cfg = yaml.safe_load((path / "runs" / "no_hint-s0" / "config.yaml").read_text())
    assert cfg["losses"]["hint_distill"]["weight"] == 0.0
    assert cfg["model"]["name_or_path"] == "models/sft/model" and cfg["sft"]["enabled"] is False
    # the positive control's arm distils from the teacher stage's model (the student's SFT continued on train
    # only), whose held-out accuracy the report shows beside the variants
    cfg = yaml.safe_load((path / "runs" / "teacher_only-s0" / "config.yaml").read_text())
    assert cfg["losses"]["grpo"]["weight"] == 0.0
    assert cfg["losses"]["teacher_distill"]["teachers"][0]["model_path"] == "models/teacher/model"
    assert (path / "models" / "teacher" / "model" / "config.json").exists()
    teacher = json.loads((path / "results" / "teacher.json").read_text())["metrics"]
    assert metrics["teacher"]["gsm8k/accuracy"]["mean"] == pytest.approx(teacher["gsm8k/accuracy"], abs=1e-6)
    assert metrics["teacher"]["model"] == "models/teacher/model"  # the teacher the cells used, measured
    assert "distilled from the teacher models/teacher/model" in (path / "results" / "paired.md").read_text()

    # data, teacher cache and pairs
    manifest = json.loads((path / "data" / "tasks" / "manifest.json").read_text())
    assert manifest["envs"]["gsm8k"]["train"]["n"] == params["data"]["gsm8k"]["train"]
    assert manifest["envs"]["gsm8k"]["overlap"] == 0
    assert (path / "data" / "teacher_cache" / "cache.sqlite").stat().st_size > 0
    pairs = [json.loads(x) for x in (path / "data" / "pairs.jsonl").read_text().splitlines() if x.strip()]
    assert pairs and all({"prompt", "chosen", "rejected"} <= set(p) for p in pairs)

    # plots and the ablation table
    curves = (path / "plots" / "train_curves.csv").read_text().splitlines()
    assert curves[0].startswith("step,run,variant,seed,arm,train/reward,train/loss")
    assert len(curves) == 1 + len(cells) * params["train"]["trainer"]["max_steps"]
    # one plot per channel series: each channel's loss, replay pairs, hint rows, groups_with_signal
    per_curve = {p.name for p in (path / "plots" / "curves").iterdir()}
    want = {
        "train.reward.csv",
        "train.loss.csv",
        "train.accuracy.csv",
        "train.groups_with_signal.csv",
        "train.hint.rows.csv",
        "train.grpo.loss.csv",
        "train.hint_distill.loss.csv",
        "train.replay.loss.csv",
        "train.replay.pairs.csv",
    }
    assert want <= per_curve, per_curve
    table = (path / "results" / "ablation.md").read_text()
    assert "| full |" in table and "| no_hint |" in table and "±" in table
    shown = json.loads(run(path, str(BIN / "dvc"), "plots", "show", "--json").stdout)
    assert {f"plots/curves/{f}" for f in want} <= set(shown["data"]), sorted(shown["data"])
    shown_metrics = run(path, str(BIN / "dvc"), "metrics", "show")
    assert "failed" not in shown_metrics.stdout + shown_metrics.stderr  # no "failed to load" warning


def test_mlflow_runs_are_tagged_and_compare_prints_the_table(repo: tuple[Path, str]) -> None:
    from mlflow.tracking import MlflowClient

    path, _ = repo
    client = MlflowClient(tracking_uri=f"sqlite:///{path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("composer-plugins-ci")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    stages = {r.data.tags.get("dvc.stage") for r in runs}
    assert {"sft", "train@full-0", "eval@full-0", "eval@no_hint-0", "eval_sft", "report"} <= stages
    # the SFT warm start is a run of its own, with its config and its per-step loss curve
    sft = next(r for r in runs if r.data.tags.get("dvc.stage") == "sft")
    assert sft.info.run_name == "sft" and sft.data.params["sft.steps"] == str(_params(path)["train"]["sft"]["steps"])
    curve = client.get_metric_history(sft.info.run_id, "sft/loss")
    assert len(curve) >= _params(path)["train"]["sft"]["steps"] and all(math.isfinite(m.value) for m in curve)
    commit = run(path, "git", "rev-parse", "HEAD").stdout.strip()
    for r in runs:
        assert r.data.tags.get("git.commit") == commit
    ev = next(r for r in runs if r.data.tags.get("dvc.stage") == "eval@no_hint-0")
    assert ev.data.params["study.channel.hint_distill"] == "off"
    assert ev.data.params["study.channel.grpo"] == "on"
    assert "gsm8k/accuracy" in ev.data.metrics
    arts = {a.path for a in client.list_artifacts(ev.info.run_id)}
    assert "no_hint-s0.json" in arts and "history.csv" in arts

    out = run(path, str(BIN / "composer-plugins"), "compare", "--format", "json").stdout
    rows = json.loads(out)
    by = {r["channels"]: r for r in rows}
    assert "grpo+replay" in by and "grpo+hint_distill+replay" in by
    assert all(0.0 <= r["gsm8k/accuracy"]["mean"] <= 1.0 for r in rows)
    text = run(path, str(BIN / "composer-plugins"), "compare").stdout
    assert "±" in text and "grpo+replay" in text


def test_second_repro_is_a_noop(repo: tuple[Path, str]) -> None:
    path, _ = repo
    st = run(path, str(BIN / "dvc"), "status")
    assert "up to date" in st.stdout, st.stdout
    again = run(path, str(BIN / "dvc"), "repro")
    assert ran_stages(again.stdout + again.stderr) == set()


def test_one_param_reruns_only_downstream_stages(repo: tuple[Path, str]) -> None:
    path, _ = repo
    params = _params(path)
    steps = params["train"]["trainer"]["max_steps"] + 1
    out = run(path, str(BIN / "dvc"), "exp", "run", "-S", f"train.trainer.max_steps={steps}")
    ran = ran_stages(out.stdout + out.stderr)
    cells = [f"{v}-{s}" for v in params["study"]["variants"] for s in params["study"]["seeds"]]
    assert ran == {f"train@{c}" for c in cells} | {f"eval@{c}" for c in cells} | {"report"}
    assert not ran & UPSTREAM
    hist = (path / "runs" / "full-s0" / "history.csv").read_text().splitlines()
    assert len(hist) == 1 + steps
    shown = json.loads(run(path, str(BIN / "dvc"), "exp", "show", "--json").stdout)
    assert shown  # the experiment is recorded next to the baseline
    # the experiment's MLflow runs carry its name, so they are told apart from the baseline's
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("composer-plugins-ci")
    runs = client.search_runs([exp.experiment_id])
    exp_names = {r.data.tags["dvc.exp"] for r in runs if "dvc.exp" in r.data.tags}
    assert len(exp_names) == 1
    name = exp_names.pop()
    names = {r.info.run_name for r in runs}
    assert {"eval@full-s0", f"eval@full-s0 [{name}]", "train@full-s0", f"train@full-s0 [{name}]"} <= names
    # compare shows the baseline beside the experiment, the changed param as a column
    rows = json.loads(run(path, str(BIN / "composer-plugins"), "compare", "--format", "json").stdout)
    full = [(r["train.trainer.max_steps"], r["exp"]) for r in rows if r["channels"] == "grpo+hint_distill+replay"]
    assert full == [(str(steps - 1), "baseline"), (str(steps), name)], rows


def test_replicas_train_a_cell_with_diloco(repo: tuple[Path, str]) -> None:
    """``train.diloco.replicas > 1``: the cell trains with DiLoCo; replica 0's model lands in the cell directory.

    Runs last: it adds runs/diloco-s0 next to the pipeline's outputs (an extra cell, not a DVC output).
    """
    path, _ = repo
    out = run(
        path,
        str(BIN / "composer-plugins"),
        "study",
        "train",
        "--variant",
        "diloco",
        "--seed",
        "0",
        "-S",
        "study.variants.diloco={}",
        "-S",
        "train.diloco.replicas=2",
        "-S",
        "train.diloco.sync_every=1",
        "-S",
        "mlflow.enabled=false",
    )
    assert "composer-plugins diloco --replicas 2" in out.stdout
    cell = path / "runs" / "diloco-s0"
    assert (cell / "model" / "config.json").exists()
    assert (cell / "replica0" / "model").is_dir() and (cell / "replica1" / "model").is_dir()
    syncs = [json.loads(x) for x in (cell / "diloco_logs" / "replica0.sync.jsonl").read_text().splitlines() if x]
    assert syncs and any(s.get("committed") for s in syncs)
    cfg = yaml.safe_load((cell / "config.yaml").read_text())
    assert cfg["diloco"]["replicas"] == 2


# -- a study directory (studies/sparse): the same stages, its own params, run as a DVC experiment ------


def _study_shrink() -> dict:
    """params.ci.yaml's sizes for the sparse study: its own variants, seeds 0-1, no SWE envs, its own teachers."""
    ci = yaml.safe_load(CI_PARAMS.read_text())
    for key in ("study", "replay", "mlflow"):
        ci.pop(key)
    for env in ("code", "feature_deletion"):
        ci["data"].pop(env)
        ci["eval"]["envs"].pop(env)
    return {**ci, "study": {"seeds": [0, 1]}}


@pytest.fixture(scope="module")
def study_repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A fresh repository holding studies/sparse at CI size, after one `dvc exp run -S ...` in the study directory."""
    from composer_plugins.pipeline.study import merge_params

    repo = _new_repo(tmp_path_factory, "study")
    for f in ("dvc.yaml", ".dvcignore", ".gitignore", "params.yaml"):
        shutil.copy(ROOT / f, repo / f)
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    shutil.copytree(
        ROOT / "composer_plugins",
        repo / "composer_plugins",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )
    study_dir = repo / "studies" / "sparse"
    study_dir.mkdir(parents=True)
    shutil.copy(ROOT / "studies" / "sparse" / "dvc.yaml", study_dir / "dvc.yaml")
    params = merge_params(yaml.safe_load((ROOT / "studies" / "sparse" / "params.yaml").read_text()), _study_shrink())
    (study_dir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-q", "-m", "study")
    out = run(study_dir, str(BIN / "dvc"), "exp", "run", "-n", "two-steps", "-S", "train.trainer.max_steps=2")
    return study_dir, out.stdout + out.stderr


def test_study_directory_runs_as_a_dvc_experiment(study_repo: tuple[Path, str]) -> None:
    study_dir, log = study_repo
    params = _params(study_dir)
    assert params["train"]["trainer"]["max_steps"] == 2  # the -S override landed in the study's params
    cells = [f"{v}-{s}" for v in params["study"]["variants"] for s in params["study"]["seeds"]]
    assert ran_stages(log) == UPSTREAM | {"report"} | {f"{k}@{c}" for c in cells for k in ("train", "eval")}
    repo = study_dir.parents[1]
    assert not (repo / "metrics.json").exists() and not (repo / "data" / "tasks").exists()  # no default stage ran
    # replay: the oracle alone (k=1) gives a pair wherever the student's answer differs from it
    stats = json.loads((study_dir / "data" / "pairs.stats.json").read_text())
    assert stats["pairs"]["pairs"] > 0 and stats["pairs"]["no_consensus"] == 0, stats
    # results/paired.md and metrics.json: every variant minus rl_only per seed, and groups_with_signal
    text = (study_dir / "results" / "paired.md").read_text()
    for v in ("hint_answer", "hint_feedback", "replay"):
        assert f"| {v} | rl_only | gsm8k/accuracy | 2 |" in text, text
        assert f"| {v} | rl_only | train/groups_with_signal (run mean) | 2 |" in text, text
    assert "held-out se (m=6)" in text and "train/groups_with_signal per step" in text
    metrics = json.loads((study_dir / "metrics.json").read_text())
    for v in ("hint_answer", "hint_feedback", "replay"):
        eff = metrics[v]["paired_vs_rl_only"]["gsm8k/accuracy"]
        assert eff["low"] <= eff["diff"] <= eff["high"]
        assert 0.0 <= metrics[v]["train/groups_with_signal"]["mean"] <= 1.0
    assert "paired_vs_rl_only" not in metrics["rl_only"]
    # dvc exp show lists the experiment with its params and metrics
    shown = run(study_dir, str(BIN / "dvc"), "exp", "show", "--json").stdout
    assert "two-steps" in shown and "paired_vs_rl_only" in shown
    # dvc plots: accuracy and groups_with_signal per variant over steps
    plots = json.loads(run(study_dir, str(BIN / "dvc"), "plots", "show", "--json").stdout)
    ids = set(plots["data"])  # the study's own plots are "dvc.yaml::<title>" from its directory
    assert any(i.startswith("dvc.yaml::Groups with reward signal per step") for i in ids), sorted(ids)
    assert any(i.startswith("dvc.yaml::Rollout accuracy per step") for i in ids), sorted(ids)
    assert any(i.startswith("dvc.yaml::Paired effects against the baseline") for i in ids), sorted(ids)
    # MLflow (the repository's one store, its own experiment): runs carry variant, seed and the dvc exp;
    # compare --paired, run by a person in the study directory, finds the same store and prints the table
    from mlflow.tracking import MlflowClient

    assert not (study_dir / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("composer-plugins-sparse")
    evals = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("dvc.stage", "").startswith("eval@")]
    tagged = {
        (r.data.tags.get("study.variant"), r.data.tags.get("study.seed"), r.data.tags.get("dvc.exp")) for r in evals
    }
    assert tagged == {(v, str(s), "two-steps") for v in params["study"]["variants"] for s in params["study"]["seeds"]}
    out = run(study_dir, str(BIN / "composer-plugins"), "compare", "--paired", "--format", "json").stdout
    rows = {(r["variant"], r["baseline"], r["metric"]): r for r in json.loads(out)}  # baseline: study.baseline
    for v in ("hint_answer", "hint_feedback", "replay"):
        row = rows[(v, "rl_only", "gsm8k/accuracy")]
        assert row["seeds"] == [0, 1]
        assert row["mean"] == pytest.approx(metrics[v]["paired_vs_rl_only"]["gsm8k/accuracy"]["diff"], abs=1e-6)
