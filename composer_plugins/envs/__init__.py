"""Built-in envs, the code sandbox and hint providers (registered by :mod:`composer_plugins.envs.plugin`).

The public API is ``_EXPORTS`` below (imported lazily, so ``import composer_plugins.envs`` stays cheap). Modules:
``base`` (the env contract), ``answers`` (answer checking), the envs (``gsm8k`` with its seeded ``arith``
problems, ``code_env``, ``feature_deletion`` with its source surgery in ``symbols``, ``openenv_env``),
``hints/`` (the hint-provider contract and the built-in providers), ``step_check`` (over ``steps``: the worked
steps of a solution), ``sandbox/`` (a package of its own), ``cli`` and ``plugin`` (registration). See
``docs/envs.md``.
"""

from __future__ import annotations

from composer_plugins.core import lazy_exports

#: submodule -> the names imported lazily from it
_EXPORTS = {
    "base": ("Env", "Feedback", "Observation", "StepResult"),
    "gsm8k": ("GSM8KEnv",),
    "code_env": ("CodeEnv",),
    "feature_deletion": ("FeatureDeletionEnv",),
    "openenv_env": ("OpenEnvEnv",),
    "sandbox": ("Sandbox", "SandboxLimits", "SandboxResult"),
    "hints": (
        "TemplateHintProvider",
        "RawErrorHintProvider",
        "LLMTeacherHintProvider",
        "ChainHintProvider",
        "DemonstrationHintProvider",
        "SiblingGroup",
        "build_teacher_context",
    ),
    "answers": ("extract_answer", "answers_match"),
}

__all__ = sorted(n for names in _EXPORTS.values() for n in names)

__getattr__ = lazy_exports(__name__, _EXPORTS)
