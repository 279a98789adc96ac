"""The in-process pieces the upstream backends share: policy, env, seeded task draws, the one sampler, optimizer.

Built from the same :class:`~composer_plugins.training.config.TrainConfig` helpers the native
Lightning path uses (``load_policy_for``, ``build_env``, ``task_drawer``, ``env_rewards``,
``training.optim.build_optimizer``), so a
backend differs from the native path only in the trainer, never in the data or the reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


class LocalRun:
    """Policy, tokenizer, env, task stream and optimizer of one in-process run."""

    def __init__(
        self, cfg: Any, src: Any = None, *, policy: Any = None, tokenizer: Any = None, env: Any = None
    ) -> None:
        from composer_plugins.training.batches import task_drawer
        from composer_plugins.training.builders import build_env
        from composer_plugins.training.policy import apply_checkpointing, load_policy_for

        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        self.cfg = cfg
        self.env = env if env is not None else build_env(cfg, src)
        if policy is None:
            policy, tokenizer = load_policy_for(cfg, self.env)
        torch.manual_seed(cfg.seed)
        self.policy, self.tokenizer = policy, tokenizer
        self.policy.train()
        apply_checkpointing(self.policy, cfg)
        self.draw = task_drawer(self.env, cfg, "train")
        from composer_plugins.training.optim import build_optimizer

        self.optimizer = build_optimizer(cfg.optim, self.policy.parameters())
        from composer_plugins.training.experience import Sampler

        #: The one sampler (``rollout.generator``, sampling, multi-turn), as the Lightning module's.
        self.sampler = Sampler.from_config(cfg, src, self.env)

    def tasks(self, step: int) -> list[dict[str, Any]]:
        """The prompts of ``step`` (depend only on ``cfg.seed`` and ``step``)."""
        from composer_plugins.training.batches import derive_seed

        return self.draw(self.cfg.rollout.prompts_per_step, derive_seed(self.cfg.seed, 0, step))

    def rollout(self, step: int) -> tuple[list[dict[str, Any]], Any, list[float], list[Any]]:
        """``(tasks, rollout, rewards, feedback)`` of ``step``, from the one sampler (weights pushed when due)."""
        from composer_plugins.training.batches import derive_seed

        tasks = self.tasks(step)
        self.sampler.sync(self.policy, self.tokenizer, step, self.cfg.output_dir)
        seed = derive_seed(self.cfg.seed, 1, step)
        return (tasks, *self.sampler.sample(self.policy, self.tokenizer, self.env, tasks, seed))

    def optimizer_step(self, loss: Tensor) -> float:
        """:func:`~composer_plugins.backends.base.optimizer_step` of the policy (``trainer.gradient_clip_val``)."""
        from composer_plugins.backends.base import optimizer_step

        return optimizer_step(self.optimizer, self.policy.parameters(), loss, self.cfg.trainer.gradient_clip_val)


def state_dict_cpu(model: Any) -> dict[str, Tensor]:
    """A detached CPU copy of ``model``'s weights (what actors send over the wire)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def load_weights(model: Any, weights: Mapping[str, Tensor]) -> None:
    """Copy ``weights`` into ``model`` in place (strict: every key must match)."""
    model.load_state_dict(dict(weights), strict=True)
