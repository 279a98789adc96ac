"""Default plugin: registers the built-in teachers and the ``replay`` command through the public hooks."""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl


@hookimpl
def register_teachers(register: Any) -> None:
    """Register the built-in teachers (lazy: nothing heavy is imported until one is built)."""
    register(
        "openai",
        "composer_plugins.teachers.openai_compat:OpenAITeacher",
        description="Any OpenAI-compatible chat-completions endpoint (OpenRouter, vLLM, local) over async HTTP.",
        aliases=("openai_compat", "openrouter", "vllm"),
        requires=("aiohttp",),
        install="pip install aiohttp",
    )
    register(
        "hf",
        "composer_plugins.teachers.hf:HFTeacher",
        description="A local transformers causal LM loaded with from_pretrained (no hub access by default).",
        aliases=("transformers",),
        requires=("transformers", "torch"),
    )
    register(
        "oracle",
        "composer_plugins.teachers.oracle:OracleTeacher",
        description="Deterministic rule-based teacher for verifiable tasks (GSM8K-style arithmetic, or a solver).",
    )


@hookimpl
def register_teacher_scorers(register: Any) -> None:
    """Register the built-in scoring teachers (top-k log-probs of a student's completion, for teacher_distill)."""
    register(
        "causal_lm",
        "composer_plugins.teachers.scoring:LocalScorer",
        description="A frozen local causal LM (from_pretrained), batched, optionally on its own device.",
        aliases=("hf", "local"),
        requires=("transformers", "torch"),
    )
    register(
        "vllm",
        "composer_plugins.teachers.scoring:ServerScorer",
        description="vLLM /v1/completions prompt_logprobs through the replay engine (cache, budget, retries).",
        requires=("aiohttp",),
        install="pip install aiohttp",
    )
    register(
        "sglang",
        "composer_plugins.teachers.scoring:ServerScorer",
        description="SGLang /generate return_logprob + top_logprobs_num through the replay engine.",
        requires=("aiohttp",),
        install="pip install aiohttp",
        api="sglang",
    )


@hookimpl
def register_commands(cli: Any) -> None:
    """Add ``composer-plugins replay`` (run / record / states / normalize)."""
    from composer_plugins.teachers.cli import replay

    if "replay" not in getattr(cli, "commands", {}):
        cli.add_command(replay)
