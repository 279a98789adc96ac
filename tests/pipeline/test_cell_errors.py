"""A study cell's config error names the params.yaml line (or the ``-S`` override) its value came from."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_plugins.core.errors import ConfigError
from composer_plugins.pipeline.stage_train import cell_key_origin, train_cell
from composer_plugins.pipeline.study import load_params

PARAMS = """\
train:
  seed: 0
  env: {name: gsm8k, difficulty: trivial}
  optim:
    lr: 2.0e-5
  rollout:
    temperature: 0.5
  losses:
    grpo: {weight: 1.0}
study:
  seeds: [0]
  variants:
    fine: {}
    bad_lr:
      optim:
        lr: fast
    bad_weight:
      losses:
        grpo: {weight: -1}
    typo:
      rollout:
        num_generatons: 4
mlflow: {enabled: false}
"""


def _line(text: str, needle: str) -> int:
    return next(i for i, s in enumerate(text.splitlines(), 1) if needle in s)


@pytest.fixture
def params_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "params.yaml"
    p.write_text(PARAMS)
    return p


def _cell_error(params_file: Path, variant: str, overrides: tuple[str, ...] = ()) -> str:
    params = load_params(params_file.name, overrides)
    with pytest.raises(ConfigError) as e:
        train_cell(params, variant, 0, pairs=None, model="models/sft/model")
    return str(e.value)


@pytest.mark.parametrize(
    ("variant", "needle", "key"),
    [
        ("bad_lr", "lr: fast", "study.variants.bad_lr.optim.lr"),
        ("bad_weight", "weight: -1", "study.variants.bad_weight.losses.grpo.weight"),
        ("typo", "num_generatons", "study.variants.typo.rollout.num_generatons"),
    ],
)
def test_a_variants_bad_value_is_located_at_its_params_line(
    params_file: Path, variant: str, needle: str, key: str
) -> None:
    msg = _cell_error(params_file, variant)
    assert msg.startswith(f"params.yaml:{_line(PARAMS, needle)}: {key}: "), msg
    assert "runs/" not in msg and "config.yaml" not in msg
    if variant == "typo":
        assert "Did you mean: 'num_generations'" in msg  # the suggestion survives the relocation


def test_a_train_value_a_variant_inherits_is_located_at_the_train_line(params_file: Path) -> None:
    params_file.write_text(PARAMS.replace("temperature: 0.5", "temperature: warm"))
    msg = _cell_error(params_file, "fine")
    assert msg.startswith(f"params.yaml:{_line(PARAMS, 'temperature: 0.5')}: train.rollout.temperature: "), msg


def test_an_override_is_named_instead_of_the_file(params_file: Path) -> None:
    msg = _cell_error(params_file, "fine", ("train.optim.lr=zz",))
    assert msg.startswith("command-line override 'train.optim.lr=zz': train.optim.lr: expected float"), msg
    msg = _cell_error(params_file, "bad_lr", ("study.variants.bad_lr.optim.lr=slow",))
    assert msg.startswith("command-line override 'study.variants.bad_lr.optim.lr=slow'"), msg


def test_the_variant_wins_only_for_what_it_sets(params_file: Path) -> None:
    params = load_params(params_file.name)
    # bad_weight sets losses.grpo.weight; losses.grpo itself and other keys come from train
    assert cell_key_origin(params, "bad_weight", "losses.grpo.weight") == "study.variants.bad_weight.losses.grpo.weight"
    assert cell_key_origin(params, "bad_lr", "losses.grpo.weight") == "train.losses.grpo.weight"
    assert cell_key_origin(params, "bad_lr", "output_dir") is None  # set by the pipeline, not by params.yaml
