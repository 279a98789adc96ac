"""One RL step: the read-only step record (``record``), the experience maker (``experience``), the assembler of
with-grad channel inputs and its input builders (``assemble``, ``input_builders``, ``input_plugin``), teacher
scoring (``teacher_scores``), the policy and its settings (``policy``), the optimizers (``optim``), the EMA
teacher (``ema``), the step's metrics (``metrics``) and the one place a config becomes a step's components
(``components``), used by the Lightning module and every backend alike.

Imports ``training.config`` and ``training.rollout``.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """0.2.0's ``composer_plugins.training.step`` was the module now at ``.record``: its names still resolve here, with
    a deprecation warning naming the new path (until 0.3.0)."""
    import importlib

    from composer_plugins.training import moved_warning

    module = importlib.import_module(f"{__name__}.record")
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    moved_warning(f"{__name__}.{name}", f"{__name__}.record.{name}")
    globals()[name] = value = getattr(module, name)  # `from pkg import name` looks a name up twice: warn once
    return value
