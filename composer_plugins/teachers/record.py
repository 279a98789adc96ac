"""Record student traces: a policy (a local HF model) rolling out in a registered env.

See docs/replay.md, "Recording traces". The env protocol is duck-typed: ``reset`` (with or without ``seed=``), then
``step(action_text)`` giving a gym 4- or 5-tuple or an object/dict with ``observation``, ``reward``, ``done``. An
observation is a string (the user message), chat messages, a dict or object with ``messages`` / ``prompt`` /
``question`` / ``text``, or a step result wrapping one; when it repeats the whole conversation, only its new
turns are appended.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from composer_plugins.chat.env_step import step_result
from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.teachers.base import Message

_TEXT_KEYS = ("prompt", "question", "text", "content", "observation", "instruction")
_META_KEYS = ("answer", "solution", "target", "task_id", "id")


class RecordError(ComposerPluginsError):
    """The env or policy does not fit the recording protocol."""


@dataclass
class Episode:
    """One recorded episode."""

    id: str
    messages: list[Message]
    rewards: list[float]
    metadata: dict[str, Any]

    def to_record(self) -> dict[str, Any]:
        return {"id": self.id, "messages": self.messages, "metadata": {**self.metadata, "rewards": self.rewards}}


def observation_messages(obs: Any, env_name: str = "env") -> tuple[list[Message], dict[str, Any]]:
    """``(messages, metadata)`` from an observation (see the module docstring for accepted shapes)."""
    meta: dict[str, Any] = {}
    if obs is None:
        return [], meta
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}], meta
    if isinstance(obs, list):
        if all(isinstance(m, Mapping) and "role" in m for m in obs):
            return [dict(m) for m in obs], meta
        raise RecordError(f"env {env_name!r}: a list observation must be chat messages with 'role'")
    if not isinstance(obs, Mapping):
        if hasattr(obs, "observation") and not hasattr(obs, "messages"):
            return observation_messages(obs.observation, env_name)
        obs = {
            k: getattr(obs, k) for k in ("messages", *_TEXT_KEYS, *_META_KEYS, "metadata", "task") if hasattr(obs, k)
        }
    for extra in ("metadata", "task"):
        md = obs.get(extra)
        if isinstance(md, Mapping):
            meta.update({k: v for k, v in md.items() if k in _META_KEYS and _jsonable(v)})
            if extra == "metadata":
                meta.update({k: v for k, v in md.items() if _jsonable(v)})
    for k in _META_KEYS:
        if k in obs and obs[k] is not None and _jsonable(obs[k]):
            meta[k] = obs[k]
    if obs.get("messages"):
        msgs, _ = observation_messages(list(obs["messages"]), env_name)
        return msgs, meta
    for k in _TEXT_KEYS:
        v = obs.get(k)
        if isinstance(v, str) and v:
            return [{"role": "user", "content": v}], meta
        if v is not None and not isinstance(v, str):
            inner, inner_meta = observation_messages(v, env_name)
            if inner:
                return inner, {**inner_meta, **meta}
    raise RecordError(
        f"env {env_name!r}: cannot find the prompt in observation with keys {sorted(obs)}; "
        f"expected one of messages, {', '.join(_TEXT_KEYS)}"
    )


def _jsonable(v: Any) -> bool:
    return isinstance(v, str | int | float | bool) or v is None


def _reset(env: Any, seed: int) -> Any:
    try:
        return env.reset(seed=seed)
    except TypeError:
        return env.reset()


def record_episodes(
    policy: Any,
    env: Any,
    *,
    episodes: int = 8,
    max_turns: int = 4,
    seed: int = 0,
    env_name: str = "env",
    progress: bool = False,
) -> list[Episode]:
    """Roll ``policy`` (a :class:`~composer_plugins.teachers.hf.HFTeacher` or any ``act(messages)``) in ``env``."""
    if not hasattr(env, "reset") or not hasattr(env, "step"):
        raise RecordError(f"env {env_name!r} ({type(env).__name__}) has no reset()/step(); cannot record from it")
    out: list[Episode] = []
    it: Any = range(episodes)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"record {env_name}", unit="episode")
    for ep in it:
        obs = _reset(env, seed + ep)
        messages, meta = observation_messages(obs, env_name)
        if not messages:
            raise RecordError(f"env {env_name!r}: reset() gave an empty observation")
        rewards: list[float] = []
        for _turn in range(max_turns):
            action = _act(policy, messages)
            messages.append({"role": "assistant", "content": action})
            obs, reward, done, info = step_result(env.step(action), error=RecordError)
            rewards.append(0.0 if reward is None else float(reward))
            for k in _META_KEYS:
                if k in info and _jsonable(info[k]):
                    meta.setdefault(k, info[k])
            if done:
                break
            more, more_meta = observation_messages(obs, env_name)
            meta.update({k: v for k, v in more_meta.items() if k not in meta})
            if more[: len(messages)] == messages:  # the env returned the whole conversation: keep the new turns
                more = more[len(messages) :]
            if not more:
                break
            messages.extend(more)
        out.append(Episode(f"{env_name}-s{seed}-e{ep}", messages, rewards, {"env": env_name, "episode": ep, **meta}))
    return out


def _act(policy: Any, messages: list[Message]) -> str:
    if hasattr(policy, "generate"):
        return str(policy.generate(messages))
    if hasattr(policy, "act"):
        r = policy.act(messages)
        return r.text if hasattr(r, "text") else str(r)
    if callable(policy):
        return str(policy(messages))
    raise RecordError(f"policy {type(policy).__name__} cannot act: give an HF model path or a callable")


def record_to_file(
    policy_path: str | os.PathLike[str],
    env_name: str,
    out: str | os.PathLike[str],
    *,
    env_args: Mapping[str, Any] | None = None,
    episodes: int = 8,
    max_turns: int = 4,
    seed: int = 0,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Load the HF policy at ``policy_path``, build env ``env_name``, record, write JSONL; returns a summary."""
    import composer_plugins
    from composer_plugins.core.io import atomic_write_jsonl
    from composer_plugins.teachers.hf import HFTeacher

    env = composer_plugins.build("envs", env_name, **dict(env_args or {}))
    policy = HFTeacher(policy_path, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    policy.load()
    eps = record_episodes(
        policy, env, episodes=episodes, max_turns=max_turns, seed=seed, env_name=env_name, progress=progress
    )
    n = atomic_write_jsonl(out, [e.to_record() for e in eps])
    steps = sum(sum(1 for m in e.messages if m["role"] == "assistant") for e in eps)
    mean_reward = sum(sum(e.rewards) for e in eps) / max(1, len(eps))
    return {"episodes": n, "student_steps": steps, "mean_return": mean_reward, "out": str(out)}
