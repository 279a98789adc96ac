"""The ``multi_turn`` rollout generator: tool-using envs' ``reset``/``step`` episodes.

It wraps the configured generator and samples each turn with it (sampling, seeding and weight syncing are
the wrapped one's); :func:`build_generator` (the configured generator, the one the step's sampler uses) wraps it when
``rollout.max_turns > 1`` and the env has ``reset``/``step``. It keeps
:class:`~composer_plugins.training.rollout.rollouts.EpisodeGenerator`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from composer_plugins.chat.env_step import step_result
from composer_plugins.core.config import build_component
from composer_plugins.models.generation import Rollout, left_pad
from composer_plugins.training.rollout.rewards import derive_seed
from composer_plugins.training.rollout.rollouts import HFGenerator, WeightSyncing, as_rollout_generator

if TYPE_CHECKING:
    from composer_plugins.models.generation import Rollout
    from composer_plugins.training.rollout.rollouts import RolloutGenerator

__all__ = ["MultiTurnGenerator", "build_generator"]


def build_generator(cfg: Any, src: Any = None, env: Any = None) -> Any:
    """The rollout generator named by ``rollout.generator`` (registry kind ``rollout_generators``) of a
    :class:`~composer_plugins.training.config.train.TrainConfig`; with ``rollout.max_turns > 1`` and an ``env``
    that has ``reset``/``step``, wrapped in :class:`MultiTurnGenerator`."""
    spec = cfg.rollout.generator if cfg.rollout.generator is not None else "hf"
    gen = as_rollout_generator(build_component("rollout_generators", spec, key="rollout.generator", cfg=src), src=src)
    if isinstance(gen, HFGenerator) and not (isinstance(spec, Mapping) and "compile" in spec):
        gen.compile = cfg.rollout.compile
    if cfg.rollout.max_turns > 1 and hasattr(env, "reset") and hasattr(env, "step"):
        gen = MultiTurnGenerator(gen, max_turns=cfg.rollout.max_turns)
    return gen


class MultiTurnGenerator:
    """Episodes of ``env.reset(task)`` / ``env.step(action)``, each turn sampled by ``generator``.

    Args:
        generator: the wrapped generator: a built one, or a ``rollout_generators`` spec (default ``hf``).
            It must accept ``prompt_token_ids=`` (the trajectory so far as token ids).
        max_turns: turns per episode (an episode also ends when the env says it is done).
    """

    def __init__(self, generator: Any = "hf", max_turns: int = 2) -> None:
        if isinstance(generator, str | Mapping):
            generator = build_component("rollout_generators", generator, key="rollout.generator")
        self.inner: RolloutGenerator = as_rollout_generator(generator, "rollout.generator")
        self.max_turns = max(1, int(max_turns))

    # -- weight syncing: the wrapped generator's (WeightSyncing when it syncs, a no-op otherwise) --------
    @property
    def sync_every(self) -> int:
        """The wrapped generator's ``sync_every`` (0 when it holds no weights of its own)."""
        return int(self.inner.sync_every) if isinstance(self.inner, WeightSyncing) else 0

    @property
    def last_synced(self) -> int | None:
        """The wrapped generator's ``last_synced`` (set on it, so every rank's wrapped generator agrees)."""
        return self.inner.last_synced if isinstance(self.inner, WeightSyncing) else None

    @last_synced.setter
    def last_synced(self, step: int | None) -> None:
        if isinstance(self.inner, WeightSyncing):
            self.inner.last_synced = step

    def wants_sync(self, step: int) -> bool:
        """Whether the wrapped generator wants the policy's weights before step ``step``."""
        return isinstance(self.inner, WeightSyncing) and self.inner.wants_sync(step)

    def sync(self, policy: Any, tokenizer: Any, step: int, out_dir: str | Path | None = None) -> Any:
        """The wrapped generator's ``sync``; ``None`` when it holds no weights of its own."""
        if not isinstance(self.inner, WeightSyncing):
            return None
        return self.inner.sync(policy, tokenizer, step, out_dir=out_dir)

    def generate(self, policy: Any, tokenizer: Any, prompts: Sequence[str], num_generations: int, **kw: Any) -> Rollout:
        """One turn: the wrapped generator's ``generate``."""
        return self.inner.generate(policy, tokenizer, prompts, num_generations, **kw)

    def close(self) -> None:
        """Close the wrapped generator (when it has something to release)."""
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def episodes(
        self,
        policy: Any,
        tokenizer: Any,
        env: Any,
        tasks: Sequence[Mapping[str, Any]],
        num_generations: int,
        *,
        seed: int,
        max_prompt_length: int | None = None,
        **sampling: Any,
    ) -> tuple[Rollout, list[float], list[Any]]:
        """``(rollout, rewards, feedback)`` of the ``G`` episodes of each task.

        Every episode runs on a shallow copy of the env (its own episode state, shared score cache).
        Contexts are kept as token ids: turn ``k`` is generated from ``prompt + action_1 + observation_1
        + ...`` exactly as the trajectory is later scored, and only action tokens are trained on
        (observation tokens are masked out; ``extra["attention_mask"]`` attends to both). The episode
        reward is its last step's; the feedback of the last step goes to the hint provider.
        """
        G = num_generations
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        device = next(policy.parameters()).device
        episodes: list[dict[str, Any]] = []
        for t in tasks:
            for _ in range(G):
                e = copy.copy(env)
                prompt = _obs_text(e.reset(task=dict(t)))
                p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
                if max_prompt_length:
                    p_ids = p_ids[-max_prompt_length:]
                state = {"ids": [], "mask": [], "reward": 0.0, "done": False, "actions": [], "feedback": None}
                episodes.append({"env": e, "prompt": prompt, "prompt_ids": p_ids, **state})
        for turn in range(self.max_turns):
            live = [e for e in episodes if not e["done"]]
            if not live:
                break
            contexts = [e["prompt_ids"] + e["ids"] for e in live]
            ro = self.inner.generate(
                policy, tokenizer, None, 1, seed=derive_seed(seed, turn), prompt_token_ids=contexts, **sampling
            )
            for j, e in enumerate(live):
                act_ids = ro.completion_ids[j][ro.completion_mask[j].bool()].tolist()
                obs, reward, done, info = step_result(e["env"].step(ro.completions[j]))
                e["ids"] += act_ids
                e["mask"] += [1] * len(act_ids)
                e["actions"].append(ro.completions[j])
                e["reward"] = math.nan if reward is None else float(reward)  # unscorable: left out of the group
                e["feedback"] = (info or {}).get("feedback", getattr(obs, "feedback", None))
                if done or turn == self.max_turns - 1:
                    e["done"] = True
                    continue
                obs_ids = tokenizer("\n" + _obs_text(obs) + "\n", add_special_tokens=False)["input_ids"]
                e["ids"] += obs_ids
                e["mask"] += [0] * len(obs_ids)
        for e in episodes:
            close = getattr(e["env"], "close", None)
            if close is not None and e["env"] is not env:
                close()
        prompt_ids, prompt_mask = left_pad([e["prompt_ids"] for e in episodes], pad, device)
        width = max(1, max(len(e["ids"]) for e in episodes))
        cids = torch.full((len(episodes), width), pad, dtype=torch.long, device=device)
        cmask = torch.zeros((len(episodes), width), dtype=torch.long, device=device)
        attention = torch.zeros_like(cmask)  # every real token of a trajectory: actions and observations
        for i, e in enumerate(episodes):
            if e["ids"]:
                cids[i, : len(e["ids"])] = torch.tensor(e["ids"], device=device)
                cmask[i, : len(e["mask"])] = torch.tensor(e["mask"], device=device)
                attention[i, : len(e["ids"])] = 1
        rollout = Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=cids,
            completion_mask=cmask,
            completions=["\n".join(e["actions"]) for e in episodes],
            prompts=[e["prompt"] for e in episodes],
            group_index=torch.arange(len(tasks), device=device).repeat_interleave(G),
            num_generations=G,
        )
        rollout.extra["attention_mask"] = attention
        return rollout, [e["reward"] for e in episodes], [e["feedback"] for e in episodes]


def _obs_text(obs: Any) -> str:
    if isinstance(obs, str):
        return obs
    if isinstance(obs, Mapping):
        for k in ("text", "observation", "prompt"):
            if k in obs:
                return str(obs[k])
    for k in ("text", "observation", "prompt"):
        if hasattr(obs, k):
            return str(getattr(obs, k))
    return str(obs)
