"""The plugin surface: every contract a third-party package implements, one import away.

``from composer_plugins.api import hookimpl, LossChannel`` and so on. :data:`CONTRACTS` says, for each hook,
what its factory builds; each name is re-exported from the module where it lives (imported on first use, so
``import composer_plugins.api`` stays cheap), and those homes keep working. An optimizer is a
``torch.optim.Optimizer`` (``factory(params, **settings)``), a callback a ``lightning.pytorch.Callback``; the
errors a plugin raises (located, with a fix) come from here too. Hooks and their arguments: docs/plugins.md.
"""

from __future__ import annotations

from composer_plugins.core import lazy_exports

#: hook -> {home module: the contract its factories build (base classes, protocols and what they exchange)}
CONTRACTS: dict[str, dict[str, tuple[str, ...]]] = {
    "register_loss_channels": {"composer_plugins.losses.base": ("LossChannel",)},
    "register_advantage_estimators": {"composer_plugins.losses.advantages": ("AdvantageEstimator", "GroupAdvantage")},
    "register_teachers": {"composer_plugins.teachers.base": ("Teacher", "TeacherResponse", "Message")},
    "register_teacher_scorers": {
        "composer_plugins.teachers.scoring.contract": ("TeacherScorer", "TeacherScores", "ScoreRequest")
    },
    "register_envs": {"composer_plugins.envs.base": ("Env", "Feedback", "Observation", "StepResult")},
    "register_hint_providers": {
        "composer_plugins.envs.hints.contract": ("HintProvider", "HintRequest", "SiblingGroup")
    },
    "register_backends": {"composer_plugins.backends.base": ("Backend",)},
    "register_rollout_generators": {
        "composer_plugins.training.rollout.rollouts": ("RolloutGenerator", "EpisodeGenerator", "WeightSyncing"),
        "composer_plugins.models.generation": ("Rollout",),
    },
    "register_optimizers": {"torch.optim": ("Optimizer",)},
    "register_callbacks": {"lightning.pytorch": ("Callback",)},
    "register_codecs": {"composer_plugins.diloco.codecs": ("Codec", "CorruptObjectError")},
    "register_transports": {
        "composer_plugins.diloco.transports": ("Transport",),
        "composer_plugins.diloco.glue": ("DiLoCoCallbackBase",),
    },
    "register_executors": {"composer_plugins.diloco.executor": ("ReplicaExecutor", "ReplicaHandle")},
    "register_input_builders": {"composer_plugins.training.step.assemble": ("Assembly", "MissingInputError")},
    "register_commands": {},  # a click command added to the group the hook is given
}
_EXPORTS: dict[str, tuple[str, ...]] = {
    "composer_plugins.core.hookspecs": ("hookimpl",),
    "composer_plugins.core.errors": ("ComposerPluginsError", "ConfigError", "PluginDeprecationWarning"),
}
for _homes in CONTRACTS.values():
    for _module, _names in _homes.items():
        _EXPORTS[_module] = (*_EXPORTS.get(_module, ()), *_names)

__all__ = sorted(n for names in _EXPORTS.values() for n in names)

__getattr__ = lazy_exports(__name__, _EXPORTS)
