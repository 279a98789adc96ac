"""Advantage estimators as a plugin kind: the built-ins through the registry, composition, a third party's
estimator training through the Lightning module, located refusals, the deprecated ``rollout.advantage_kwargs``."""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from composer_plugins.core.config import Config
from composer_plugins.core.errors import ConfigError, PluginDeprecationWarning
from composer_plugins.losses.advantages import group_advantages, rloo_advantages
from composer_plugins.training.config.loss_specs import advantage_estimator

NAN = float("nan")
REWARDS = torch.tensor([1.0, 0.0, 0.5, NAN, 0.2, 0.2, 0.9, 0.1, 1.0, 1.0, 1.0, 0.0])

#: A third party's package: one estimator (A = r - baseline) that records what it was given.
REINFORCE = """
import torch
from composer_plugins import hookimpl

CALLS = []


class FixedBaseline:
    '''REINFORCE with a fixed baseline: A = r - baseline.'''

    def __init__(self, baseline=0.5):
        self.baseline = float(baseline)

    def __call__(self, rewards, group_size):
        out = torch.nan_to_num(rewards - self.baseline, nan=0.0)
        CALLS.append((rewards.clone(), group_size, out))
        return out


@hookimpl
def register_advantage_estimators(register):
    register("reinforce", FixedBaseline, "REINFORCE with a fixed baseline.")
"""


def _install(site: Path, dist: str, module: str, code: str, monkeypatch, plugins) -> None:
    """``module`` (``code``) in an installed-looking distribution ``dist`` with a ``composer_plugins`` entry point,
    loaded alone (besides the built-ins)."""
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[composer_plugins]\n{module} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(plugins.LOAD_ENV, module)
    sys.modules.pop(module, None)
    plugins.reset()


@pytest.fixture
def reinforce(tmp_path, monkeypatch, isolated_plugins):
    """The third party's distribution (``cp-reinforce``) installed and loaded."""
    _install(tmp_path / "site", "cp-reinforce", "cp_reinforce", REINFORCE, monkeypatch, isolated_plugins)
    yield __import__("cp_reinforce")
    sys.modules.pop("cp_reinforce", None)


@pytest.mark.parametrize(
    ("spec", "old"),
    [
        ("group", lambda r: group_advantages(r, 4)),
        ({"name": "group", "scale": "batch", "eps": 1e-2}, lambda r: group_advantages(r, 4, "batch", eps=1e-2)),
        ({"name": "group", "scale": "none"}, lambda r: group_advantages(r, 4, "none")),
        ("rloo", lambda r: rloo_advantages(r, 4)),
        ({"name": "rloo", "scale": "batch"}, lambda r: rloo_advantages(r, 4, normalize=True)),
    ],
)
def test_the_builtins_through_the_registry_are_the_old_functions(spec, old):
    est = advantage_estimator(spec, "losses.grpo.advantage")
    out = est(REWARDS.clone(), 4)
    assert torch.equal(out, old(REWARDS.clone())) and out.abs().sum() > 0


def test_a_composition_is_the_weighted_sum_of_its_estimators():
    spec = {"compose": [{"name": "group", "weight": 0.7}, {"name": "rloo", "weight": 0.3, "scale": "batch"}]}
    out = advantage_estimator(spec, "losses.grpo.advantage")(REWARDS.clone(), 4)
    want = 0.7 * group_advantages(REWARDS, 4) + 0.3 * rloo_advantages(REWARDS, 4, normalize=True)
    assert torch.allclose(out, want, atol=1e-7) and not torch.allclose(out, group_advantages(REWARDS, 4))


def test_hook_register_advantage_estimators(reinforce):
    from composer_plugins.core.plugins import get_registry
    from composer_plugins.testing import check

    entry = get_registry().get("advantage_estimators", "reinforce")
    assert entry.provider == "cp-reinforce 0.1.0" and entry.description == "REINFORCE with a fixed baseline."
    assert {"group", "rloo", "reinforce"} <= set(get_registry().names("advantages"))
    for name in ("group", "rloo", "reinforce"):
        check("advantage_estimators", name)  # the kind's conformance checks, built-ins and third party alike


def test_a_third_party_estimator_composed_with_group_trains_through_the_lightning_module(reinforce, make_cfg):
    """0.5·A_group + 0.5·A_reinforce drives ``grpo``: at the first (on-policy, ratio 1) step its loss is
    -mean(A) = -0.5·mean(r - 0.2), the group part summing to zero in each group."""
    from composer_plugins.training.runs.run import run_train

    cfg, src = make_cfg(
        """
        losses:
          grpo:
            weight: 1.0
            advantage:
              compose: [{name: group, weight: 0.5}, {name: reinforce, weight: 0.5, baseline: 0.2}]
        """
    )
    res = run_train(cfg, src)
    assert [r["step"] for r in res.history] == [1, 2]
    assert len(reinforce.CALLS) >= 2 and all(g == 4 and len(r) == 8 for r, g, _ in reinforce.CALLS)
    rewards, _, own = reinforce.CALLS[0]
    assert torch.equal(own, torch.nan_to_num(rewards - 0.2))
    assert res.history[0]["train/grpo/loss"] == pytest.approx(-0.5 * float(own.mean()), abs=2e-3)
    assert float(own.mean()) != 0.0


def test_an_unknown_estimator_is_refused_at_its_line_with_the_closest_name(make_cfg, tiny_yaml):
    with pytest.raises(ConfigError) as err:
        make_cfg("losses:\n  grpo:\n    weight: 1.0\n    advantage: {name: rlo, scale: batch}\n")
    e = err.value
    assert (e.key, e.line) == ("losses.grpo.advantage.name", len(tiny_yaml.splitlines()) + 4), str(e)
    assert "Did you mean" in str(e) and "'rloo'" in str(e) and "group" in str(e)
    text = "losses:\n  grpo:\n    advantage:\n      compose:\n        - {name: group, weight: 0.7}\n"
    with pytest.raises(ConfigError) as err:
        make_cfg(text + "        - {name: groop, weight: 0.3}\n")
    assert (err.value.key, err.value.line) == ("losses.grpo.advantage.compose.1.name", len(tiny_yaml.splitlines()) + 6)
    assert "Did you mean: 'group'" in str(err.value)
    with pytest.raises(ConfigError, match="compose: \\[") as err:
        make_cfg(text.replace("compose:\n        - {name: group, weight: 0.7}", "compose: []"))
    from composer_plugins.training.step.components import build_channels

    cfg, src = make_cfg("losses:\n  grpo: 1.0\n  hint_distill:\n    advantage: rloo\n")
    with pytest.raises(ConfigError, match="reads no advantages") as err:  # not a policy channel
        build_channels(cfg, src)
    assert (err.value.key, err.value.line) == ("losses.hint_distill.advantage", len(tiny_yaml.splitlines()) + 4)
    src = Config({}, source="run.yaml", lines={"losses.grpo.advantage.scale": 4})
    with pytest.raises(ConfigError) as err:  # a setting the estimator refuses: built at its line
        advantage_estimator({"name": "rloo", "scale": "group"}, "losses.grpo.advantage", src)
    assert (err.value.key, err.value.line) == ("losses.grpo.advantage.scale", 4)


def test_rollout_advantage_kwargs_still_works_with_a_deprecation_warning_naming_the_new_key(make_cfg):
    from composer_plugins.training.step.components import StepComponents

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg, src = make_cfg("", "rollout.advantage_kwargs={estimator: rloo, scale: batch}")
    msgs = [str(w.message) for w in seen if issubclass(w.category, PluginDeprecationWarning)]
    assert msgs and "rollout.advantage_kwargs: is deprecated" in msgs[0], msgs
    assert "set losses.<key>.advantage: {name: rloo, scale: batch} on the policy channel" in msgs[0], msgs
    assert cfg.rollout.advantage_kwargs == {"estimator": "rloo", "scale": "batch"}
    parts = StepComponents.from_config(cfg, src)  # the old key still drives the record's advantages
    assert parts.experience.advantage_kwargs == {"estimator": "rloo", "scale": "batch"}


def test_the_docs_example_estimator_and_config_build_what_they_say(tmp_path, monkeypatch, isolated_plugins):
    """docs/plugins.md's third-party estimator, installed as its own package, and its YAML example."""
    import re

    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.step.components import build_channels

    doc = (Path(__file__).resolve().parents[3] / "docs" / "plugins.md").read_text()
    section = doc.split("### register_advantage_estimators(register)\n", 1)[1].split("\n### ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    _install(tmp_path / "site", "cp-reinforce-doc", "composer_plugins_reinforce", code, monkeypatch, isolated_plugins)
    try:
        cfg, src = loads_train_config(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
        chans = {c.name: c for c in build_channels(cfg, src)}
    finally:
        sys.modules.pop("composer_plugins_reinforce", None)
    r = REWARDS.clone()
    assert torch.equal(chans["grpo"].advantage_estimator(r, 4), rloo_advantages(r, 4, normalize=True))
    want = 0.7 * group_advantages(r, 4) + 0.3 * torch.nan_to_num(r - 0.5)
    assert torch.allclose(chans["dapo"].advantage_estimator(r, 4), want, atol=1e-7)
