"""``composer-plugins list envs`` / ``list hints`` and the ``env`` subcommands."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from composer_plugins.core.cli import load_commands


def invoke(*args: str, input: str | None = None):
    result = CliRunner().invoke(load_commands(), list(args), input=input, catch_exceptions=False)
    return result


def test_list_envs_shows_all_four_with_descriptions():
    res = invoke("list", "envs", "--json")
    assert res.exit_code == 0, res.output
    entries = {e["name"]: e for e in json.loads(res.output)}
    assert {"gsm8k", "code", "feature_deletion", "openenv"} <= set(entries)
    assert "GSM8K" in entries["gsm8k"]["description"]
    assert "HumanEval" in entries["code"]["description"] and "sandbox" in entries["code"]["description"]
    assert "fail-to-pass" in entries["feature_deletion"]["description"]
    assert "OpenEnv" in entries["openenv"]["description"]
    assert all(e["available"] for e in entries.values())
    table = invoke("list", "envs")
    for name in ("gsm8k", "code", "feature_deletion", "openenv"):
        assert name in table.output


def test_list_hints():
    res = invoke("list", "hints", "--json")
    names = {e["name"] for e in json.loads(res.output)}
    assert {"template", "raw_error", "llm_teacher", "chain"} <= names


def test_env_sample_and_score():
    res = invoke("env", "sample", "gsm8k", "-n", "2", "--set", "difficulty=0", "--json")
    assert res.exit_code == 0, res.output
    tasks = [json.loads(line) for line in res.output.strip().splitlines()]
    assert len(tasks) == 2 and all(t["difficulty"] == 0 for t in tasks)
    first = tasks[0]
    scored = invoke("env", "score", "gsm8k", "--set", "difficulty=0", input="#### 99999\n")
    out = json.loads(scored.output)
    assert out["reward"] == 0.0 and out["kind"] == "wrong_answer" and "99999" in out["hint"]
    good = invoke("env", "score", "gsm8k", "--set", "difficulty=0", input=first["target"])
    assert json.loads(good.output)["reward"] == 1.0 and json.loads(good.output)["hint"] is None


def test_sandbox_check():
    res = invoke("env", "sandbox-check")
    assert res.exit_code == 0, res.output
    assert "isolation:" in res.output and "FAIL" not in res.output


@pytest.mark.slow
def test_env_score_feature_deletion_hides_another_checkout_by_default(tmp_path):
    """``composer-plugins env score feature_deletion``: a completion that copies the deleted function from
    another checkout on the disk scores 0 by default, and 1 once the view is widened (``sandbox_expose=all``)."""
    import shutil
    import tempfile
    from pathlib import Path

    from composer_plugins.envs.feature_deletion import FIXTURE_REPO

    other = Path(tempfile.mkdtemp(prefix="cp-other-checkout-", dir="/var/tmp"))  # outside home and the temp dir
    try:
        shutil.copytree(FIXTURE_REPO, other / "textkit")
        for p in [other, *other.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)  # readable by anyone, as a checkout usually is
        hack = (
            "```python\n"
            "def to_roman(n):\n"
            "    ns = {}\n"
            f"    exec(open({str(other / 'textkit' / 'textkit' / 'roman.py')!r}).read(), ns)\n"
            "    return ns['to_roman'](n)\n"
            "```\n"
        )
        base = [
            "env",
            "score",
            "feature_deletion",
            "-S",
            "symbols=[to_roman]",
            "-S",
            "progress=false",
            "-S",
            "timeout_s=30",
        ]
        safe = invoke(*base, "-", input=hack)
        assert safe.exit_code == 0, safe.output
        assert json.loads(safe.output)["reward"] == 0.0, safe.output
        wide = invoke(*base, "-S", "sandbox_expose=all", "-", input=hack)
        assert wide.exit_code == 0, wide.output
        assert json.loads(wide.output)["reward"] == 1.0, wide.output
    finally:
        shutil.rmtree(other, ignore_errors=True)
