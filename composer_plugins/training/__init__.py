"""The training stack, in sub-packages by job (imports point down this list; tests/core/test_architecture.py checks it):

* :mod:`~composer_plugins.training.config`: the dataclasses of every section and the parsed loss specs.
* :mod:`~composer_plugins.training.rollout`: task streams, env rewards, rollout generators, chat templates.
* :mod:`~composer_plugins.training.step`: one RL step: the experience maker, the step record, the assembler and
  its input builders, the policy, optimizers and EMA teacher, and the builders of a step's components.
* :mod:`~composer_plugins.training.lightning`: ``ComposerModule``, the ``Trainer`` factory, callbacks,
  checkpoints, validation, curves and MLflow tracking.
* :mod:`~composer_plugins.training.runs`: ``run_train``/``run_eval``, SFT, the training CLI commands and the
  default plugin registering every built-in of ``training`` (``runs/plugin.py``).

``training`` imports ``core``, ``procs``, ``losses``, ``models``, ``envs`` and ``teachers`` only.

The flat module paths of 0.2 (``composer_plugins.training.assemble``, ``...input_builders``, ...) and 0.2.1's
``training.step.builders`` still import, with a :class:`~composer_plugins.core.errors.PluginDeprecationWarning` naming
the new path; they go in 0.3.0.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

#: 0.2's module name (below ``training``) -> its module now, or the modules its names went to (``config`` and ``step``
#: are sub-packages that forward their names).
MOVED: dict[str, str | tuple[str, ...]] = {
    "sections": "config.sections",
    "loss_specs": "config.loss_specs",
    "strategy_names": "config.strategy_names",
    "inputs": "config.inputs",
    "rollouts": "rollout.rollouts",
    "multiturn": "rollout.multiturn",
    "batches": "rollout.rewards",
    "chat": "rollout.chat",
    "distributed": "rollout.distributed",
    "experience": "step.experience",
    "assemble": "step.assemble",
    "input_builders": "step.input_builders",
    "input_plugin": "step.input_plugin",
    "teacher_scores": "step.teacher_scores",
    "components": "step.components",
    "builders": ("step.components", "lightning.tracking"),
    "step.builders": ("step.components", "lightning.tracking"),
    "metrics": "step.metrics",
    "policy": "step.policy",
    "ema": "step.ema",
    "optim": "step.optim",
    "module": "lightning.module",
    "trainer": "lightning.trainer",
    "strategy": "lightning.strategy",
    "callbacks": "lightning.callbacks",
    "checkpoints": "lightning.checkpoints",
    "progress": "lightning.progress",
    "tracking": "lightning.tracking",
    "evaluation": "lightning.evaluation",
    "curves": "lightning.curves",
    "run": "runs.run",
    "commands": "runs.commands",
    "sft": "runs.sft",
}


def moved_warning(old: str, new: str) -> None:
    """Warn once per call site that ``old`` (a 0.2 import path) is now ``new``."""
    from composer_plugins.core.errors import PluginDeprecationWarning

    warnings.warn(
        f"{old} moved to {new}: import it from there (the old path is refused from 0.3.0)",
        PluginDeprecationWarning,
        stacklevel=3,
    )


def forward_names(package: str, module: str) -> Callable[[str], Any]:
    """A sub-package's module ``__getattr__`` when 0.2.0's ``package`` was the module now at ``package.module``: its
    names still resolve on the package, with a deprecation warning naming the new path (until 0.3.0)."""

    def __getattr__(name: str) -> Any:
        target = importlib.import_module(f"{package}.{module}")
        if name.startswith("__") or not hasattr(target, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        moved_warning(f"{package}.{name}", f"{package}.{module}.{name}")
        value = getattr(target, name)
        setattr(sys.modules[package], name, value)  # `from pkg import name` looks a name up twice: warn once
        return value

    return __getattr__


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``composer_plugins.training.<old>`` as the module it moved to, with the warning."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(f"{__name__}.") and fullname[len(__name__) + 1 :] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = MOVED[spec.name[len(__name__) + 1 :]]
        homes = [f"{__name__}.{m}" for m in ((new,) if isinstance(new, str) else new)]
        moved_warning(spec.name, " and ".join(homes))
        if len(homes) == 1:
            return importlib.import_module(homes[0])
        module = types.ModuleType(spec.name, f"Moved to {' and '.join(homes)}.")
        module.__getattr__ = lambda name: _from_homes(homes, name)  # type: ignore[attr-defined]
        return module

    def exec_module(self, module) -> None:
        return None


def _from_homes(homes: list[str], name: str) -> object:
    for home in homes:
        module = importlib.import_module(home)
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"none of {homes} has {name!r}")


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
