"""A new user's first-hour config frictions (issue 41): the docs' YAML loads as written, negative weights are
refused where they would ascend, a misspelt loss fails ``--print-config``, and reading a config imports no torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from composer_plugins.core.errors import ConfigError
from composer_plugins.core.hookspecs import hookimpl
from composer_plugins.training.config.train import load_train_config, loads_train_config

ROOT = Path(__file__).resolve().parents[3]


def _yaml_blocks(doc: Path) -> list[tuple[int, str]]:
    text = doc.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```yaml\n(.*?)```", text, re.S)]


def test_every_yaml_example_of_docs_losses_md_loads_and_builds():
    from composer_plugins.training.step.components import build_channels

    blocks = _yaml_blocks(ROOT / "docs" / "losses.md")
    assert len(blocks) >= 2  # the list-form channel example and the teacher_distill example
    for line, text in blocks:
        cfg, src = loads_train_config(text)
        built = build_channels(cfg, src)
        assert [c.name for c in built] == list(cfg.losses), f"docs/losses.md:{line}"
    # the first block's `label` renames the channel; `name` still picks the plugin
    cfg, _ = loads_train_config(blocks[0][1])
    assert list(cfg.losses) == ["dapo", "grpo_kl", "hint_distill", "dppo"]
    assert cfg.losses["grpo_kl"] == {"name": "grpo", "weight": 0.5, "beta": 0.04}
    cfg, _ = loads_train_config(blocks[1][1])
    assert list(cfg.losses) == ["grpo", "teacher_distill"] and len(cfg.losses["teacher_distill"]["teachers"]) == 2


def test_list_form_of_losses_takes_overrides_and_stays_located(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("seed: 1\nlosses:\n  - {name: grpo, weight: 1.0}\n  - name: dapo\n    weight: heavy\n")
    with pytest.raises(ConfigError) as e:
        load_train_config(p)
    assert f"{p}:5: losses.dapo.weight" in str(e.value) and "expected a number" in str(e.value)
    cfg, _ = load_train_config(p, ["losses.dapo.weight=0.25", "losses.grpo.enabled=false"])
    assert cfg.losses == {
        "grpo": {"name": "grpo", "weight": 1.0, "enabled": False},
        "dapo": {"name": "dapo", "weight": 0.25},
    }
    # two channels of one kind need a label: refused at the second, with the fix
    p.write_text("losses:\n  - {name: grpo}\n  - {name: grpo, beta: 0.04}\n")
    with pytest.raises(ConfigError) as e:
        load_train_config(p)
    assert f"{p}:3: losses.1.name" in str(e.value) and "label:" in str(e.value)
    p.write_text("losses:\n  - {weight: 1.0}\n")
    with pytest.raises(ConfigError) as e:
        load_train_config(p)
    assert f"{p}:2: losses.0" in str(e.value) and "name:" in str(e.value)


def test_negative_weight_is_refused_located():
    with pytest.raises(ConfigError) as e:
        loads_train_config("losses:\n  grpo: {weight: 1.0}\n", ["losses.grpo.weight=-1"])
    msg = str(e.value)
    assert "losses.grpo.weight=-1" in msg and "negative" in msg and "allows_negative_weight" in msg
    with pytest.raises(ConfigError) as e:
        loads_train_config("seed: 0\nlosses:\n  - {name: dapo, weight: -0.5}\n")
    assert "<string>:3: losses.dapo.weight" in str(e.value)
    # a disabled channel and a zero weight are fine
    loads_train_config("losses:\n  grpo: {weight: 0.0}\n  dapo: {weight: -1, enabled: false}\n")
    # the Python API refuses it too
    from composer_plugins.losses.policy import PolicyLossChannel

    with pytest.raises(ValueError, match="negative"):
        PolicyLossChannel(weight=-1.0)


def test_a_channel_that_declares_it_takes_a_negative_weight(isolated_plugins):
    from composer_plugins.losses.base import LossChannel

    class Ascend(LossChannel):
        """Ascends its loss (test)."""

        allows_negative_weight = True

    class P:
        __name__ = "ascend_plugin"

        @hookimpl
        def register_loss_channels(self, register):
            register("ascend", Ascend)

    pm = isolated_plugins.make_plugin_manager(entrypoints=False)
    pm.register(P(), name="ascend_plugin")
    isolated_plugins.use_plugin_manager(pm)
    cfg, _ = loads_train_config("losses:\n  ascend: {weight: -0.5}\n")
    assert cfg.losses["ascend"]["weight"] == -0.5
    assert Ascend(weight=-0.5).weight == -0.5


def test_print_config_refuses_a_misspelt_loss_name(tmp_path):
    from composer_plugins.core.cli import load_commands

    p = tmp_path / "run.yaml"
    p.write_text("losses:\n  grpo: {weight: 1.0}\n  hint_distil: {weight: 1.0}\n")
    res = CliRunner().invoke(load_commands(), ["train", "-c", str(p), "--print-config"])
    assert res.exit_code == 2, res.output
    assert f"{p}:3: losses.hint_distil" in res.output and "Did you mean: 'hint_distill'" in res.output
    p.write_text("losses:\n  rl: {name: grpoo}\n")
    res = CliRunner().invoke(load_commands(), ["train", "-c", str(p), "--print-config"])
    assert res.exit_code == 2 and f"{p}:2: losses.rl.name" in res.output and "'grpo'" in res.output


_NO_TORCH = textwrap.dedent(
    """
    import json, sys
    from composer_plugins.core.cli import main
    try:
        main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
    heavy = sorted(m for m in ("torch", "lightning", "transformers", "mlflow") if m in sys.modules)
    print(json.dumps({"code": code, "heavy": heavy}))
    """
)


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
def test_a_config_error_and_print_config_import_no_torch(tmp_path, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  temperature: warm\n")
    env = {**__import__("os").environ, "COMPOSER_PLUGINS_LOAD": ""}
    for args, code in (([command, "-c", str(bad)], 2), ([command, "--print-config"], 0)):
        out = subprocess.run(
            [sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
        )
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res == {"code": code, "heavy": []}, (args, out.stderr)


def test_a_diloco_config_error_imports_no_torch(tmp_path):
    """``composer-plugins diloco -c <bad.yaml>`` is refused before the executors, transports or torch load."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("diloco:\n  sync_every: warm\n")
    env = {**__import__("os").environ, "COMPOSER_PLUGINS_LOAD": ""}
    for target in ("train",):  # the project target (the toy target lives beside its torch model)
        args = ["diloco", "--replicas", "2", "--target", target, "-c", str(bad)]
        out = subprocess.run(
            [sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
        )
        res = json.loads(out.stdout.strip().splitlines()[-1])
        assert res == {"code": 2, "heavy": []}, (args, out.stderr)
        assert f"{bad}:2: diloco.sync_every" in out.stderr
