"""What a backend distribution may import from composer-plugins: this module (and :mod:`composer_plugins.api`).

The TRL, VeRL, PRIME-RL and Monarch packages under ``packages/`` import nothing else of the project
(``tests/core/test_architecture.py`` refuses any other ``composer_plugins`` import there), so the training
stack may move inside without breaking them, and a third-party backend has a list to rely on. Each name is
re-exported from the module where it lives, imported on first use (importing a name imports its home module).
"""

from __future__ import annotations

from composer_plugins.core import lazy_exports

#: home module -> the names a backend uses from it
_EXPORTS: dict[str, tuple[str, ...]] = {
    "composer_plugins": ("build",),
    "composer_plugins.core.config": ("to_dict",),
    "composer_plugins.core.errors": ("ComposerPluginsError", "ConfigError"),
    "composer_plugins.core.registry": ("KNOWN_BACKENDS",),
    "composer_plugins.losses": ("functional",),  # the functional loss API, as a module
    "composer_plugins.losses.base": ("ChannelComposer", "LossChannel"),
    "composer_plugins.losses.distill": ("TEACHERS",),
    "composer_plugins.losses.functional": ("chunked_logprobs",),
    "composer_plugins.losses.policy": ("CHANNEL_EPSILONS", "POLICY_KINDS"),
    "composer_plugins.losses.teacher_distill": (
        "TeacherTopKKernel",
        "sampled_token_divergence",
        "sampled_token_scored",
    ),
    "composer_plugins.backends": ("rollout", "support"),  # what an upstream backend reuses in process; its cells
    "composer_plugins.backends.base": ("Backend",),
    "composer_plugins.backends.rollout": ("load_weights", "state_dict_cpu"),
    "composer_plugins.backends.support": ("CLIP_OPTIONS", "LIMITS", "REFUSED", "RUNS", "Cell"),
    "composer_plugins.training.step.assemble": ("PAIR_INPUTS", "Needs", "StepPolicy", "assemble_inputs"),
    "composer_plugins.training.rollout.rewards": (
        "derive_seed",
        "env_rewards",
        "load_pairs",
        "render_pairs",
        "rollout_groups",
        "task_drawer",
    ),
    "composer_plugins.training.rollout.chat": ("install_chat_template", "task_conversation", "task_prompt"),
    "composer_plugins.training.step.components": ("StepComponents", "build_env"),
    "composer_plugins.training.config.train": ("train_config_from_dict",),
    "composer_plugins.training.step.ema": ("EMATeacher", "ema_pairs", "ema_update", "teacher_from"),
    "composer_plugins.training.step.experience": ("ExperienceMaker", "Sampler", "StepComputer", "refuse_own_sampling"),
    "composer_plugins.training.step.input_builders": ("PAIR_REF_KEYS", "cache_pair_references"),
    "composer_plugins.training.config.loss_specs": ("declared_channels",),
    "composer_plugins.training.step.metrics": ("scalar_metrics",),
    "composer_plugins.training.step.policy": (
        "decoder_body",
        "lm_head_weight",
        "load_policy",
        "load_policy_for",
        "resolve_policy",
    ),
    "composer_plugins.training.runs.run": ("run_train",),
    "composer_plugins.training.step.record": ("Rollout", "StepMeta", "StepRecord", "sample_pairs"),
    "composer_plugins.training.step.teacher_scores": ("build_teacher_scoring", "teacher_channels"),
}

__all__ = sorted(n for names in _EXPORTS.values() for n in names)

__getattr__ = lazy_exports(__name__, _EXPORTS)
