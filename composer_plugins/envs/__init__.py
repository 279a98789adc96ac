"""Built-in envs, the code sandbox and hint providers (registered by :mod:`composer_plugins.envs.plugin`).

Public API (imported lazily, so ``import composer_plugins.envs`` stays cheap):

* :class:`~composer_plugins.envs.base.Env`, :class:`~composer_plugins.envs.base.Feedback`,
  :class:`~composer_plugins.envs.base.Observation`, :class:`~composer_plugins.envs.base.StepResult`;
* envs: ``GSM8KEnv``, ``CodeEnv``, ``FeatureDeletionEnv``, ``OpenEnvEnv``;
* ``Sandbox``, ``SandboxLimits``, ``SandboxResult``;
* hints: ``TemplateHintProvider``, ``RawErrorHintProvider``, ``LLMTeacherHintProvider``,
  ``ChainHintProvider``, ``DemonstrationHintProvider`` (and its ``SiblingGroup``), ``build_teacher_context``;
* ``extract_answer``, ``answers_match``.

Modules: ``base`` (the env contract), ``answers`` (answer checking), the envs (``gsm8k`` with its seeded
``arith`` problems, ``code_env``, ``feature_deletion`` with its source surgery in ``symbols``, ``openenv_env``),
``hints/`` (the hint-provider contract and the built-in providers, one module each), ``step_check`` (the
``step_check`` provider, over ``steps``: the worked steps of a solution), ``sandbox/`` (a package of its own:
``runner``, ``tree``, ``host``, ``types``), ``cli`` and ``plugin`` (registration). See ``docs/envs.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Env": "base",
    "Feedback": "base",
    "Observation": "base",
    "StepResult": "base",
    "GSM8KEnv": "gsm8k",
    "CodeEnv": "code_env",
    "FeatureDeletionEnv": "feature_deletion",
    "OpenEnvEnv": "openenv_env",
    "Sandbox": "sandbox",
    "SandboxLimits": "sandbox",
    "SandboxResult": "sandbox",
    "TemplateHintProvider": "hints",
    "RawErrorHintProvider": "hints",
    "LLMTeacherHintProvider": "hints",
    "ChainHintProvider": "hints",
    "DemonstrationHintProvider": "hints",
    "SiblingGroup": "hints",
    "build_teacher_context": "hints",
    "extract_answer": "answers",
    "answers_match": "answers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
