"""Held-out evaluation of a :class:`~composer_plugins.training.module.ComposerModule`'s policy.

:func:`evaluate_tasks` (greedy accuracy and reward, ``eval.num_samples`` sampled completions per
task for pass@k) and :func:`hint_uplift` (does a hint fix what the policy gets wrong?) are plain
functions of the module; :func:`validation_step` logs them through the module's torchmetrics and
collects the per-problem predictions. The module's ``validation_step`` and ``evaluate_tasks`` call
these, as does any callback that evaluates between steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from composer_plugins.training.batches import derive_seed, env_rewards, sibling_group, task_prompt, teacher_contexts

__all__ = ["eval_generate", "evaluate_tasks", "hint_uplift", "validation_step"]


def eval_generate(
    module: Any,
    prompts: Sequence[str],
    n: int,
    *,
    seed: int | None,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    max_prompt_length: int | None = None,
) -> Any:
    """``n`` completions per prompt from the module's policy with the rollout's sampling settings.

    ``temperature=None``: greedy; ``0`` is greedy too (``eval.temperature: 0``), never the rollout's.
    """
    from composer_plugins.models.generation import generate_completions

    r = module.cfg.rollout
    greedy = temperature is None or temperature == 0
    return generate_completions(
        module.policy,
        module.tokenizer,
        list(prompts),
        n,
        max_new_tokens=max_new_tokens or r.max_new_tokens,
        temperature=1.0 if greedy else float(temperature),
        top_p=r.top_p,
        top_k=r.top_k,
        do_sample=not greedy,
        seed=None if greedy else seed,
        max_prompt_length=max_prompt_length or r.max_prompt_length,
    )


@torch.no_grad()
def evaluate_tasks(module: Any, tasks: Sequence[Mapping[str, Any]], seed: int) -> dict[str, Any]:
    """Greedy accuracy / reward and ``eval.num_samples`` sampled completions per task (pass@k, mean reward).

    Returns ``rewards_greedy``, ``correct_greedy`` (tensors per task), ``rewards_samples`` and
    ``correct_samples`` (``(tasks, num_samples)``, ``None`` without sampling), ``completions`` (greedy
    text) and, with ``eval.hint_uplift``, ``hint_uplift`` (:func:`hint_uplift`).
    """
    cfg = module.cfg
    e = cfg.eval
    thr = cfg.rollout.success_threshold
    prompts = [task_prompt(t, module.tokenizer, cfg.model.chat_template) for t in tasks]
    mnt = e.max_new_tokens or cfg.rollout.max_new_tokens
    greedy = eval_generate(module, prompts, 1, seed=None, max_new_tokens=mnt)
    r_greedy = torch.tensor(env_rewards(module.env, tasks, greedy.completions, 1, unscorable=0.0), device=module.device)
    out: dict[str, Any] = {
        "rewards_greedy": r_greedy,
        "correct_greedy": (r_greedy >= thr).float(),
        "correct_samples": None,
        "rewards_samples": None,
        "completions": greedy.completions,
    }
    if e.k > 0 and e.num_samples >= e.k:
        ro = eval_generate(module, prompts, e.num_samples, seed=seed, temperature=e.temperature, max_new_tokens=mnt)
        r = torch.tensor(
            env_rewards(module.env, tasks, ro.completions, e.num_samples, unscorable=0.0), device=module.device
        )
        out["correct_samples"] = (r >= thr).view(len(tasks), e.num_samples)
        out["rewards_samples"] = r.view(len(tasks), e.num_samples)
    if e.hint_uplift:
        out["hint_uplift"] = hint_uplift(module, tasks, greedy.completions, r_greedy, seed)
    return out


def hint_uplift(
    module: Any, tasks: Sequence[Mapping[str, Any]], greedy: Sequence[str], rewards: Tensor, seed: int
) -> dict[str, Any]:
    """Does a hint fix what the policy gets wrong? (``eval.hint_uplift``).

    For the problems whose greedy completion fails, the teacher context of ``hints.provider`` (as in
    training) is decoded greedily by the same policy. A provider that reads the rollout group gets, per
    failure, the group ``[greedy attempt, k samples]`` with the greedy attempt as the row:
    ``eval.hint_uplift_samples`` samples at ``eval.temperature``, whose successes are its siblings.
    Returns the counts ``failures``, ``hinted`` (got a hint), ``fixed`` (hinted and then solved) and
    per-row details for the predictions file.
    """
    from composer_plugins.envs.hints import reads_groups

    cfg = module.cfg
    e = cfg.eval
    thr = cfg.rollout.success_threshold
    mnt = e.max_new_tokens or cfg.rollout.max_new_tokens
    provider = module.uplift_provider
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
        prompts = [task_prompt(t, module.tokenizer, cfg.model.chat_template) for t in f_tasks]
        ro = eval_generate(module, prompts, k, seed=derive_seed(seed, 5), temperature=e.temperature, max_new_tokens=mnt)
        r = env_rewards(module.env, f_tasks, ro.completions, k, unscorable=0.0)
        groups = []
        for j, i in enumerate(failed):  # the failed greedy attempt is the row, the k samples its siblings
            comps, rs = ro.completions[j * k : (j + 1) * k], r[j * k : (j + 1) * k]
            groups.append(sibling_group([greedy[i], *comps], [float(rewards[i]), *rs], thr))
    contexts = teacher_contexts(
        module.env,
        provider,
        [tasks[i] for i in failed],
        [greedy[i] for i in failed],
        groups=groups,
        tokenizer=module.tokenizer,
        chat_template=cfg.model.chat_template,
    )
    hinted = [(i, c) for i, c in zip(failed, contexts, strict=True) if c is not None]
    out["hinted"] = len(hinted)
    if not hinted:
        return out
    ro = eval_generate(
        module, [c for _, c in hinted], 1, seed=None, max_new_tokens=mnt, max_prompt_length=cfg.hints.max_context_length
    )  # as the teacher reads it
    r_hint = env_rewards(module.env, [tasks[i] for i, _ in hinted], ro.completions, 1, unscorable=0.0)
    out["fixed"] = sum(1 for v in r_hint if v >= thr)
    for (i, ctx), comp, v in zip(hinted, ro.completions, r_hint, strict=True):
        out["rows"][i] = {"hint_context": ctx, "hinted_completion": comp, "hint_fixed": bool(v >= thr)}
    return out


def validation_step(module: Any, batch: Mapping[str, Any]) -> None:
    """Evaluate one validation batch ``{"index", "tasks"}`` and log it through the module's metrics."""
    cfg = module.cfg
    stats = evaluate_tasks(module, batch["tasks"], seed=derive_seed(cfg.eval.seed, 2, int(batch["index"])))
    module.val_accuracy.update(stats["correct_greedy"])
    # mean reward of the sampled completions (eval.temperature) when there are any, else greedy
    sampled = stats["rewards_samples"]
    module.val_reward.update(sampled.flatten() if sampled is not None else stats["rewards_greedy"])
    if stats["correct_samples"] is not None:
        module.val_pass.update(stats["correct_samples"])
    n = len(batch["tasks"])
    module.log("val/accuracy", module.val_accuracy, prog_bar=True, batch_size=n)
    module.log("val/mean_reward", module.val_reward, batch_size=n)
    if stats["correct_samples"] is not None:
        module.log(f"val/pass_at_{cfg.eval.k}", module.val_pass, batch_size=n)
    up = stats.get("hint_uplift")
    if up is not None:
        module.val_hint_fix.update(up["fixed"], up["hinted"])
        module.val_hint_coverage.update(up["hinted"], up["failures"])
        module.log("val/hint_fix_rate", module.val_hint_fix, batch_size=n)
        module.log("val/hint_coverage", module.val_hint_coverage, batch_size=n)
        for k in ("failures", "hinted", "fixed"):
            module.log(f"val/hint_{k}", float(up[k]), batch_size=n, reduce_fx="sum")
    if module.predictions is None:
        return
    for i, task in enumerate(batch["tasks"]):
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
        module.predictions.append(row)
