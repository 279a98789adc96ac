"""Training config: located, actionable errors (key, file:line, valid keys) and the CLI's config handling."""

from __future__ import annotations

import textwrap

import pytest
import yaml
from click.testing import CliRunner

from composer_plugins.core.cli import load_commands
from composer_plugins.core.errors import ConfigError
from composer_plugins.training.config.train import DEFAULT_CONFIG, TrainConfig, load_train_config
from composer_plugins.training.step.components import build_channels


def write(tmp_path, text: str):
    p = tmp_path / "run.yaml"
    p.write_text(textwrap.dedent(text).lstrip())
    return p


def test_packaged_default_loads_and_matches_schema():
    cfg, _ = load_train_config(None)
    assert isinstance(cfg, TrainConfig)
    assert cfg.model.name_or_path == "tiny" and cfg.rollout.num_generations == 8
    assert set(cfg.losses) >= {"grpo", "hint_distill"}
    assert DEFAULT_CONFIG.exists()


def test_unknown_key_names_file_line_and_valid_keys(tmp_path):
    p = write(
        tmp_path,
        """
        seed: 1
        rollout:
          num_generation: 4
    """,
    )
    with pytest.raises(ConfigError) as e:
        load_train_config(p)
    msg = str(e.value)
    assert f"{p}:3" in msg
    assert "rollout.num_generation" in msg
    assert "Did you mean: 'num_generations'" in msg
    assert "Valid keys:" in msg and "temperature" in msg and "max_new_tokens" in msg


def test_wrong_type_names_key_and_expected_type(tmp_path):
    p = write(
        tmp_path,
        """
        trainer:
          max_steps: ten
    """,
    )
    with pytest.raises(ConfigError) as e:
        load_train_config(p)
    assert f"{p}:2" in str(e.value) and "trainer.max_steps" in str(e.value) and "expected int" in str(e.value)


def test_literal_choice_and_range_checks(tmp_path):
    p = write(tmp_path, "optim:\n  name: adagrad\n")
    with pytest.raises(ConfigError, match=rf"{p}:2: optim\.name: Unknown optimizer 'adagrad'"):
        load_train_config(p)
    p = write(tmp_path, "rollout:\n  num_generations: 0\n")
    with pytest.raises(ConfigError, match=r"rollout\.num_generations: must be >= 1"):
        load_train_config(p)


def test_override_errors_are_located_too(tmp_path):
    p = write(tmp_path, "seed: 0\n")
    with pytest.raises(ConfigError, match=r"eval\.k: pass@8 needs eval.num_samples >= 8"):
        load_train_config(p, ["eval.k=8"])


def test_unknown_channel_lists_registered_channels(tmp_path):
    p = write(
        tmp_path,
        """
        losses:
          grpo: {weight: 1.0}
          hint_distil: {weight: 0.5}
    """,
    )
    with pytest.raises(ConfigError) as e:  # refused when the config is read (--print-config too), not at build
        load_train_config(p)
    msg = str(e.value)
    assert f"{p}:3" in msg and "losses.hint_distil" in msg
    assert "Did you mean: 'hint_distill'" in msg and "grpo" in msg and "replay_dpo" in msg


def test_unknown_channel_argument_lists_valid_parameters(tmp_path):
    p = write(
        tmp_path,
        """
        losses:
          grpo:
            weight: 1.0
            epsilon_lo: 0.1
    """,
    )
    cfg, src = load_train_config(p)
    with pytest.raises(ConfigError) as e:
        build_channels(cfg, src)
    msg = str(e.value)
    assert f"{p}:4" in msg and "losses.grpo.epsilon_lo" in msg
    assert "Did you mean: 'epsilon_low'" in msg and "enabled" in msg and "weight" in msg


@pytest.mark.parametrize(
    "line,key,words",
    [
        ("teacher: bogus", "teacher", ["'bogus'", "live, ema"]),
        ("ema_rate: 1.5", "ema_rate", ["(0, 1]", "1.5"]),
        ("ema_rate: 0", "ema_rate", ["(0, 1]"]),
    ],
)
def test_hint_teacher_values_are_refused_where_they_are_written(tmp_path, line, key, words):
    p = write(tmp_path, f"losses:\n  grpo: {{weight: 1.0}}\n  hint_distill:\n    weight: 0.5\n    {line}\n")
    cfg, src = load_train_config(p)
    with pytest.raises(ConfigError) as e:
        build_channels(cfg, src)
    msg = str(e.value)
    assert f"{p}:5" in msg and f"losses.hint_distill.{key}" in msg, msg
    assert all(w in msg for w in words), msg
    ok = write(tmp_path, "losses:\n  hint_distill: {teacher: ema, ema_rate: 0.1}\n")
    (ch,) = build_channels(*load_train_config(ok))
    assert (ch.teacher, ch.ema_rate) == ("ema", 0.1)


def test_bad_channel_switch_values(tmp_path):
    p = write(tmp_path, "losses:\n  grpo: {enabled: maybe}\n")
    with pytest.raises(ConfigError, match=r"losses\.grpo\.enabled: expected true or false"):
        load_train_config(p)
    p = write(tmp_path, "losses:\n  grpo: {weight: heavy}\n")
    with pytest.raises(ConfigError, match=r"losses\.grpo\.weight: expected a number"):
        load_train_config(p)


def test_disabled_channels_are_not_built(tmp_path):
    p = write(
        tmp_path,
        """
        losses:
          grpo: {weight: 1.0}
          hint_distill: {enabled: false, weight: 0.5}
          replay_dpo: false
          dapo: 0.25
    """,
    )
    cfg, src = load_train_config(p)
    chans = build_channels(cfg, src)
    assert [(c.name, c.weight) for c in chans] == [("grpo", 1.0), ("dapo", 0.25)]
    assert chans[1].loss_type == "dapo"


def test_section_selects_a_subtree(tmp_path):
    p = write(
        tmp_path,
        """
        prepare: {n: 3}
        train:
          seed: 7
          rollout: {num_generations: 4}
    """,
    )
    cfg, _ = load_train_config(p, ["rollout.temperature=0.7"], section="train")
    assert cfg.seed == 7 and cfg.rollout.num_generations == 4 and cfg.rollout.temperature == 0.7
    p2 = write(tmp_path, "train:\n  sed: 7\n")
    with pytest.raises(ConfigError) as e:
        load_train_config(p2, section="train")
    assert f"{p2}:2" in str(e.value) and "Did you mean: 'seed'" in str(e.value)


def test_cli_print_config_applies_overrides(tmp_path):
    p = write(tmp_path, "seed: 3\n")
    r = CliRunner().invoke(
        load_commands(), ["train", "-c", str(p), "--print-config", "losses.grpo.weight=0.3", "trainer.max_steps=5"]
    )
    assert r.exit_code == 0, r.output
    data = yaml.safe_load(r.output)
    assert data["seed"] == 3 and data["trainer"]["max_steps"] == 5 and data["losses"]["grpo"]["weight"] == 0.3


def test_cli_reports_config_errors_without_traceback(tmp_path):
    p = write(tmp_path, "rollout:\n  temprature: 0.5\n")
    for cmd in ("train", "sft", "eval"):
        r = CliRunner().invoke(load_commands(), [cmd, "-c", str(p), "--print-config"])
        assert r.exit_code != 0
        assert f"{p}:2" in r.output and "rollout.temprature" in r.output and "'temperature'" in r.output
        assert "Traceback" not in r.output


def test_cli_print_config_redacts_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_TOKEN", "s3cr3t-value")
    p = write(tmp_path, "mlflow:\n  tags: {api_token: {$env: MY_TOKEN}}\n")
    r = CliRunner().invoke(load_commands(), ["train", "-c", str(p), "--print-config"])
    assert r.exit_code == 0, r.output
    assert "s3cr3t-value" not in r.output


def test_overrides_edit_the_default_channel_set(tmp_path):
    p = write(tmp_path, "seed: 0\n")
    cfg, src = load_train_config(p, ["losses.hint_distill.enabled=false", "env.difficulty=easy"])
    assert [c.name for c in build_channels(cfg, src)] == ["grpo"]
    assert cfg.env == {"name": "gsm8k", "difficulty": "easy"}
    p = write(tmp_path, "losses:\n  dapo: {weight: 1.0}\n")
    cfg, src = load_train_config(p)
    assert [c.name for c in build_channels(cfg, src)] == ["dapo"]  # a file's own channel set replaces the default


def test_unknown_env_and_hint_provider_are_located(tmp_path):
    from composer_plugins.training.step.components import build_env

    p = write(tmp_path, "seed: 0\nenv: {name: gsm8kk, difficulty: trivial}\n")
    cfg, src = load_train_config(p)
    with pytest.raises(ConfigError) as e:
        build_env(cfg, src)
    assert f"{p}:2" in str(e.value) and "env" in str(e.value) and "'gsm8k'" in str(e.value)
    # the hint provider is built late (and deep inside SFT): its name is checked when the config loads
    p = write(tmp_path, "seed: 0\nenv: {name: gsm8k, difficulty: trivial}\nhints:\n  provider: templat\n")
    with pytest.raises(ConfigError) as e:
        load_train_config(p)
    assert str(e.value).startswith(f"{p}:4: hints.provider: Unknown hint 'templat'.") and "'template'" in str(e.value)


def test_switching_a_provider_by_name_on_the_command_line_shows_the_whole_spec_form():
    """``-S hints.provider.name=demonstration`` over a provider with arguments: the error shows the form that works."""
    from composer_plugins.training.config.train import load_train_config
    from composer_plugins.training.step.components import configured_hint_provider

    cfg, src = load_train_config(None, ["hints.provider.name=demonstration"])
    with pytest.raises(ConfigError) as e:
        configured_hint_provider(cfg, src)
    msg = str(e.value)
    assert "hints.provider.reveal_answer" in msg and "'hints.provider.name=demonstration'" in msg
    assert "-S 'hints.provider={name: demonstration}'" in msg
    cfg, src = load_train_config(None, ["hints.provider={name: demonstration, rows: all}"])
    assert configured_hint_provider(cfg, src).rows == "all"  # the form the error shows builds


# -- each section validates itself ---------------------------------------------------------------


def test_every_section_is_a_section_and_the_old_validators_are_gone():
    import dataclasses
    import importlib.util

    from composer_plugins.training.config import sections

    cfg = TrainConfig()
    nested = [f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))]
    assert {"model", "rollout", "optim", "trainer", "compute", "eval", "sft", "hints"} <= set(nested)
    for name in nested:
        assert isinstance(getattr(cfg, name), sections.Section), name
    assert importlib.util.find_spec("composer_plugins.training.limits") is None
    import composer_plugins.training.config.train as config_module

    assert not hasattr(config_module, "_check")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("RolloutSection(temperature=0.0)", "train.rollout.temperature: must be > 0, got 0.0."),
        ("RolloutSection(num_iterations=0)", "train.rollout.num_iterations: must be >= 1, got 0."),
        ("RolloutSection(importance_sampling='tokens')", "train.rollout.importance_sampling: unknown mode 'tokens'."),
        ("RolloutSection(generator='sever')", "train.rollout.generator: Unknown rollout_generator 'sever'."),
        ("OptimSection(lr=0.0)", "train.optim.lr: a learning rate must be > 0, got 0.0 — use a small positive"),
        ("OptimSection(name='adamm')", "train.optim.name: Unknown optimizer 'adamm'"),
        ("SFTSection(hint_kinds={'feedbak': 1})", "train.sft.hint_kinds.feedbak: unknown hint kind. Did you mean"),
        ("SFTSection(steps=-1)", "train.sft.steps: must be >= 0, got -1 — use a number of optimizer steps"),
        ("TrainerSection(strategy='dpp')", "train.trainer.strategy: unknown strategy 'dpp'. Did you mean: 'ddp'"),
        ("TrainerSection(keep_checkpoints=-2)", "train.trainer.keep_checkpoints: must be >= -1, got -2 — use -1"),
        ("ComputeSection(chunk_size=0)", "train.compute.chunk_size: must be >= 1, got 0."),
        ("EvalSection(k=5, num_samples=4)", "train.eval.k: pass@5 needs eval.num_samples >= 5."),
        ("EvalSection(temperature=float('nan'))", "train.eval.temperature: must be >= 0 (0: greedy samples), got nan."),
        ("HintsSection(provider='templat')", "train.hints.provider: Unknown hint 'templat'."),
        ("ModelSection(tiny=TinyModelConfig(hidden_size=30))", "train.model.tiny.num_heads: must divide model.tiny"),
    ],
)
def test_a_section_refuses_its_own_bad_values_at_its_key(section, message):
    """Each section checks itself, without the rest of the config; the error names the key it was given."""
    from composer_plugins.core.config import Config
    from composer_plugins.models.tiny import TinyModelConfig
    from composer_plugins.training.config import sections

    obj = eval(section, {**vars(sections), "TinyModelConfig": TinyModelConfig})
    key = "train." + type(obj).__name__.removesuffix("Section").lower()  # RolloutSection: train.rollout
    with pytest.raises(ConfigError) as e:
        obj.validate(Config(), key)
    assert str(e.value).startswith(message), str(e.value)
    type(obj)().validate(Config(), key)  # the defaults pass
