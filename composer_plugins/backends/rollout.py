"""The in-process pieces the upstream backends share: the step's components, seeded task draws, weights on the wire.

Built by the one path the native Lightning path uses
(:meth:`~composer_plugins.training.step.components.StepComponents.from_config`, ``task_drawer``), so a backend
differs from the native path only in the trainer, never in the data or the reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


class LocalRun:
    """The step's components (:class:`~composer_plugins.training.step.components.StepComponents`) and the task stream
    of one in-process run. ``parts``: :meth:`StepComponents.from_config` arguments (``channels``, ``advantage_kwargs``
    ...)."""

    def __init__(self, cfg: Any, src: Any = None, *, policy: Any = None, env: Any = None, **parts: Any) -> None:
        from composer_plugins.training.rollout.rewards import task_drawer
        from composer_plugins.training.step.components import StepComponents, build_env
        from composer_plugins.training.step.policy import load_policy_for

        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        self.cfg = cfg
        env = env if env is not None else build_env(cfg, src)
        if policy is None:
            policy, parts["tokenizer"] = load_policy_for(cfg, env)
        torch.manual_seed(cfg.seed)
        #: The one path from config to the step's pieces, as the Lightning module's.
        self.parts = StepComponents.from_config(cfg, src, policy=policy, env=env, **parts)
        self.policy, self.tokenizer, self.env = self.parts.policy, self.parts.tokenizer, self.parts.env
        self.sampler = self.parts.sampler
        self.draw = task_drawer(self.env, cfg, "train")

    def tasks(self, step: int) -> list[dict[str, Any]]:
        """The prompts of ``step`` (depend only on ``cfg.seed`` and ``step``)."""
        from composer_plugins.training.rollout.rewards import derive_seed

        return self.draw(self.cfg.rollout.prompts_per_step, derive_seed(self.cfg.seed, 0, step))

    def rollout(self, step: int) -> tuple[list[dict[str, Any]], Any, list[float], list[Any]]:
        """``(tasks, rollout, rewards, feedback)`` of ``step``, from the one sampler (weights pushed when due)."""
        from composer_plugins.training.rollout.rewards import derive_seed

        tasks = self.tasks(step)
        self.sampler.sync(self.policy, self.tokenizer, step, self.cfg.output_dir)
        seed = derive_seed(self.cfg.seed, 1, step)
        return (tasks, *self.sampler.sample(self.policy, self.tokenizer, self.env, tasks, seed))


def state_dict_cpu(model: Any) -> dict[str, Tensor]:
    """A detached CPU copy of ``model``'s weights (what actors send over the wire)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def load_weights(model: Any, weights: Mapping[str, Tensor]) -> None:
    """Copy ``weights`` into ``model`` in place (strict: every key must match)."""
    model.load_state_dict(dict(weights), strict=True)
