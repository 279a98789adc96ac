"""The example env package (examples/composer-plugins-reverse) as its author ships it.

Its own tests pass, and built from its pyproject with the venv's setuptools (``--no-build-isolation``,
what an editable dev install does) it installs, and the console script discovers its env through the
entry point. Nothing is downloaded: the package has no dependency beyond this project.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from composer_plugins import procs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "composer-plugins-reverse"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSER_PLUGINS_", "PYTEST_"))}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.mark.slow
def test_the_example_env_packages_own_tests_pass():
    proc = procs.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=EXAMPLE,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "5 passed" in proc.stdout  # conformance, contract, discovery, training


@pytest.mark.slow
def test_builds_without_isolation_and_is_discovered_through_its_entry_point(tmp_path):
    site = tmp_path / "site"
    build = procs.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(EXAMPLE),
        ],
        env=_env(PIP_DISABLE_PIP_VERSION_CHECK="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    listed = procs.run(
        [sys.executable, "-m", "composer_plugins", "list", "envs", "reverse", "--json"],
        env=_env(PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert '"distribution": "composer-plugins-reverse"' in listed.stdout and '"reverse_word"' in listed.stdout
