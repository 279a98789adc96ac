"""`composer-plugins plots`: one dvc.yaml's plots and no other's, in a page that needs no network, and SVGs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from composer_plugins.core.cli import load_commands
from composer_plugins.pipeline import plots

pytestmark = pytest.mark.slow

DVC_YAML = {
    "plots": [
        {"curves": {"x": "step"}},  # a directory plot: one chart per file
        {"Accuracy per variant (mean)": {"x": "accuracy", "y": {"table.csv": "variant"}, "template": "bar_horizontal"}},
    ]
}


def _write_study(d: Path, scale: float, with_data: bool = True) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    if not with_data:  # a study whose outputs do not exist (a bare `dvc plots show` fails on them)
        return
    (d / "curves").mkdir(exist_ok=True)
    for name in ("train.reward.csv", "train.loss.csv"):
        rows = "\n".join(f"{s},{scale * s / 10:.3f}" for s in range(1, 6))
        (d / "curves" / name).write_text(f"step,{name[:-4]}\n{rows}\n")
    (d / "table.csv").write_text(f"variant,accuracy\nrl_only,{0.3 * scale:.3f}\nfull,{0.35 * scale:.3f}\n")


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A DVC repository with a root pipeline and two studies, like this one's studies/<name>/."""
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")  # no analytics daemon left behind
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    _write_study(tmp_path, 1.0)
    _write_study(tmp_path / "studies" / "chain", 2.0)
    _write_study(tmp_path / "studies" / "sparse", 3.0, with_data=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _shown(*targets: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "dvc", "plots", "show", "--json", *targets], capture_output=True, text=True, check=True
    )
    return list(json.loads(out.stdout).get("data") or {})


def test_targets_name_this_files_plots_and_no_studys(repo: Path) -> None:
    # the problem: DVC collects every dvc.yaml of the repository, so a bare `dvc plots show` mixes the studies in
    assert any(k.startswith("studies/chain/") for k in _shown())
    # and a plain plot id is a regular expression DVC matches against each file's own ids: it names the study's too
    assert any(k.startswith("studies/chain/") for k in _shown("curves"))
    tg = plots.targets("dvc.yaml")
    assert len(tg) == 2 and "\\" not in "".join(tg)  # DVC turns a backslash into '/' (a Windows path)
    shown = _shown(*tg)
    assert sorted(shown) == ["Accuracy per variant (mean)", "curves/train.loss.csv", "curves/train.reward.csv"]
    os.chdir(repo / "studies" / "chain")  # a study's own plots, from its directory
    assert sorted(_shown(*plots.targets("dvc.yaml"))) == sorted(shown)


def test_literal_targets_match_only_themselves() -> None:
    for text in ("dvc.yaml::Accuracy (mean) [a] x.y+z?", "dvc.yaml::plots/curves"):
        pattern = plots._literal(text) + "$"
        assert re.match(pattern, text)
        assert not re.match(pattern, "studies/x/" + text) and not re.match(pattern, text + "/more")


def test_plots_command_renders_the_root_plots_offline(repo: Path) -> None:
    res = CliRunner().invoke(load_commands(), ["plots", "--out", "page"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "plots: 3 plots of dvc.yaml -> page/index.html and 3 SVGs (renders offline)" in res.output
    html = (repo / "page" / "index.html").read_text()
    assert "studies/" not in html  # no study's plot or data
    assert html.count("vegaEmbed('#") == 3
    # nothing fetched from the network: no external script, the three libraries inline
    assert not re.search(r"<script[^>]+src=", html) and "cdn.jsdelivr" not in html
    assert "window.vegaEmbed=" in html and "window.vegaLite=" in html
    svgs = sorted(p.name for p in (repo / "page").glob("*.svg"))
    assert svgs == ["Accuracy_per_variant_mean.svg", "curves_train.loss.csv.svg", "curves_train.reward.csv.svg"]
    for name in svgs:  # rendered by the bundled engine: real marks (lines or bars), the data's values on the axes
        svg = (repo / "page" / name).read_text()
        assert svg.startswith("<svg") and svg.count("<path") >= 3, name
    assert "rl_only" in (repo / "page" / "Accuracy_per_variant_mean.svg").read_text()


def test_plots_before_any_data_says_run_dvc_repro(repo: Path) -> None:
    os.chdir(repo / "studies" / "sparse")
    res = CliRunner().invoke(load_commands(), ["plots", "--no-svg"])
    assert res.exit_code != 0 and "run `dvc repro` first" in res.output


def test_a_study_as_its_own_dvc_project_leaves_the_root_plots_alone(tmp_path: Path, monkeypatch) -> None:
    """With each study its own DVC project (`dvc init --subdir`), a bare `dvc plots show` at the root lists only
    the root's plots, and the study's from its directory."""
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    _write_study(tmp_path, 1.0)
    _write_study(tmp_path / "studies" / "chain", 2.0)
    monkeypatch.chdir(tmp_path)
    assert any(k.startswith("studies/chain/") for k in _shown())  # the problem, before
    subprocess.run([sys.executable, "-m", "dvc", "init", "--subdir", "-q"], cwd=tmp_path / "studies/chain", check=True)
    root = sorted(_shown())
    assert root == ["Accuracy per variant (mean)", "curves/train.loss.csv", "curves/train.reward.csv"]
    os.chdir(tmp_path / "studies" / "chain")
    assert sorted(_shown()) == root  # the same plot ids, from the study's own files


def test_every_study_is_its_own_dvc_project() -> None:
    """This repository's studies/<name>/ each hold a DVC project of their own, with the root's plot templates, so
    the root collects none of them and `cd studies/<name> && dvc repro` / `dvc plots show` work there."""
    root = Path(__file__).resolve().parents[2]
    studies = sorted(p.parent for p in (root / "studies").glob("*/dvc.yaml"))
    assert studies
    for study in studies:
        assert (study / ".dvc" / "config").is_file(), f"{study}: run `dvc init --subdir` there"
        templates = {p.name for p in (study / ".dvc" / "plots").glob("*.json")}
        assert templates == {p.name for p in (root / ".dvc" / "plots").glob("*.json")}, study
