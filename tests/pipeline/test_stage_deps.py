"""Every DVC stage's deps cover the code its command runs and the paths it reads from other studies.

scripts/stage_deps.py derives what each stage's ``composer-plugins`` command imports (the modules loaded when the
command line starts, plus the static closure of its callback's imports) and fails when a stage's deps miss one.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def deps_mod():
    mod = _script("stage_deps")
    from composer_plugins.core.cli import load_commands

    group = load_commands()
    start = {m for m in sys.modules if m.split(".")[0] == "composer_plugins"}
    return mod, group, start


@pytest.mark.slow
def test_every_project_pins_all_its_code_and_reads():
    """The root dvc.yaml and every studies/*/dvc.yaml, in a fresh process (its start-up imports are the CLI's own)."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "stage_deps.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "DVC projects" in r.stdout


def _project(tmp_path: Path, dvc: dict, params: dict | None = None) -> Path:
    proj = tmp_path / "studies" / "mine"
    proj.mkdir(parents=True)
    (proj / "dvc.yaml").write_text(yaml.safe_dump(dvc, sort_keys=False))
    (proj / "params.yaml").write_text(yaml.safe_dump(params or {}))
    return proj


def test_the_old_train_deps_miss_kernels_and_teachers(deps_mod, tmp_path):
    """0c286a0's hand-written train deps (no kernels, no teachers) are refused, naming both packages."""
    mod, group, start = deps_mod
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    train = dict(stages["train"])
    old = ["core", "training", "losses", "models", "envs"]
    train["deps"] = [str(ROOT / "composer_plugins" / p) for p in old] + [
        str(ROOT / "composer_plugins" / "pipeline" / f) for f in ("stage_train.py", "common.py", "study.py")
    ]
    proj = _project(tmp_path, {"stages": {"train": train}})
    problems, imports = mod.check(proj, start, group)
    assert len(problems) == 1 and "stage train" in problems[0], problems
    for pkg in ("composer_plugins/kernels", "composer_plugins/teachers"):
        assert pkg in problems[0]
        assert any(f.startswith(pkg + "/") for f in imports["train"])
    # with the whole package as its dep, the same stage passes
    train["deps"] = [str(ROOT / "composer_plugins")]
    proj2 = _project(tmp_path / "b", {"stages": {"train": train}})
    assert mod.check(proj2, start, group)[0] == []


def test_dropping_one_package_from_a_stage_is_refused(deps_mod, tmp_path):
    """Removing any one package a stage imports from its deps fails the check, for a stage of every command."""
    mod, group, start = deps_mod
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    pkgs = sorted(p.name for p in (ROOT / "composer_plugins").iterdir() if (p / "__init__.py").is_file())
    for name in ("prepare", "report"):
        stage = dict(stages[name])
        imported = {
            f.split("/")[1]
            for f in mod.check(_project(tmp_path / name, {"stages": {name: stage}}), start, group)[1][name]
            if f.count("/") > 1
        }
        assert {"core", "kernels", "teachers"} <= imported
        drop = "kernels"
        stage["deps"] = [str(ROOT / "composer_plugins" / p) for p in pkgs if p != drop] + [
            str(ROOT / "composer_plugins" / "__init__.py"),
            str(ROOT / "composer_plugins" / "__main__.py"),
        ]
        problems = mod.check(_project(tmp_path / f"{name}-drop", {"stages": {name: stage}}), start, group)[0]
        assert problems and "composer_plugins/kernels" in problems[0] and "composer_plugins/core" not in problems[0]


def test_a_teacher_read_from_another_study_must_be_a_dep(deps_mod, tmp_path):
    """A cell distilling from ``../other/models/teacher/model`` needs that path in train's deps, and the report the
    other study's results/teacher.json; scripts/studies.py writes both."""
    mod, group, start = deps_mod
    studies = _script("studies")
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    params = {
        "study": {
            "warm_starts": ["../other"],
            "variants": {
                "t": {
                    "losses": {
                        "teacher_distill": {
                            "teachers": [{"kind": "causal_lm", "model_path": "../other/models/teacher/model"}]
                        }
                    }
                }
            },
        }
    }
    train = dict(stages["train"], deps=[str(ROOT / "composer_plugins"), "models/teacher"])
    report = dict(stages["report"], deps=[str(ROOT / "composer_plugins"), "evals"])
    proj = _project(tmp_path, {"stages": {"train": train, "report": report}}, params)
    problems = mod.check(proj, start, group)[0]
    assert any("stage train: reads ../other/models/teacher/model" in p for p in problems), problems
    assert any("stage report: reads ../other/evals" in p for p in problems), problems
    assert any("stage report: reads ../other/results/teacher.json" in p for p in problems), problems
    extra = studies.external_deps(params)
    assert extra["train"] == ["../other/models/teacher/model"]
    assert set(extra["report"]) == {"../other/evals", "../other/runs", "../other/results"}
    train["deps"] += extra["train"]
    report["deps"] += extra["report"]
    proj2 = _project(tmp_path / "fixed", {"stages": {"train": train, "report": report}}, params)
    assert mod.check(proj2, start, group)[0] == []
