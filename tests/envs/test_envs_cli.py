"""``composer-plugins list envs`` / ``list hints`` and the ``env`` subcommands."""

from __future__ import annotations

import json

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
