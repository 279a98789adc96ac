"""Unit tests of the pipeline helpers: params merging, study cells, aggregation, MLflow compare, run_all."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from composer_plugins.core.config import loads_config
from composer_plugins.core.errors import ConfigError
from composer_plugins.pipeline import compare, stages, study
from composer_plugins.training.lightning import tracking

ROOT = Path(__file__).resolve().parents[2]


def test_params_yaml_and_ci_params_are_consistent() -> None:
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    ci = yaml.safe_load((ROOT / "tests" / "pipeline" / "params.ci.yaml").read_text())

    def keys(d: dict, pre: str = "") -> set[str]:
        out = set()
        for k, v in d.items():
            if k == study.REPLACE_MARKER:
                continue
            out.add(pre + k)
            if isinstance(v, dict) and not v.get(study.REPLACE_MARKER) and k not in ("variants",):
                out |= keys(v, pre + k + ".")
        return out

    # every CI override names a key that exists in params.yaml (no silent typos), lists aside, and
    # the SWE-style envs the default study leaves out, which CI adds back (checked below)
    added_envs = ("code", "feature_deletion")
    extra = ("replay.teachers", "study.variants.", *(f"{s}.{e}" for s in ("data", "eval.envs") for e in added_envs))
    missing = {k for k in keys(ci) if k not in keys(base) and not k.startswith(extra)}
    assert not missing, f"params.ci.yaml overrides keys absent from params.yaml: {sorted(missing)}"
    merged = study.merge_params(base, ci)
    assert set(added_envs) <= set(stages.data_envs(merged)) and set(added_envs) <= set(stages.eval_envs(merged))
    assert not set(added_envs) & set(stages.eval_envs(base))  # the default table leaves them out
    assert set(merged["study"]["variants"]) == {"full", "no_hint", "teacher_only"}
    assert merged["teacher"]["sft_steps"] < base["teacher"]["sft_steps"]  # the teacher stage shrinks too
    assert merged["train"]["optim"] == base["train"]["optim"]  # untouched keys survive
    assert merged["data"]["gsm8k"]["source"] == "embedded"


def test_merge_params_replace_marker() -> None:
    base = {"a": {"x": 1, "y": 2}, "b": {"k": {"p": 1}}}
    out = study.merge_params(base, {"a": {"y": 3}, "b": {"_replace": True, "q": 5}})
    assert out == {"a": {"x": 1, "y": 3}, "b": {"q": 5}}
    assert base == {"a": {"x": 1, "y": 2}, "b": {"k": {"p": 1}}}


def test_train_config_merges_variant_and_wires_the_pipeline() -> None:
    params = loads_config((ROOT / "params.yaml").read_text(), source="params.yaml")
    cfg = stages.train_config(params, "grpo_teacher", 3)
    assert cfg["seed"] == 3
    assert cfg["output_dir"] == "runs/grpo_teacher-s3"
    assert cfg["losses"]["hint_distill"]["weight"] == 0.0
    assert cfg["losses"]["teacher_distill"]["teachers"][0]["model_path"] == "models/teacher/model"
    assert cfg["losses"]["grpo"] == params["train"]["losses"]["grpo"]
    assert cfg["model"]["name_or_path"] == "models/sft/model"
    assert cfg["sft"]["enabled"] is False
    assert cfg["data"]["train_path"] == "data/tasks/gsm8k/train.jsonl"
    assert cfg["replay"]["pairs_path"] == "data/pairs.jsonl"
    assert cfg["mlflow"]["tags"]["study.channels"] == "grpo+teacher_distill"
    assert cfg["mlflow"]["run_name"] == "train@grpo_teacher-s3"
    # the effective config is a valid TrainConfig
    from composer_plugins.training.config.train import train_config_from_dict

    train_config_from_dict(cfg)


def test_a_variant_replaces_a_component_it_marks_replace() -> None:
    """studies/selfteacher's hint_demo: another hints.provider, none of the base template's arguments."""
    params = loads_config((ROOT / "studies/selfteacher/params.yaml").read_text(), source="params.yaml")
    assert params["train"]["hints"]["provider"]["name"] == "template"  # the base has template arguments
    cfg = stages.train_config(params, "hint_demo", 0)
    assert cfg["hints"]["provider"] == {"name": "demonstration", "fallback": "none"}
    assert cfg["losses"]["hint_distill"]["teacher"] == "ema" and cfg["losses"]["hint_distill"]["topk"] == 100
    merged = stages.train_config(params, "hint_answer", 0)  # without the marker a variant still merges
    assert merged["hints"]["provider"] == params["train"]["hints"]["provider"]
    from composer_plugins.training.config.train import train_config_from_dict

    train_config_from_dict(cfg)


def test_unknown_variant_is_a_located_error() -> None:
    params = loads_config((ROOT / "params.yaml").read_text(), source="params.yaml")
    with pytest.raises(ConfigError) as e:
        stages.train_config(params, "rl_onyl", 0)
    msg = str(e.value)
    assert "params.yaml:" in msg and "study.variants.rl_onyl" in msg and "rl_only" in msg


def test_data_section_errors_name_the_key() -> None:
    params = loads_config("data:\n  gsm8k:\n    train: 10\n    tset: 5\n", source="p.yaml")
    with pytest.raises(ConfigError, match=r"p.yaml:4: data.gsm8k.tset: unknown key.*'test'"):
        stages.data_envs(params)
    params = loads_config("data:\n  gsm8k:\n    source: web\n", source="p.yaml")
    with pytest.raises(ConfigError, match="data.gsm8k.source"):
        stages.data_envs(params)


def test_channel_flags_and_label() -> None:
    flags = stages.channel_flags(
        {"losses": {"grpo": {"weight": 1}, "hint": {"weight": 0}, "r": {"enabled": False}, "x": 0.5, "y": False}}
    )
    assert flags == {"grpo": True, "hint": False, "r": False, "x": True, "y": False}
    assert stages.channels_label(flags) == "grpo+x"
    assert stages.channels_label({"a": False}) == "none"


def test_ablation_rows_mean_and_sample_std() -> None:
    recs = [
        {"channels": "a", "seed": 0, "m": 0.2},
        {"channels": "a", "seed": 1, "m": 0.4},
        {"channels": "b", "seed": 0, "m": 0.5},
    ]
    rows = study.ablation_rows(recs, ["m"])
    a, b = rows
    assert a["n"] == 2 and a["seeds"] == [0, 1]
    assert a["m"][0] == pytest.approx(0.3) and a["m"][1] == pytest.approx(math.sqrt(0.02))
    assert b["m"] == (0.5, 0.0)
    text = study.format_table(rows, ["m"])
    assert "0.300 ± 0.141" in text and "| b |" in text
    assert math.isnan(study.mean_std([])[0])


def test_tracking_uri_resolves_relative_sqlite_to_repo_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert tracking.tracking_uri({"mlflow": {"tracking_uri": "sqlite:///mlflow.db"}}) == (
        f"sqlite:///{(tmp_path / 'mlflow.db').resolve().as_posix()}"
    )
    # without DVC_ROOT (a person running a command in a study directory): the directory holding .dvc/,
    # not the study's own dvc.yaml, so every study of the repository writes into the one store
    monkeypatch.delenv("DVC_ROOT")
    (tmp_path / ".dvc").mkdir()
    study_dir = tmp_path / "studies" / "sparse"
    study_dir.mkdir(parents=True)
    (study_dir / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(study_dir)
    assert tracking.repo_root() == tmp_path.resolve()
    assert tracking.tracking_uri({"mlflow": {"tracking_uri": "sqlite:///mlflow.db"}}) == (
        f"sqlite:///{(tmp_path / 'mlflow.db').resolve().as_posix()}"
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking.tracking_uri({}) == "http://127.0.0.1:5000"
    monkeypatch.setenv("COMPOSER_MLFLOW", "0")
    assert not tracking.mlflow_enabled({"mlflow": {"enabled": True}})


def test_run_tags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVC_STAGE", "train@full-0")
    monkeypatch.setenv("DVC_EXP_NAME", "exp-1")
    tags = tracking.run_tags(variant="full", seed=0, extra={"x": 1})
    assert tags["dvc.stage"] == "train@full-0" and tags["dvc.exp"] == "exp-1"
    assert tags["study.variant"] == "full" and tags["study.seed"] == "0" and tags["x"] == "1"
    assert (
        tags["git.commit"]
        == subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=60
        ).stdout.strip()
    )


@pytest.mark.slow
def test_compare_reads_mlflow_dedupes_and_aggregates(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("study", artifact_location=str(tmp_path / "mlruns"))

    def log(stage: str, channels: str, seed: int, acc: float, status: str = "FINISHED") -> None:
        r = client.create_run(exp_id, tags={"dvc.stage": stage})
        client.log_param(r.info.run_id, "study.channels", channels)
        client.log_param(r.info.run_id, "study.seed", seed)
        client.log_param(r.info.run_id, "study.variant", channels)
        client.log_metric(r.info.run_id, "gsm8k/accuracy", acc)
        client.set_terminated(r.info.run_id, status)

    log("eval@full-0", "grpo+hint", 0, 0.1)  # superseded by the newer run below
    log("eval@full-0", "grpo+hint", 0, 0.5)
    log("eval@full-1", "grpo+hint", 1, 0.7)
    log("eval@no_hint-0", "grpo", 0, 0.2)
    log("eval@no_hint-1", "grpo", 1, 0.9, status="FAILED")  # failed runs are ignored
    log("train@no_hint-0", "grpo", 0, 0.99)  # not an eval stage

    recs = compare.fetch_eval_records(uri, "study")
    assert sorted((r["channels"], r["seed"], r["gsm8k/accuracy"]) for r in recs) == [
        ("grpo", 0, 0.2),
        ("grpo+hint", 0, 0.5),
        ("grpo+hint", 1, 0.7),
    ]
    assert len(compare.fetch_eval_records(uri, "study", all_runs=True)) == 4
    rows = json.loads(compare.compare_table(recs, ["gsm8k/accuracy"], fmt="json"))
    assert rows[0]["channels"] == "grpo+hint" and rows[0]["gsm8k/accuracy"]["mean"] == pytest.approx(0.6)
    assert rows[0]["n"] == 2 and rows[1]["n"] == 1
    csv = compare.compare_table(recs, ["gsm8k/accuracy"], fmt="csv").splitlines()
    assert csv[0] == "channels,n,gsm8k/accuracy_mean,gsm8k/accuracy_std"
    assert compare.fetch_eval_records(uri, "missing") == []


def test_run_all_isolates_failures_and_writes_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import run_all

    pkg = tmp_path / "fakebench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bench_good.py").write_text(
        textwrap.dedent("""
        def run(quick=False):
            return {"name": "good", "results": {"quick": quick}, "ratios": {"speedup": 2.0 if quick else 3.0},
                    "targets": {"speedup": ">= 1.5"}}
    """)
    )
    (pkg / "bench_bad.py").write_text("def run(quick=False):\n    raise RuntimeError('boom')\n")
    (pkg / "bench_shape.py").write_text("def run(quick=False):\n    return {'name': 'shape'}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    mods = run_all.discover(pkg)
    assert mods == ["fakebench.bench_bad", "fakebench.bench_good", "fakebench.bench_shape"]
    report = run_all.run_all(quick=True, modules=mods)
    by = {b["name"]: b for b in report["benchmarks"]}
    assert by["good"]["ok"] and by["good"]["results"] == {"quick": True}
    assert not by["bad"]["ok"] and "boom" in by["bad"]["error"]
    assert not by["shape"]["ok"] and "ratios" in by["shape"]["error"]
    assert report["ratios"] == {"good/speedup": 2.0}
    jpath, mpath = run_all.write_report(report, tmp_path / "out" / "bench")
    assert json.loads(jpath.read_text())["quick"] is True
    md = mpath.read_text()
    assert "| good | speedup | 2 | >= 1.5 |" in md and "| bad | FAILED |" in md
    only = run_all.run_all(quick=True, modules=mods, only=["good"], in_process=True)
    assert [b["name"] for b in only["benchmarks"]] == ["good"]


def test_run_all_cli_lists_project_benchmarks() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.run_all", "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    found = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert out == found


def test_secrets_stay_references_in_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PIPELINE_TEST_KEY", raising=False)
    text = (
        (ROOT / "params.yaml")
        .read_text()
        .replace(
            "    - name: oracle\n      id: oracle\n",
            "    - name: oracle\n      id: oracle\n    - {name: openai, id: paid, model: m, base_url: http://127.0.0.1:9,"
            " api_key: {$env: PIPELINE_TEST_KEY}}\n",
        )
    )
    assert "PIPELINE_TEST_KEY" in text
    (tmp_path / "params.yaml").write_text(text)
    params = study.load_params(tmp_path / "params.yaml")  # does not need the variable
    assert params["replay"]["teachers"][-1]["api_key"] == {"$env": "PIPELINE_TEST_KEY"}
    stages.train_config(params, "rl_only", 0)
    cfg = stages.replay_config(params)
    assert cfg["teachers"][-1]["api_key"] == {"$env": "PIPELINE_TEST_KEY"}  # a reference, never a value
    assert cfg["cache"]["path"] == "data/teacher_cache/cache.sqlite" and cfg["normalize"] == {"enabled": False}
    with pytest.raises(ConfigError, match="PIPELINE_TEST_KEY"):
        study.load_params(tmp_path / "params.yaml", resolve_secrets=True)


def test_replay_stage_takes_its_consensus_from_pairs_k(tmp_path: Path) -> None:
    """One teacher with ``pairs.k: 1`` (the sparse study's oracle replay) is a valid replay stage config."""
    from composer_plugins.core.config import Config
    from composer_plugins.teachers.runner import parse_config

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["replay"]["teachers"] = [{"name": "oracle", "id": "oracle"}]
    params["pairs"] = {**params["pairs"], "k": 1}
    cfg = stages.replay_config(params)
    assert cfg["consensus"] == {"k": 1, "compare": params["pairs"]["compare"]}
    assert parse_config(Config(cfg, source=str(tmp_path / "config.yaml"))).consensus.k == 1
    params["pairs"]["k"] = 2  # the default: two teachers must agree, and one is refused with the reason
    with pytest.raises(ConfigError, match=r"consensus.k.*only 1 teacher"):
        parse_config(Config(stages.replay_config(params), source=str(tmp_path / "config.yaml")))


def test_the_default_study_holds_out_numbers_and_prints_every_overlap_level(tmp_path: Path) -> None:
    """README/docs: the main job's prepare reports the `columns` split at each level (fact, line, operand,
    intermediate result, answer): every fact shared, no number of a test problem in train."""
    from click.testing import CliRunner

    from composer_plugins.core.cli import load_commands

    res = CliRunner().invoke(
        load_commands(), ["prepare", "-p", str(ROOT / "params.yaml"), "--out", str(tmp_path / "tasks")]
    )
    assert res.exit_code == 0, res.output
    assert "gsm8k: 30000 train, 400 test (embedded)" in res.output
    procedure = "400/400 test rows use only train facts; 0 an operand, 0 an intermediate result, 0 an answer"
    lines = "400/400 test first lines, 400/400 second lines and 0/400 answers occur verbatim in train"
    manifest = json.loads((tmp_path / "tasks" / "manifest.json").read_text())["envs"]["gsm8k"]
    assert manifest["env"]["difficulty"] == "columns" and manifest["fact_overlap"] == manifest["fact_rows"] == 400
    assert manifest["operand_overlap"] == manifest["intermediate_overlap"] == manifest["answer_number_overlap"] == 0
    # what docs/pipeline.md says the main job's prepare prints is what it prints
    docs = " ".join((ROOT / "docs" / "pipeline.md").read_text().split())
    for claim in (procedure, lines):
        assert claim in res.output and claim in docs, claim


def test_the_readme_describes_the_default_study_params_yaml_runs() -> None:
    """README's main job: the columns level, a 500-step SFT, a teacher 300 steps on, 3 arms x 2 seeds x 32 steps."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert params["train"]["env"]["difficulty"] == "columns" and "runs the `columns` level" in readme
    assert params["train"]["sft"]["steps"] == 500 and "A 500-step SFT warm start" in readme
    assert params["teacher"]["sft_steps"] == 300 and "that SFT continued 300 steps on train only" in readme
    variants, seeds = params["study"]["variants"], params["study"]["seeds"]
    assert list(variants) == ["rl_only", "teacher_only", "grpo_teacher"] and params["study"]["baseline"] == "rl_only"
    steps = params["train"]["trainer"]["max_steps"]
    assert f"three arms × {len(seeds)} seeds × {steps} RL steps" in readme
    assert params["eval"]["envs"]["gsm8k"]["num_problems"] == params["data"]["gsm8k"]["test"] == 400
    assert "evaluated greedily on all 400 held-out problems" in readme and params["eval"]["envs"]["gsm8k"]["k"] == 0
    # both teacher arms distil from the teacher stage's model; every arm at the procedural study's GRPO settings
    for v in ("teacher_only", "grpo_teacher"):
        assert variants[v]["losses"]["teacher_distill"]["teachers"][0]["model_path"] == "models/teacher/model"
        assert "optim" not in variants[v] and "rollout" not in variants[v]
    study = yaml.safe_load((ROOT / "studies" / "confirm" / "params.yaml").read_text())["train"]["optim"]
    assert {k: params["train"]["optim"][k] for k in ("lr", "warmup_steps")} == {"lr": 1e-4, "warmup_steps": 10}
    assert study["lr"] == params["train"]["optim"]["lr"] and study["warmup_steps"] == 10
    assert "`cd studies/confirm && J=2 bash run_study.sh`" in readme and "does **not** pass" in readme


@pytest.mark.slow
def test_the_report_pools_a_second_warm_start_and_tests_rl_against_each_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`study.warm_starts`: the report stage reads the other warm start's evals and runs beside its own, writes one
    pooled table, and puts rl_only − SFT (per seed, against its own start) into metrics.json and paired.md."""
    from composer_plugins.pipeline.stage_report import report

    accs = {"a": (0.30, {0: (0.40, 0.50), 1: (0.42, 0.55)}), "b": (0.20, {2: (0.31, 0.44), 3: (0.29, 0.40)})}
    for d, (sft, cells) in accs.items():
        (tmp_path / d / "evals").mkdir(parents=True)
        (tmp_path / d / "evals" / "sft.json").write_text(
            json.dumps({"run": "sft", "variant": "sft", "seed": 0, "channels": "", "metrics": {"gsm8k/accuracy": sft}})
        )
        for s, pair in cells.items():
            for v, acc in zip(("rl_only", "teacher_only"), pair, strict=True):
                rec = {"run": f"{v}-s{s}", "variant": v, "seed": s, "channels": v, "metrics": {"gsm8k/accuracy": acc}}
                (tmp_path / d / "evals" / f"{v}-s{s}.json").write_text(json.dumps(rec))
                run = tmp_path / d / "runs" / f"{v}-s{s}"
                run.mkdir(parents=True)
                run.joinpath("history.csv").write_text("step,train/groups_with_signal\n1,0.5\n2,0.25\n")
    params = {"study": {"seeds": [0, 1], "baseline": "rl_only", "warm_starts": ["../b"]}}
    params["study"]["variants"] = {"rl_only": {}, "teacher_only": {}}
    monkeypatch.chdir(tmp_path / "a")
    res = report(params)
    m = json.loads(Path("metrics.json").read_text())
    assert m["rl_only"]["n"] == 4 and m["sft"]["n"] == 2  # both warm starts' cells and starts
    control = m["rl_only"]["minus_sft"]["gsm8k/accuracy"]
    assert control["diff"] == pytest.approx((0.10 + 0.12 + 0.11 + 0.09) / 4)  # each seed against its own start
    gap = m["teacher_only"]["paired_vs_rl_only"]["gsm8k/accuracy"]
    assert gap["diff"] == pytest.approx((0.10 + 0.13 + 0.13 + 0.11) / 4)
    assert "SFT start (warm start ../b): gsm8k/accuracy = 0.2000" in res["paired"]
    assert "| rl_only | sft | gsm8k/accuracy | 4 |" in res["paired"]
    rows = Path("plots/train_curves.csv").read_text().splitlines()
    assert len(rows) == 1 + 8 * 2  # every run of both warm starts, two steps each
    # a warm start whose cells have not run is named with the fix
    params["study"]["warm_starts"] = ["../c"]
    with pytest.raises(ConfigError, match=r"study.warm_starts.*\['../c'\] hold no evals/"):
        report(params)
