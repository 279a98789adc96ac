"""The rollout stage: the SFT policy sampled on training tasks, scored and written as OpenAI-messages traces."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from composer_plugins.core.io import atomic_write_json, read_jsonl
from composer_plugins.pipeline.common import env_key, param_error, section, write_jsonl
from composer_plugins.pipeline.stage_prepare import build_env

ROLLOUT_KEYS = (
    "env",
    "num_prompts",
    "num_generations",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "batch_size",
    "max_prompt_length",
)


def rollout(
    params: Mapping[str, Any], model: str, tasks_path: str | os.PathLike[str], out: str | os.PathLike[str]
) -> dict[str, Any]:
    """Sample the policy at ``model`` on the first ``rollout.num_prompts`` tasks of ``tasks_path``.

    Writes one OpenAI-messages trace per completion (``{"id", "messages", "metadata"}``; the
    metadata holds the task fields, the env reward and ``correct``) and returns summary stats.
    """
    import torch

    from composer_plugins.models.generation import generate_completions
    from composer_plugins.models.tiny import load_policy
    from composer_plugins.training.rollout.chat import PROMPT_KEYS, install_chat_template, task_conversation
    from composer_plugins.training.rollout.rewards import env_rewards, task_prompt

    r = section(params, "rollout", ROLLOUT_KEYS)
    env_spec = r.get("env") or (params.get("train") or {}).get("env") or "gsm8k"
    env = build_env(env_spec)
    env_name = env_key(env_spec)
    tasks = read_jsonl(tasks_path)[: int(r.get("num_prompts", 32))]
    if not tasks:
        raise param_error(params, "rollout.num_prompts", f"no tasks in {tasks_path}")
    G = int(r.get("num_generations", 2))
    bs = max(1, int(r.get("batch_size", 16)))
    seed = int(r.get("seed", 0))
    thr = float(((params.get("train") or {}).get("rollout") or {}).get("success_threshold", 1.0))
    torch.manual_seed(seed)
    policy, tok = load_policy(model)
    chat = str((((params.get("train") or {}).get("model")) or {}).get("chat_template", "auto"))
    install_chat_template(tok, chat)
    rows: list[dict[str, Any]] = []
    rewards: list[float] = []
    report_every = max(bs, -(-len(tasks) // 4 // bs) * bs)  # about four progress lines (a log, not a bar)
    for b0 in range(0, len(tasks), bs):
        if b0 and b0 % report_every == 0:
            print(f"rollout: {b0}/{len(tasks)} prompts", file=sys.stderr, flush=True)
        chunk = tasks[b0 : b0 + bs]
        ro = generate_completions(
            policy,
            tok,
            [task_prompt(t, tok, chat) for t in chunk],
            G,
            max_new_tokens=int(r.get("max_new_tokens", 48)),
            temperature=float(r.get("temperature", 1.0)),
            top_p=float(r.get("top_p", 1.0)),
            top_k=int(r.get("top_k", 0)),
            seed=seed * 100_003 + b0,
            max_prompt_length=r.get("max_prompt_length"),
        )
        rs = env_rewards(env, chunk, ro.completions, G, unscorable=0.0)  # traces: unscorable = not correct
        for j, (comp, rew) in enumerate(zip(ro.completions, rs, strict=True)):
            i = b0 + j // G
            task = tasks[i]
            meta = {k: v for k, v in task.items() if k not in PROMPT_KEYS}
            meta.update(task_index=i, sample=j % G, reward=rew, correct=rew >= thr, env=env_name)
            rows.append(
                {
                    "id": f"{env_name}-{i}-{j % G}",
                    "messages": [
                        *(task_conversation(task) or [{"role": "user", "content": task_prompt(task)}]),
                        {"role": "assistant", "content": comp},
                    ],
                    "metadata": meta,
                }
            )
            rewards.append(rew)
    write_jsonl(out, rows)
    stats = {
        "traces": len(rows),
        "prompts": len(tasks),
        "reward_mean": sum(rewards) / len(rewards),
        "accuracy": sum(x >= thr for x in rewards) / len(rewards),
    }
    atomic_write_json(Path(str(out) + ".stats.json"), stats)
    return stats
