"""The versioned plugin contract (issue 51), with temporary third-party packages found through their entry points:

* a loss channel written for plugin API 1 (``forward(model_outputs, batch)``) trains, with one
  ``DeprecationWarning`` naming its file:line and the one-line fix;
* ``plugins`` and ``list`` run each registered component's contract check and mark a plugin that fails it,
  with the reason; a config naming that channel is refused when it loads, at its line, before any stage runs;
* a plugin that needs a newer plugin API is left out, saying so; the adapter is refused once it is removed.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from composer_plugins import PLUGIN_API_VERSION, __version__
from composer_plugins.core import version
from composer_plugins.losses import base

pytestmark = pytest.mark.slow

OLD = """
from composer_plugins import hookimpl
from composer_plugins.losses.base import LossChannel

COMPOSER_PLUGINS_API = "1"


class OldPolicyGradient(LossChannel):
    requires = ("logprobs", "advantages", "completion_mask")

    def forward(self, model_outputs, batch):
        mask = batch["completion_mask"].float()
        per_token = -batch["advantages"].unsqueeze(-1) * model_outputs["logprobs"]
        return (per_token * mask).sum() / mask.sum().clamp_min(1.0), {}


@hookimpl
def register_loss_channels(register):
    register("old_pg", OldPolicyGradient)
"""

BROKEN = """
from composer_plugins import hookimpl
from composer_plugins.losses.base import LossChannel


class Broken(LossChannel):
    def forward(self, logprobs, mask, advantages):
        raise AssertionError("never called")


@hookimpl
def register_loss_channels(register):
    register("broken_pg", Broken)
"""

FUTURE = """
from composer_plugins import hookimpl

COMPOSER_PLUGINS_API = "3.0"


@hookimpl
def register_loss_channels(register):
    register("future_pg", "x:y")
"""


def _package(root: Path, dist: str, module: str, code: str) -> Path:
    (root / f"{module}.py").write_text(textwrap.dedent(code).lstrip())
    info = root / f"{module}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[composer_plugins]\n{module.rsplit('_', 1)[1]} = {module}\n")
    return root / f"{module}.py"


@pytest.fixture
def packages(tmp_path: Path) -> Path:
    root = tmp_path / "site"
    root.mkdir()
    _package(root, "composer-plugins-old", "composer_plugins_old", OLD)
    _package(root, "composer-plugins-broken", "composer_plugins_broken", BROKEN)
    _package(root, "composer-plugins-future", "composer_plugins_future", FUTURE)
    return root


def _cli(root: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COMPOSER_PLUGINS_LOAD"}
    env.update(PYTHONPATH=os.pathsep.join([str(root), env.get("PYTHONPATH", "")]), COMPOSER_MLFLOW="0")
    env["COMPOSER_PLUGINS_LOAD"] = "old,broken,future"
    return subprocess.run(
        [sys.executable, "-m", "composer_plugins", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, s in enumerate(path.read_text().splitlines(), 1) if needle in s)


def test_an_api_1_channel_trains_with_one_deprecation_warning_naming_its_line(packages, tmp_path, tiny_yaml):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(tiny_yaml + f"output_dir: {tmp_path / 'run'}\nlosses:\n  old_pg: {{weight: 1.0}}\n")
    r = _cli(packages, "train", "-c", str(cfg), "-S", "sft.enabled=false", "-S", "trainer.max_steps=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    where = f"{packages / 'composer_plugins_old.py'}:{_line_of(packages / 'composer_plugins_old.py', 'def forward')}"
    warned = [s for s in r.stderr.splitlines() if "uses the plugin API 1 contract" in s]
    assert len(warned) == 1, r.stderr[-3000:]
    assert "DeprecationWarning" in warned[0] and where in warned[0], warned
    assert "Fix: def forward(self, inputs)" in warned[0] and "until composer-plugins 0.3.0" in warned[0]
    assert json.loads(r.stdout[: r.stdout.rindex("}") + 1])["train/old_pg/skipped"] == 0.0


FOCAL_0_1 = Path(__file__).parent.parent / "plugin_api1" / "composer_plugins_focal_loss.py"


def test_the_0_1_focal_example_unchanged_trains_two_steps_with_one_deprecation_warning(tmp_path, tiny_yaml):
    """The focal example as 0.1 shipped it (``git show 5c3fb90:examples/composer-plugins-focal/
    composer_plugins_focal_loss.py``, committed unchanged): its ``forward(model_outputs, batch)`` reads with 0.1's
    documented ``self.get(key, model_outputs, batch)``; through the Lightning path it trains two steps, warned
    once."""
    assert 'self.get("logprobs", model_outputs, batch)' in FOCAL_0_1.read_text()
    cfg = tmp_path / "run.yaml"
    spec = "{class_path: composer_plugins_focal_loss.FocalPolicyGradient, init_args: {gamma: 2.0}}"
    cfg.write_text(tiny_yaml + f"output_dir: {tmp_path / 'run'}\nlosses:\n  focal_pg: {spec}\n")
    env = {k: v for k, v in os.environ.items() if k != "COMPOSER_PLUGINS_LOAD"}
    env.update(PYTHONPATH=os.pathsep.join([str(FOCAL_0_1.parent), env.get("PYTHONPATH", "")]), COMPOSER_MLFLOW="0")
    env["COMPOSER_PLUGINS_LOAD"] = ""  # the installed 0.2 focal example stays out; the 0.1 file shadows it
    args = ["train", "-c", str(cfg), "-S", "sft.enabled=false", "-S", "trainer.max_steps=2"]
    r = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-m", "composer_plugins", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [s for s in r.stderr.splitlines() if "PluginDeprecationWarning" in s]
    assert len(warned) == 1, r.stderr[-3000:]
    assert f"{FOCAL_0_1}:{_line_of(FOCAL_0_1, 'def forward')}" in warned[0], warned
    assert "FocalPolicyGradient.forward(model_outputs, batch) uses the plugin API 1 contract" in warned[0]
    out = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    assert out["train/focal_pg/skipped"] == 0.0 and out["train/focal_pg/focal_weight"] > 0, out
    with open(tmp_path / "run" / "history.csv") as f:
        steps = [row["step"] for row in csv.DictReader(f)]
    assert steps == ["1", "2"] and "focal_pg/focal_weight" in open(tmp_path / "run" / "history.csv").readline()


def test_plugins_and_list_mark_a_failing_plugin_and_a_config_naming_it_is_refused_at_load(
    packages, tmp_path, tiny_yaml
):
    r = _cli(packages, "plugins", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    by = {d["name"]: d for d in json.loads(r.stdout)}
    assert by["old"]["contract"] == "ok"
    assert by["broken"]["contract"] == "FAILED"
    reason = by["broken"]["contract_failures"]["losses/broken_pg"]
    assert "forward(logprobs, mask, advantages) does not take one inputs mapping" in reason
    assert (
        "needs plugin API 3.0" in by["future"]["error"] and "pip install -U composer-plugins" in by["future"]["error"]
    )
    listed = _cli(packages, "list", "losses", "_pg", cwd=tmp_path)
    row = next(s for s in listed.stdout.splitlines() if s.startswith("broken_pg"))
    assert "FAILS its contract check" in row
    # a config naming it: refused when it loads, at its line, before any stage (no SFT, no output)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(tiny_yaml + f"output_dir: {tmp_path / 'run'}\nlosses:\n  broken_pg: {{weight: 1.0}}\n")
    r = _cli(packages, "train", "-c", str(cfg), cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    line = _line_of(cfg, "broken_pg:")
    err = next(s for s in r.stderr.splitlines() if s.startswith("Error:"))
    assert err.startswith(f"Error: {cfg}:{line}: losses.broken_pg: losses 'broken_pg' (composer-plugins-broken"), err
    assert "fails its contract check" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_api_versions_and_the_adapter_after_its_release(monkeypatch):
    assert version.PLUGIN_API_VERSION == PLUGIN_API_VERSION == "2.0" and __version__ == "0.2.3"
    assert version.api_problem(None) is None and version.api_problem("2") is None and version.api_problem("2.0") is None
    assert version.api_problem("1") is None  # served through adapters in 0.2.x
    assert "needs plugin API 2.1" in version.api_problem("2.1")
    assert not version.adapters_served("0.3.0") and version.adapters_served("0.2.9")

    class Old(base.LossChannel):
        def forward(self, model_outputs, batch):
            raise AssertionError

    monkeypatch.setattr(base, "adapters_served", lambda: False)
    with pytest.raises(TypeError, match=r"test_training_plugin_contract.py:\d+: .*does not take one inputs mapping"):
        base.check_contract(Old)
    assert "does not take one inputs mapping" in Old.contract_problem()
