"""0.2.0's flat ``composer_plugins.training.<module>`` paths still import in 0.2.x, warning once with the new path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from composer_plugins.training import MOVED


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True, text=True
    )


def _refuses_unknown_names(module: str) -> str:
    """Code that fails unless ``module`` raises ``AttributeError`` naming an unknown name."""
    return (
        f"import {module} as m\n"
        "try:\n"
        "    m.NoSuchName\n"
        "except AttributeError as e:\n"
        "    assert 'NoSuchName' in str(e)\n"
        "else:\n"
        "    raise SystemExit('an unknown name resolved')\n"
    )


@pytest.mark.parametrize("old", ["assemble", "input_builders", "batches", "module"])
def test_an_old_module_path_is_the_new_module_with_a_warning(old):
    new = f"composer_plugins.training.{MOVED[old]}"
    code = (
        "import importlib, warnings\n"
        f"new = importlib.import_module({new!r})\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module('composer_plugins.training.{old}')\n"
        "assert old is new, (old, new)\n"
        "from composer_plugins.core.errors import PluginDeprecationWarning\n"
        "msgs = [str(x.message) for x in w if issubclass(x.category, PluginDeprecationWarning)]\n"
        f"assert len(msgs) == 1 and {new!r} in msgs[0] and '0.3.0' in msgs[0], msgs\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr


def test_names_of_the_old_config_and_step_modules_resolve_from_their_packages_with_a_warning():
    """``config`` and ``step`` were modules and are now sub-packages: their names still resolve there, warning."""
    code = (
        "import warnings\n"
        "from composer_plugins.core.errors import PluginDeprecationWarning\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    from composer_plugins.training.config import TrainConfig\n"
        "    from composer_plugins.training.step import StepRecord\n"
        "from composer_plugins.training.config.train import TrainConfig as T2\n"
        "from composer_plugins.training.step.record import StepRecord as S2\n"
        "assert TrainConfig is T2 and StepRecord is S2\n"
        "msgs = [str(x.message) for x in w if issubclass(x.category, PluginDeprecationWarning)]\n"
        "assert len(msgs) == 2, msgs\n"
        "assert 'config.train.TrainConfig' in msgs[0] and 'step.record.StepRecord' in msgs[1], msgs\n"
    ) + _refuses_unknown_names("composer_plugins.training.config")
    r = _run(code)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("old", ["step.builders", "builders"])
def test_the_builders_module_split_between_components_and_tracking_still_imports(old):
    """0.2.1's ``training.step.builders`` (0.2.0's ``training.builders``) went to ``step.components`` (the step's
    parts) and ``lightning.tracking`` (the run's MLflow logger): each name resolves from its home, one warning."""
    code = (
        "import warnings\n"
        "from composer_plugins.core.errors import PluginDeprecationWarning\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    from composer_plugins.training.{old} import build_channels, build_logger\n"
        "from composer_plugins.training.step.components import build_channels as c\n"
        "from composer_plugins.training.lightning.tracking import build_logger as t\n"
        "assert build_channels is c and build_logger is t\n"
        "msgs = [str(x.message) for x in w if issubclass(x.category, PluginDeprecationWarning)]\n"
        "assert len(msgs) == 1 and 'step.components' in msgs[0] and 'lightning.tracking' in msgs[0], msgs\n"
    ) + _refuses_unknown_names(f"composer_plugins.training.{old}")
    r = _run(code)
    assert r.returncode == 0, r.stderr
