"""The composer-plugins CLI, in-process (click runner) and as the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from composer_plugins import __version__
from composer_plugins.core import plugins
from composer_plugins.core.cli import load_commands


def run(*args: str):
    return CliRunner().invoke(load_commands(), list(args), catch_exceptions=False)


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and __version__ in r.output


def test_list_table_has_columns_and_example_plugin(discovery):
    r = run("list", "losses")
    assert r.exit_code == 0, r.output
    header = r.output.splitlines()[0].split()
    assert header == ["NAME", "KIND", "DESCRIPTION", "PROVIDER"]
    row = next(line for line in r.output.splitlines() if line.startswith("focal_pg"))
    assert "losses" in row and "composer-plugins-focal 0.1.0" in row


def test_list_pattern_and_json(discovery):
    r = run("list", "loss", "focal*", "--json")
    data = json.loads(r.output)
    assert [d["name"] for d in data] == ["focal_pg"]
    assert data[0]["distribution"] == "composer-plugins-focal" and data[0]["available"] is True


def test_list_unknown_kind_is_a_usage_error(isolated_plugins):
    r = CliRunner().invoke(load_commands(), ["list", "widgetz"])
    assert r.exit_code == 2 and "Unknown kind 'widgetz'" in r.output and "losses" in r.output


def test_plugins_json_reports_distribution_version_hooks(discovery):
    r = run("plugins")
    data = json.loads(r.output)
    focal = next(d for d in data if d["name"] == "focal")
    assert focal == {
        "name": "focal",
        "distribution": "composer-plugins-focal",
        "version": "0.1.0",
        "hooks": ["register_loss_channels"],
        "contract": "ok",
    }
    r = run("plugins", "--all", "--hook", "register_envs")
    names = [d["name"] for d in json.loads(r.output)]
    assert "composer_plugins.envs.plugin" in names and "focal" not in names
    r = run("plugins", "--requirements")
    assert "composer-plugins-focal==0.1.0" in r.output.splitlines()


def test_console_script_lists_the_third_party_channel(discovery):
    beside = Path(sys.executable).with_name("composer-plugins")
    exe = str(beside) if beside.exists() else shutil.which("composer-plugins")
    assert exe, "composer-plugins console script is not installed"
    out = subprocess.run(
        [exe, "list", "losses", "focal"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "focal_pg" in out and "composer-plugins-focal" in out


def test_one_error_handler_for_every_command(monkeypatch):
    """A ComposerPluginsError from any command: 'Error: ...' on stderr, exit 2; strict mode: the traceback."""
    import click

    from composer_plugins.core import cli as core_cli
    from composer_plugins.core.errors import ConfigError

    @click.command()
    @core_cli.command_errors
    def boom():
        raise ConfigError("bad value", key="a.b", file="x.yaml", line=3)

    monkeypatch.delenv("COMPOSER_PLUGINS_STRICT", raising=False)
    r = CliRunner().invoke(boom, [])
    assert r.exit_code == 2 and "Error: x.yaml:3: a.b: bad value" in r.output and "Traceback" not in r.output
    monkeypatch.setenv("COMPOSER_PLUGINS_STRICT", "1")
    r = CliRunner().invoke(boom, [])
    assert r.exit_code == 2 and "Traceback" in r.output and "ConfigError" in r.output
    # and no command module keeps a handler of its own
    root = Path(core_cli.__file__).resolve().parents[1]
    own = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "cli.py" or p.parent.name != "core"
        if "raise click.ClickException(str(e))" in p.read_text() or 'secho(f"Error: {e}"' in p.read_text()
    ]
    assert not own, f"modules with their own click error handler: {own}"


def test_installed_plugins_register_without_torch_and_a_config_error_answers_fast(tmp_path):
    """Every installed plugin (the examples with the dev install) registers without importing torch, so a
    config error costs no torch import (docs/plugins.md: about 0.6 s instead of about 3 s)."""
    code = (
        "import json, sys; from composer_plugins.core import plugins; plugins.get_registry(); "
        "infos = plugins.get_plugin_manager().plugin_infos(); "
        "print(json.dumps([[i.name for i in infos if not i.error], 'torch' in sys.modules]))"
    )
    env = {k: v for k, v in os.environ.items() if k != plugins.LOAD_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, timeout=120)
    names, torch_imported = json.loads(out.stdout.splitlines()[-1])
    assert {"focal", "reverse"} <= set(names) and torch_imported is False, (names, out.stderr[-2000:])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name_or_path: tiny}\nbogus_key: 1\n")
    beside = Path(sys.executable).with_name("composer-plugins")
    exe = str(beside) if beside.exists() else shutil.which("composer-plugins")
    r = subprocess.run([exe, "train", "-c", str(bad)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and f"{bad}:2: bogus_key" in r.stderr, r.stderr
