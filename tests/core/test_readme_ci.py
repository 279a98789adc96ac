"""README.md's two newcomer commands are what CI runs: extracted from the README, never copied into .ci/run."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CI = (ROOT / ".ci" / "run").read_text()


def _script():
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / "scripts" / "readme_commands.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_readme_has_the_main_and_test_commands():
    cmds = _script().commands((ROOT / "README.md").read_text())
    # the main job: the plain install (no dev extras), then the DVC pipeline
    assert re.match(r"^bash scripts/install\.sh && ", cmds["main"]) and cmds["main"].endswith("dvc repro")
    assert "install.sh dev" not in cmds["main"]
    assert cmds["test"].startswith("bash scripts/install.sh dev && ") and "pytest" in cmds["test"]


def test_ci_runs_exactly_the_readme_commands():
    for which in ("main", "test"):
        out = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "readme_commands.py"), which],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        assert out == _script().commands((ROOT / "README.md").read_text())[which]
        assert f'{which}_cmd=$("$PY" scripts/readme_commands.py {which})' in CI
        assert f'bash -c "${which}_cmd"' in CI
    # the main job runs first, from a venv the plain install made (not the dev one), on CI-sized params
    assert CI.index('bash -c "$main_cmd"') < CI.index('bash -c "$test_cmd"')
    assert CI.index("rm -rf .venv") < CI.index("bash scripts/install.sh #") < CI.index('bash -c "$main_cmd"')
    assert "tests/pipeline/params.ci.yaml" in CI and "metrics.json" in CI


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("# x\n\n## Other\n```bash\nls\n```\n", "section"),
        ("## Two commands on a fresh machine\n\n```bash\nbash a.sh\n```\n", "exactly two"),
        ("## Two commands on a fresh machine\n```bash\na\nb\n```\n```bash\nc\n```\n", "exactly two"),
        ("## Two commands on a fresh machine\n```bash\na\n```\n```bash\nb\n```\n```bash\nc\n```\n", "exactly two"),
    ],
)
def test_a_readme_that_drifted_fails_ci(text, problem):
    with pytest.raises(ValueError, match=problem):
        _script().commands(text)
