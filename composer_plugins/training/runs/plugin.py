"""Default plugin of ``training``: every built-in it registers, through the public hooks a third party implements.

Factories are lazy ``"module:attr"`` strings, so loading the plugins, listing them or answering a config error
imports no torch; the commands (:mod:`.commands`) import theirs only when they run.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl
from composer_plugins.training.runs.commands import eval_cmd, sft_cmd, train_cmd
from composer_plugins.training.step.input_plugin import BUILTINS

_ROLLOUTS = "composer_plugins.training.rollout.rollouts"


@hookimpl
def register_commands(cli: Any) -> None:
    """Attach the built-in training subcommands: ``train``, ``sft`` and ``eval``."""
    for cmd in (train_cmd, sft_cmd, eval_cmd):
        if cmd.name not in cli.commands:
            cli.add_command(cmd)


@hookimpl
def register_optimizers(register: Any) -> None:
    """Register the built-in optimizers (``torch.optim``; imported only when one is built)."""
    register("adamw", "torch.optim:AdamW", description="AdamW (decoupled weight decay); the default.")
    register("adam", "torch.optim:Adam", description="Adam.")
    register("sgd", "torch.optim:SGD", description="SGD with optional momentum.")


@hookimpl
def register_callbacks(register: Any) -> None:
    """Register Lightning's own general-purpose callbacks (imported only when one is built)."""
    register(
        "lr_monitor",
        "lightning.pytorch.callbacks:LearningRateMonitor",
        description="Log the learning rate of every optimizer step (needs a logger: mlflow.enabled).",
    )
    register(
        "model_summary",
        "lightning.pytorch.callbacks:ModelSummary",
        description="Print the policy's layers and parameter counts when training starts.",
    )


@hookimpl
def register_rollout_generators(register: Any) -> None:
    """Register the built-in rollout generators."""
    register(
        "hf",
        f"{_ROLLOUTS}:HFGenerator",
        description="HF generate on the policy in the training process (batched, KV cache).",
    )
    register(
        "server",
        f"{_ROLLOUTS}:ServerGenerator",
        description="An OpenAI-compatible /v1/completions server returning token ids and log-probs (vLLM, SGLang).",
    )
    register(
        "multi_turn",
        "composer_plugins.training.rollout.multiturn:MultiTurnGenerator",
        description="Tool-using envs' reset/step episodes, each turn sampled by the wrapped generator (hf).",
    )


@hookimpl
def register_input_builders(register: Any) -> None:
    """The built-in input builders (:data:`~composer_plugins.training.step.input_plugin.BUILTINS`), one entry per
    input name; a builder that provides several inputs runs once per assembly."""
    for attr, (names, description) in BUILTINS.items():
        for name in names:
            register(name, f"composer_plugins.training.step.input_builders:{attr}", description=description)
