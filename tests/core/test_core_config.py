"""Config loading: located errors, overrides, env secrets, typed sections, components."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from composer_plugins.core.config import (
    Config,
    Secret,
    apply_overrides,
    build_component,
    component_spec,
    from_dict,
    load_config,
    loads_config,
    redact,
)
from composer_plugins.core.errors import ConfigError


@dataclass
class Optim:
    lr: float = 1e-3
    name: Literal["adamw", "sgd"] = "adamw"


@dataclass
class TrainCfg:
    steps: int
    optim: Optim = field(default_factory=Optim)
    tags: list[str] = field(default_factory=list)


YAML = """\
steps: 10
optim:
  lr: 0.01
  nmae: sgd
"""


def test_unknown_key_names_file_line_key_and_valid_keys(tmp_path):
    p = tmp_path / "train.yaml"
    p.write_text(YAML)
    cfg = load_config(p)
    with pytest.raises(ConfigError) as ei:
        from_dict(TrainCfg, cfg, cfg)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:4: optim.nmae: unknown key.")
    assert "Did you mean: 'name'?" in msg and "Valid keys: lr, name." in msg
    assert (ei.value.file, ei.value.line, ei.value.key) == (str(p), 4, "optim.nmae")


def test_wrong_type_and_bad_literal_and_missing_required():
    cfg = loads_config("steps: ten\n", source="c.yaml")
    with pytest.raises(ConfigError, match=r"c.yaml:1: steps: expected int, got 'ten'"):
        from_dict(TrainCfg, cfg, cfg)
    cfg = loads_config("steps: 1\noptim: {name: adam}\n", source="c.yaml")
    with pytest.raises(ConfigError, match="optim.name: expected one of 'adamw', 'sgd'"):
        from_dict(TrainCfg, cfg, cfg)
    cfg = loads_config("optim: {lr: 1}\n", source="c.yaml")
    with pytest.raises(ConfigError, match="steps: required key is missing"):
        from_dict(TrainCfg, cfg, cfg)


def test_typed_section_builds_nested_dataclasses():
    cfg = loads_config("steps: 3\noptim: {lr: 1}\ntags: [a, b]\n")
    t = from_dict(TrainCfg, cfg, cfg)
    assert t == TrainCfg(steps=3, optim=Optim(lr=1, name="adamw"), tags=["a", "b"])


def test_dotted_overrides_parse_yaml_values():
    cfg = loads_config(YAML.replace("nmae", "name"), overrides=["optim.lr=0.5", "steps=20", "new.deep.key=[1, 2]"])
    assert cfg["optim"]["lr"] == 0.5 and cfg["steps"] == 20 and cfg["new"]["deep"]["key"] == [1, 2]
    with pytest.raises(ConfigError, match="key.sub=value"):
        apply_overrides(Config(), ["novalue"])
    with pytest.raises(ConfigError, match="'steps' is a int"):
        apply_overrides({"steps": 1}, ["steps.x=1"])


def test_exponent_floats_without_a_dot_are_floats_in_files_overrides_and_merged_params(tmp_path):
    # PyYAML alone reads `1e-3` as the string '1e-3' (YAML 1.1 wants `1.0e-3`); DVC reads it as 0.001
    cfg = loads_config("optim: {lr: 1e-3}\nsteps: 3\n", overrides=["new.beta=5E-2", "new.big=+2e5", "new.s=1e3x"])
    assert cfg["optim"]["lr"] == 0.001 and isinstance(cfg["optim"]["lr"], float)
    assert cfg["new"] == {"beta": 0.05, "big": 200000.0, "s": "1e3x"} and cfg["steps"] == 3
    t = from_dict(TrainCfg, {"steps": 3, "optim": loads_config("lr: 1e-4")}, cfg)
    assert t.optim.lr == 1e-4

    from composer_plugins.core.cli import key_values
    from composer_plugins.pipeline.study import write_merged_params

    assert key_values(("lr=1e-3", "n=2"), "-S") == {"lr": 0.001, "n": 2}
    (tmp_path / "base.yaml").write_text("train: {optim: {lr: 3.0e-4}}\n")
    (tmp_path / "over.yaml").write_text("train: {optim: {lr: 1e-3}}\n")
    out = write_merged_params(tmp_path / "base.yaml", tmp_path / "over.yaml", tmp_path / "params.yaml")
    assert load_config(out)["train"]["optim"]["lr"] == 0.001  # not the quoted string '1e-3'


def test_invalid_yaml_reports_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        loads_config("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


def test_env_secrets_resolve_and_never_print(monkeypatch):
    monkeypatch.setenv("CP_TEST_KEY", "sk-very-secret")
    cfg = loads_config("teacher:\n  api_key: {$env: CP_TEST_KEY}\n")
    key = cfg["teacher"]["api_key"]
    assert isinstance(key, Secret) and key.reveal() == "sk-very-secret"
    assert "sk-very-secret" not in f"{key} {key!r} {cfg} {redact(cfg)}"
    assert key == "sk-very-secret"  # still compares as the value
    monkeypatch.delenv("CP_TEST_KEY")
    with pytest.raises(ConfigError, match="teacher.api_key: environment variable CP_TEST_KEY is not set") as ei:
        loads_config("teacher:\n  api_key: {$env: CP_TEST_KEY}\n", source="t.yaml")
    assert ei.value.line == 2


def test_redact_masks_key_like_fields():
    assert redact({"api_key": "abc", "api_key_env": "OPENAI_API_KEY", "n": 1}) == {
        "api_key": "****",
        "api_key_env": "OPENAI_API_KEY",
        "n": 1,
    }


def test_component_spec_forms():
    assert component_spec("grpo") == ("grpo", {})
    assert component_spec({"name": "grpo", "beta": 0.1}) == ("grpo", {"beta": 0.1})
    assert component_spec({"class_path": "collections.OrderedDict", "init_args": {"a": 1}}) == (
        "class_path:collections.OrderedDict",
        {"a": 1},
    )
    cfg = loads_config("loss:\n  class_path: x.Y\n  extra: 1\n", source="c.yaml")
    with pytest.raises(ConfigError, match=r"c.yaml:3: loss.extra: unknown key next to class_path"):
        component_spec(cfg["loss"], "loss", cfg)


def test_build_component_by_class_path_and_unknown_registry_name(isolated_plugins):
    assert build_component("losses", {"class_path": "collections.OrderedDict", "init_args": {"a": 1}}) == {"a": 1}
    cfg = loads_config("loss: no_such_loss_xyz\n", source="c.yaml")
    with pytest.raises(ConfigError, match=r"c.yaml:1: loss: Unknown loss channel 'no_such_loss_xyz'"):
        build_component("losses", cfg["loss"], "loss", cfg)
