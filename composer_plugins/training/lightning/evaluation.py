"""Held-out evaluation: a :class:`Validator` that is given what it reads and owns what it accumulates.

It owns its torchmetrics (greedy accuracy, mean reward, pass@k, hint uplift) and per-problem predictions; the
policy is passed to each call (under data parallel, the module's as it is wrapped). The Lightning module holds
one as a submodule so Lightning syncs its metrics. See docs/training.md "Evaluation".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from composer_plugins.envs.hints import reads_groups
from composer_plugins.models.generation import generate_completions
from composer_plugins.training.rollout.rewards import (
    derive_seed,
    env_rewards,
    sibling_group,
    task_prompt,
    teacher_contexts,
)
from composer_plugins.training.step.metrics import PassAtK, Ratio

if TYPE_CHECKING:
    from composer_plugins.training.config.sections import EvalSection
    from composer_plugins.training.config.train import TrainConfig

__all__ = ["Validator"]


class Validator(nn.Module):
    """Held-out evaluation of a policy on an env's tasks, with its own metrics and predictions.

    Args:
        cfg: the train config (``eval`` for what to measure; ``rollout`` for the sampling settings, the length
            limits and ``success_threshold``; ``model.chat_template``; ``hints.max_context_length``).
        tokenizer: the policy's tokenizer.
        env: scores the completions (``reward``), and gives hints their feedback.
        hint_provider: the provider ``eval.hint_uplift`` evaluates (``None``: uplift cannot run).
    """

    def __init__(self, cfg: TrainConfig, tokenizer: Any, env: Any, hint_provider: Any = None) -> None:
        super().__init__()
        self.cfg, self.tokenizer, self.env, self.hint_provider = cfg, tokenizer, env, hint_provider
        #: Greedy accuracy, mean reward (of the samples when there are any), unbiased pass@k.
        self.accuracy = MeanMetric()
        self.reward = MeanMetric()
        self.pass_at_k = PassAtK(cfg.eval.k)
        #: eval.hint_uplift: hinted greedy failures fixed / hinted, hinted / greedy failures
        self.hint_fix = Ratio()
        self.hint_coverage = Ratio()
        #: Set to a list to collect one row per validated problem (``eval.predictions``).
        self.predictions: list[dict[str, Any]] | None = None

    def generate(
        self,
        policy: Any,
        prompts: Sequence[str],
        n: int,
        *,
        seed: int | None,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        max_prompt_length: int | None = None,
    ) -> Any:
        """``n`` completions per prompt from ``policy`` with the rollout's sampling settings.

        ``temperature=None``: greedy; ``0`` is greedy too (``eval.temperature: 0``), never the rollout's.
        """
        r = self.cfg.rollout
        greedy = temperature is None or temperature == 0
        kw = {"top_p": r.top_p, "top_k": r.top_k, "do_sample": not greedy, "seed": None if greedy else seed}
        kw["max_new_tokens"] = max_new_tokens or r.max_new_tokens
        kw["max_prompt_length"] = max_prompt_length or r.max_prompt_length
        kw["temperature"] = 1.0 if greedy else float(temperature)
        return generate_completions(policy, self.tokenizer, list(prompts), n, **kw)

    def _rewards(self, tasks: Sequence[Mapping[str, Any]], completions: Sequence[str], n: int) -> list[float]:
        return env_rewards(self.env, tasks, completions, n, unscorable=0.0)

    @torch.no_grad()
    def evaluate(
        self, policy: Any, tasks: Sequence[Mapping[str, Any]], seed: int, settings: EvalSection | None = None
    ) -> dict[str, Any]:
        """Greedy accuracy / reward and ``eval.num_samples`` sampled completions per task (pass@k, mean reward).

        ``settings`` replaces ``cfg.eval`` for this call (the held-out curve turns sampling and uplift off).
        Returns ``rewards_greedy``, ``correct_greedy`` (tensors per task), ``rewards_samples`` and
        ``correct_samples`` (``(tasks, num_samples)``, ``None`` without sampling), ``completions`` (greedy
        text) and, with ``eval.hint_uplift``, ``hint_uplift`` (:meth:`hint_uplift`).
        """
        cfg = self.cfg
        e = settings if settings is not None else cfg.eval
        thr = cfg.rollout.success_threshold
        device = next(policy.parameters()).device
        prompts = [task_prompt(t, self.tokenizer, cfg.model.chat_template) for t in tasks]
        mnt = e.max_new_tokens or cfg.rollout.max_new_tokens
        greedy = self.generate(policy, prompts, 1, seed=None, max_new_tokens=mnt)
        r_greedy = torch.tensor(self._rewards(tasks, greedy.completions, 1), device=device)
        out: dict[str, Any] = {
            "rewards_greedy": r_greedy,
            "correct_greedy": (r_greedy >= thr).float(),
            "correct_samples": None,
            "rewards_samples": None,
            "completions": greedy.completions,
        }
        if e.k > 0 and e.num_samples >= e.k:
            ro = self.generate(policy, prompts, e.num_samples, seed=seed, temperature=e.temperature, max_new_tokens=mnt)
            r = torch.tensor(self._rewards(tasks, ro.completions, e.num_samples), device=device)
            out["correct_samples"] = (r >= thr).view(len(tasks), e.num_samples)
            out["rewards_samples"] = r.view(len(tasks), e.num_samples)
        if e.hint_uplift:
            out["hint_uplift"] = self.hint_uplift(policy, tasks, greedy.completions, r_greedy, seed, e)
        return out

    def hint_uplift(
        self,
        policy: Any,
        tasks: Sequence[Mapping[str, Any]],
        greedy: Sequence[str],
        rewards: Tensor,
        seed: int,
        settings: EvalSection | None = None,
    ) -> dict[str, Any]:
        """Does a hint fix what the policy gets wrong? (``eval.hint_uplift``).

        For the problems whose greedy completion fails, the teacher context of the hint provider (as in
        training) is decoded greedily by the same policy. A provider that reads the rollout group gets, per
        failure, the group ``[greedy attempt, k samples]`` with the greedy attempt as the row:
        ``eval.hint_uplift_samples`` samples at ``eval.temperature``, whose successes are its siblings.
        Returns the counts ``failures``, ``hinted`` (got a hint), ``fixed`` (hinted and then solved) and
        per-row details for the predictions file.
        """
        cfg = self.cfg
        e = settings if settings is not None else cfg.eval
        thr = cfg.rollout.success_threshold
        mnt = e.max_new_tokens or cfg.rollout.max_new_tokens
        provider = self.hint_provider
        if provider is None:
            raise ValueError("eval.hint_uplift needs hints.provider (a hint provider to evaluate)")
        failed = [i for i in range(len(tasks)) if float(rewards[i]) < thr]
        out: dict[str, Any] = {"failures": len(failed), "hinted": 0, "fixed": 0, "rows": {}}
        if not failed:
            return out
        groups = None
        if reads_groups(provider):
            k = max(1, int(e.hint_uplift_samples))
            f_tasks = [tasks[i] for i in failed]
            prompts = [task_prompt(t, self.tokenizer, cfg.model.chat_template) for t in f_tasks]
            ro = self.generate(
                policy, prompts, k, seed=derive_seed(seed, 5), temperature=e.temperature, max_new_tokens=mnt
            )
            r = self._rewards(f_tasks, ro.completions, k)
            groups = []
            for j, i in enumerate(failed):  # the failed greedy attempt is the row, the k samples its siblings
                comps, rs = ro.completions[j * k : (j + 1) * k], r[j * k : (j + 1) * k]
                groups.append(sibling_group([greedy[i], *comps], [float(rewards[i]), *rs], thr))
        contexts = teacher_contexts(
            self.env,
            provider,
            [tasks[i] for i in failed],
            [greedy[i] for i in failed],
            groups=groups,
            tokenizer=self.tokenizer,
            chat_template=cfg.model.chat_template,
        )
        hinted = [(i, c) for i, c in zip(failed, contexts, strict=True) if c is not None]
        out["hinted"] = len(hinted)
        if not hinted:
            return out
        contexts = [c for _, c in hinted]  # decoded as the teacher reads them
        ro = self.generate(
            policy, contexts, 1, seed=None, max_new_tokens=mnt, max_prompt_length=cfg.hints.max_context_length
        )
        r_hint = self._rewards([tasks[i] for i, _ in hinted], ro.completions, 1)
        out["fixed"] = sum(v >= thr for v in r_hint)
        for (i, ctx), comp, v in zip(hinted, ro.completions, r_hint, strict=True):
            out["rows"][i] = {"hint_context": ctx, "hinted_completion": comp, "hint_fixed": bool(v >= thr)}
        return out

    def greedy_accuracy(self, policy: Any, tasks: Sequence[Mapping[str, Any]], seed: int) -> float:
        """Greedy accuracy of ``policy`` on ``tasks`` (sampling and hint uplift off): the held-out curve's point."""
        quick = dataclasses.replace(self.cfg.eval, k=0, num_samples=0, hint_uplift=False)
        return float(self.evaluate(policy, tasks, seed, quick)["correct_greedy"].float().mean().item())

    def validation_step(self, policy: Any, batch: Mapping[str, Any], log: Callable[..., Any]) -> None:
        """Evaluate one validation batch ``{"index", "tasks"}``; log through ``log`` (``LightningModule.log``)."""
        e = self.cfg.eval
        stats = self.evaluate(policy, batch["tasks"], seed=derive_seed(e.seed, 2, int(batch["index"])))
        self.accuracy.update(stats["correct_greedy"])
        # mean reward of the sampled completions (eval.temperature) when there are any, else greedy
        sampled = stats["rewards_samples"]
        self.reward.update(sampled.flatten() if sampled is not None else stats["rewards_greedy"])
        if stats["correct_samples"] is not None:
            self.pass_at_k.update(stats["correct_samples"])
        n = len(batch["tasks"])
        log("val/accuracy", self.accuracy, prog_bar=True, batch_size=n)
        log("val/mean_reward", self.reward, batch_size=n)
        if stats["correct_samples"] is not None:
            log(f"val/pass_at_{e.k}", self.pass_at_k, batch_size=n)
        up = stats.get("hint_uplift")
        if up is not None:
            self.hint_fix.update(up["fixed"], up["hinted"])
            self.hint_coverage.update(up["hinted"], up["failures"])
            log("val/hint_fix_rate", self.hint_fix, batch_size=n)
            log("val/hint_coverage", self.hint_coverage, batch_size=n)
            for k in ("failures", "hinted", "fixed"):
                log(f"val/hint_{k}", float(up[k]), batch_size=n, reduce_fx="sum")
        if self.predictions is not None:
            self.predictions.extend(self._prediction_rows(batch["tasks"], stats, up))

    @staticmethod
    def _prediction_rows(
        tasks: Sequence[Mapping[str, Any]], stats: Mapping[str, Any], up: Mapping[str, Any] | None
    ) -> list[dict[str, Any]]:
        rows = []
        for i, task in enumerate(tasks):
            row = {k: v for k, v in task.items() if isinstance(v, str | int | float | bool | type(None))}
            row.update(
                completion=stats["completions"][i],
                reward=float(stats["rewards_greedy"][i]),
                correct=bool(stats["correct_greedy"][i] > 0),
            )
            if stats["correct_samples"] is not None:
                row["samples_correct"] = int(stats["correct_samples"][i].sum())
            if up is not None and i in up["rows"]:
                row.update(up["rows"][i])
            rows.append(row)
        return rows
