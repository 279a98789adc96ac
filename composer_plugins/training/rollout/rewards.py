"""What a training or validation step is fed: task streams, prompts, rewards, hinted contexts, pairs.

:class:`TaskStream` and :class:`StaticBatches` are the train and validation "dataloaders" (built by
:func:`task_drawer` / :func:`eval_batches`); the task-level helpers (:func:`env_rewards`,
:func:`teacher_contexts`, :func:`rollout_groups`, :func:`load_pairs`, :func:`render_pairs`) are shared by
the native loop and the backends.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from composer_plugins.core.errors import ConfigError
from composer_plugins.core.io import iter_jsonl, read_jsonl
from composer_plugins.envs.hints import HintProvider, SiblingGroup, hint_requests, sibling_groups
from composer_plugins.training.config.train import TrainConfig
from composer_plugins.training.rollout.chat import PROMPT_KEYS, hinted_context, pair_prompt, prompt_field, task_prompt
from composer_plugins.training.rollout.distributed import rank_share, world


def derive_seed(*parts: int) -> int:
    """A 31-bit seed mixed from integer ``parts`` (stable across processes and runs)."""
    h = 0x9E3779B1
    for p in parts:
        h = (h * 1_000_003 + int(p) + 0x7F4A7C15) % (2**61 - 1)
    return h % (2**31 - 1)


class TaskStream:
    """A resumable, length-known stream of prompt batches for Lightning.

    Batch ``i`` is ``{"index": i, "tasks": [...], "rank": r, "world_size": W}``: ``batch_size`` tasks drawn by
    ``draw(n, seed)`` from ``(seed, epoch, i)``, rank ``r`` keeping its contiguous share
    (:func:`~composer_plugins.training.rollout.distributed.rank_share`; ``rank``/``world_size`` default to the
    ``torch.distributed`` group's at iteration time). ``state_dict`` records the position, so Lightning's
    ``ckpt_path=...`` resumes each rank at its exact next share, under any world size.
    """

    def __init__(
        self,
        draw: Any,
        batch_size: int,
        num_batches: int,
        seed: int = 0,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.draw = draw
        self.batch_size = int(batch_size)
        self.num_batches = int(num_batches)
        self.seed = int(seed)
        self.position = 0
        self.epoch = 0
        self.rank = rank
        self.world_size = world_size

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rank, size = world()
        rank = rank if self.rank is None else int(self.rank)
        size = size if self.world_size is None else int(self.world_size)
        if self.position >= self.num_batches:
            self.position = 0
            self.epoch += 1
        while self.position < self.num_batches:
            i = self.position
            tasks = self.draw(self.batch_size, derive_seed(self.seed, self.epoch, i))
            if size > 1:
                tasks = rank_share(tasks, rank, size)
            self.position += 1
            yield {"index": self.epoch * self.num_batches + i, "tasks": tasks, "rank": rank, "world_size": size}

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch."""
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at the recorded position."""
        self.position = int(state["position"])
        self.epoch = int(state.get("epoch", 0))


class StaticBatches:
    """A fixed sequence of batches that Lightning treats as *one* dataloader (a plain list would be many)."""

    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = list(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


def task_kwargs(tasks: Sequence[Mapping[str, Any]], repeat: int = 1) -> dict[str, list[Any]]:
    """Column-wise task fields other than the prompt, each row repeated ``repeat`` times."""
    keys = dict.fromkeys(k for t in tasks for k in t if k not in PROMPT_KEYS)
    return {k: [t.get(k) for t in tasks for _ in range(repeat)] for k in keys}


def env_rewards(
    env: Any, tasks: Sequence[Mapping[str, Any]], completions: Sequence[str], repeat: int, unscorable: float = math.nan
) -> list[float]:
    """Rewards from ``env.reward(prompts, completions, **task_columns)``.

    ``None`` (unscorable) becomes ``unscorable``: NaN by default, so that ``group_advantages`` leaves
    the row out of its group's statistics and gives it advantage 0, as TRL does with a reward function's
    ``None``. Evaluation passes ``0.0`` (an unscorable answer is not a correct one).
    """
    prompts = [task_prompt(t) for t in tasks for _ in range(repeat)]
    rewards = env.reward(prompts, list(completions), **task_kwargs(tasks, repeat))
    if len(rewards) != len(completions):
        raise ValueError(f"env.reward returned {len(rewards)} rewards for {len(completions)} completions")
    return [float(unscorable) if r is None else float(r) for r in rewards]


def reference_completion(task: Mapping[str, Any]) -> str | None:
    """A task's reference completion (the dataset's output): its ``target``, else its worked ``solution`` after
    one space (as the prompt's ``Answer:`` is followed); ``None`` when it carries neither. SFT and off-policy
    steps (``rollout.on_policy_fraction``) read it here."""
    if task.get("target") is not None:
        return str(task["target"])
    if task.get("solution") is not None:
        return " " + str(task["solution"]).lstrip()
    return None


def env_feedback(env: Any, task: Mapping[str, Any], completion: str) -> Any:
    """``env.feedback(prompt, completion, **task)`` (free after ``reward``), or ``None`` if the env has none."""
    fn = getattr(env, "feedback", None)
    if fn is None:
        return None
    fields = {k: v for k, v in task.items() if k not in PROMPT_KEYS}
    return fn(task_prompt(task), completion, **fields)


def teacher_contexts(
    env: Any,
    provider: Any,
    tasks: Sequence[Mapping[str, Any]],
    completions: Sequence[str],
    feedbacks: Sequence[Any] | None = None,
    groups: Sequence[Any] | None = None,
    *,
    tokenizer: Any = None,
    chat_template: str = "auto",
) -> list[str | None]:
    """Hinted teacher contexts for the given rows (``None`` where the provider gives no hint), as the text
    the teacher reads: :func:`~composer_plugins.training.rollout.chat.hinted_context` with ``tokenizer`` and
    ``chat_template`` (the hint goes into the conversation of a chat prompt, which is then rendered
    like the student's).

    ``provider`` is a hint provider on the request contract (built by
    :func:`~composer_plugins.envs.hints.build_hint_provider`, which adapts older shapes once); it gets
    one :class:`~composer_plugins.envs.hints.HintRequest` per row. The feedback comes from the env
    (``env.feedback``) unless given (multi-turn episodes); ``groups`` (one
    :class:`~composer_plugins.envs.hints.SiblingGroup` per row) carries the rows' siblings and rewards.
    """
    if not isinstance(provider, HintProvider):
        raise TypeError(
            f"{type(provider).__name__} is not a built hint provider: build it once with "
            "composer_plugins.envs.hints.build_hint_provider(...)"
        )
    feedbacks = list(feedbacks) if feedbacks is not None else [None] * len(tasks)
    fbs = [
        fb if fb is not None else env_feedback(env, t, c)
        for fb, t, c in zip(feedbacks, tasks, completions, strict=True)
    ]
    prompts = [task_prompt(t) for t in tasks]
    requests = hint_requests(fbs, prompts, list(completions), list(tasks), list(groups) if groups is not None else None)
    hints = provider.hints(requests)
    if len(hints) != len(requests):
        raise ValueError(f"{type(provider).__name__}.hints returned {len(hints)} hints for {len(requests)} requests")
    raw = [prompt_field(t) for t in tasks]
    return [hinted_context(p, str(h), tokenizer, chat_template) if h else None for p, h in zip(raw, hints, strict=True)]


def sibling_group(
    completions: Sequence[Any], rewards: Sequence[float], success_threshold: float, index: int = 0
) -> Any:
    """One row's :class:`~composer_plugins.envs.hints.SiblingGroup` (the row at ``index``)."""
    return SiblingGroup(tuple(completions), tuple(float(r) for r in rewards), index, float(success_threshold))


def rollout_groups(
    completions: Sequence[Any], rewards: Sequence[float] | Tensor, group_size: int, success_threshold: float
) -> list[Any]:
    """One :class:`~composer_plugins.envs.hints.SiblingGroup` per rollout row (row ``i`` is in group ``i // G``)."""
    values = rewards.detach().float().cpu().tolist() if isinstance(rewards, Tensor) else [float(r) for r in rewards]
    return sibling_groups(list(completions), values, group_size, success_threshold)


def load_pairs(path: str | Path) -> list[dict[str, str]]:
    """Preference pairs from a JSONL file with ``prompt``, ``chosen``, ``rejected`` per line."""
    pairs = []
    for n, row in iter_jsonl(path):
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise ConfigError(f"preference pair lacks {missing}", file=str(path), line=n)
        pairs.append(row)
    return pairs


def render_pairs(
    pairs: Sequence[Mapping[str, Any]], tokenizer: Any = None, chat_template: str = "auto"
) -> list[dict[str, Any]]:
    """The preference pairs with their ``prompt`` as the policy reads it (``training.chat.pair_prompt``)."""
    return [{**p, "prompt": pair_prompt(p, tokenizer, chat_template)} for p in pairs]


def env_tasks(env: Any, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` seeded tasks of ``split`` from the env's generator."""
    return [dict(t) for t in env.sample_tasks(n, split=split, seed=seed)]


def task_drawer(env: Any, cfg: TrainConfig, split: Literal["train", "test"]) -> Callable[[int, int], list[dict]]:
    """``draw(n, seed) -> tasks`` for ``split``: from ``data.<split>_path`` JSONL if set, else the env."""
    path = cfg.data.train_path if split == "train" else cfg.data.test_path
    name = cfg.data.train_split if split == "train" else cfg.data.test_split
    if path:
        pool = read_jsonl(path)
        if not pool:
            raise ConfigError(f"{path} holds no tasks", key=f"data.{split}_path")

        def draw_pool(n: int, seed: int) -> list[dict[str, Any]]:
            rng = random.Random(seed)
            return [dict(pool[rng.randrange(len(pool))]) for _ in range(n)]

        return draw_pool
    return lambda n, seed: env_tasks(env, name, n, seed)


def eval_batches(env: Any, cfg: TrainConfig) -> Any:
    """The fixed held-out problems as validation batches ``{"index", "tasks"}``."""
    if cfg.data.test_path:
        tasks = read_jsonl(cfg.data.test_path)[: cfg.eval.num_problems]
    else:
        tasks = env_tasks(env, cfg.data.test_split, cfg.eval.num_problems, cfg.eval.seed)
    bs = cfg.eval.batch_size
    return StaticBatches([{"index": i, "tasks": tasks[s : s + bs]} for i, s in enumerate(range(0, len(tasks), bs))])
