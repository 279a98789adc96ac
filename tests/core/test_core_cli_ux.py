"""The command line as a new user meets it: one override syntax (-S) in every command that reads a config,
`python -m composer_plugins`, help text without reST markup, errors that list each valid key once, and
COMPOSER_PLUGINS_STRICT=1 printing the failing plugin's whole traceback."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from composer_plugins import procs
from composer_plugins.core.cli import load_commands
from composer_plugins.core.errors import ConfigError


def _walk(cmd: click.Command, path: tuple[str, ...] = ()):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            yield from _walk(sub, (*path, name))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSER_PLUGINS_", "PYTEST_"))}
    env.update(extra)
    return env


def test_python_dash_m_is_the_console_script():
    bin_dir = Path(sys.executable).parent
    a = procs.run([sys.executable, "-m", "composer_plugins", "--version"], capture_output=True, text=True, timeout=60)
    b = procs.run([str(bin_dir / "composer-plugins"), "--version"], capture_output=True, text=True, timeout=60)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout and "composer-plugins" in a.stdout
    c = procs.run(
        [sys.executable, "-m", "composer_plugins", "list", "envs", "gsm8k"], capture_output=True, text=True, timeout=60
    )
    assert c.returncode == 0 and "gsm8k" in c.stdout


def test_every_command_that_takes_overrides_takes_dash_S():
    cli = load_commands()
    checked = []
    for path, cmd in _walk(cli):
        names = {p.name for p in cmd.params}
        takes = names & {"overrides", "set_overrides"} or any(
            isinstance(p, click.Option) and "--set" in p.opts for p in cmd.params
        )
        if not takes:
            continue
        dash_s = [p for p in cmd.params if isinstance(p, click.Option) and "-S" in p.opts and "--set" in p.opts]
        assert dash_s and dash_s[0].multiple, f"composer-plugins {' '.join(path)} has no repeatable -S/--set"
        checked.append(" ".join(path))
    for must in (
        "train",
        "sft",
        "eval",
        "rollout",
        "prepare",
        "study train",
        "study eval",
        "report",
        "replay run",
        "backend run",
        "diloco",
        "env sample",
        "env score",
    ):
        assert must in checked, (must, checked)


def test_dash_S_and_the_positional_alias_give_the_same_config(tmp_path):
    cli = load_commands()
    run = CliRunner().invoke
    a = run(cli, ["train", "--print-config", "-S", "trainer.max_steps=7", "-S", "losses.grpo.weight=0.5"])
    b = run(cli, ["train", "--print-config", "trainer.max_steps=7", "losses.grpo.weight=0.5"])
    c = run(cli, ["train", "--print-config", "--set", "trainer.max_steps=7", "losses.grpo.weight=0.5"])
    assert a.exit_code == b.exit_code == c.exit_code == 0, a.output
    assert a.output == b.output == c.output and "max_steps: 7" in a.output
    # -S applies after the positional ones: the last word wins
    d = run(cli, ["train", "--print-config", "trainer.max_steps=3", "-S", "trainer.max_steps=9"])
    assert "max_steps: 9" in d.output
    bad = run(cli, ["train", "--print-config", "-S", "trainer.max_stepz=3"])
    assert bad.exit_code != 0 and "max_steps" in bad.output  # did you mean


def test_help_shows_no_rest_markup():
    cli = load_commands()
    seen = 0
    for path, _ in _walk(cli):
        out = CliRunner().invoke(cli, [*path, "--help"], terminal_width=200)
        assert out.exit_code == 0, (path, out.output)
        assert "``" not in out.output and ":func:" not in out.output, (path, out.output)
        seen += 1
    assert seen > 20


def test_valid_keys_are_listed_once():
    err = ConfigError("unknown key.", key="losses.grpo.wieght", valid=["name", "weight", "enabled", "name", "weight"])
    assert "Valid keys: enabled, name, weight." in str(err) and "Did you mean: 'weight'?" in str(err)
    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.step.components import build_channels

    cfg, src = loads_train_config("losses: {grpo: {weight: 1.0, beta_typo: 0.1}}\n")
    with pytest.raises(ConfigError) as ei:
        build_channels(cfg, src)
    listed = str(ei.value).split("Valid keys: ", 1)[1].rstrip(".").split(", ")
    assert listed == sorted(set(listed)) and {"name", "weight", "enabled"} <= set(listed)


BROKEN = "import json\n\n\ndef helper():\n    raise RuntimeError('boom inside the plugin')\n\n\nhelper()\n"


def test_strict_mode_prints_the_plugins_full_traceback(tmp_path):
    info = tmp_path / "cp_strict-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cp-strict\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[composer_plugins]\nstrict = cp_strict_mod\n")
    (tmp_path / "cp_strict_mod.py").write_text(textwrap.dedent(BROKEN))
    cmd = [sys.executable, "-m", "composer_plugins", "list", "envs"]
    env = _env(PYTHONPATH=str(tmp_path), COMPOSER_PLUGINS_LOAD="strict")
    lenient = procs.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert lenient.returncode == 0 and "boom inside the plugin" in lenient.stderr and "Traceback" not in lenient.stderr
    strict = procs.run(cmd, env={**env, "COMPOSER_PLUGINS_STRICT": "1"}, capture_output=True, text=True, timeout=120)
    assert strict.returncode != 0
    assert "Traceback (most recent call last)" in strict.stderr
    # the plugin's own frames (file, function) are in it, not only a one-line summary
    assert "cp_strict_mod.py" in strict.stderr and "in helper" in strict.stderr, strict.stderr
