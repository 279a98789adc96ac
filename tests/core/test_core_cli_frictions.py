"""Small inconsistencies a new user met in the first hour (issue 41): the CLI and README agree on the kinds and
the install commands, ``plugins`` says how to see the built-ins, a YAML error is located where the fix goes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from composer_plugins.core.cli import load_commands
from composer_plugins.core.config import loads_config
from composer_plugins.core.errors import ConfigError
from composer_plugins.core.registry import KINDS, KNOWN_BACKENDS

ROOT = Path(__file__).resolve().parents[2]


def _readme() -> str:
    return " ".join((ROOT / "README.md").read_text().split())


def test_list_help_and_readme_name_every_kind_of_the_registry():
    res = CliRunner().invoke(load_commands(), ["list", "--help"], terminal_width=400)
    helptext = " ".join(res.output.split())
    kinds = ", ".join(KINDS)
    assert f"KIND is one of {kinds}." in helptext
    assert f"(kinds: {kinds})" in _readme()


def test_cli_and_readme_give_one_install_command_per_backend(isolated_plugins, monkeypatch):
    monkeypatch.setenv(isolated_plugins.LOAD_ENV, "")
    isolated_plugins.reset()
    res = CliRunner().invoke(load_commands(), ["list", "backends", "--json"])
    rows = {r["name"]: r for r in json.loads(res.output)}
    m = re.search(r"Backends ship as `pip install \./packages/composer-plugins-<([a-z|-]+)>`", _readme())
    assert m, "README.md's backend install line"
    readme = {f"pip install ./packages/composer-plugins-{n}" for n in m.group(1).split("|")}
    assert {rows[n]["install"] for n in KNOWN_BACKENDS} == readme == set(KNOWN_BACKENDS.values())
    for name, install in KNOWN_BACKENDS.items():  # the command works from a clone: the directory exists
        assert (ROOT / install.split()[-1]).is_dir(), name


def test_plugins_without_third_party_ones_points_at_all(isolated_plugins, monkeypatch):
    monkeypatch.setenv(isolated_plugins.LOAD_ENV, "")
    isolated_plugins.reset()
    res = CliRunner().invoke(load_commands(), ["plugins"])
    assert res.exit_code == 0
    assert json.loads(res.stdout) == []  # stdout stays JSON
    assert "composer-plugins plugins --all" in res.stderr
    res = CliRunner().invoke(load_commands(), ["plugins", "--all"])
    assert json.loads(res.stdout) and "--all" not in res.stderr


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("seed: 1\nlosses: {grpo: {weight: 1.0}\nrollout:\n  x: 1\n", 2),  # unclosed flow mapping
        ("seed: 1\nenv: [gsm8k, code\nrollout: 2\n", 2),  # unclosed flow sequence
        ("seed: 1\noutput_dir: 'runs/a\nrollout: 2\n", 2),  # unclosed quote
        ("seed: 1\nrollout:\n  a: 1\n b: 2\n", 4),  # a bad indent is where the parser stops
    ],
)
def test_a_yaml_syntax_error_is_located_at_the_line_to_fix(text, line):
    with pytest.raises(ConfigError) as e:
        loads_config(text, source="run.yaml")
    assert str(e.value).startswith(f"run.yaml:{line}: invalid YAML"), str(e.value)
