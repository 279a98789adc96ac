"""The env contract: tasks, a verifiable reward, structured feedback, and an OpenEnv-like loop.

The contract is tabled in docs/envs.md, "The env contract". Subclasses of :class:`Env` implement
``sample_tasks`` and ``_score`` (uncached) and inherit the rest.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, NamedTuple

from composer_plugins.chat.render import content_text

__all__ = [
    "FEEDBACK_KINDS",
    "UNJUDGED_KINDS",
    "Env",
    "Feedback",
    "Observation",
    "StepResult",
    "completion_text",
    "prompt_text",
]

#: Feedback kinds the built-in envs produce (hint providers have a template for each).
FEEDBACK_KINDS: tuple[str, ...] = (
    "correct",
    "wrong_answer",
    "no_answer",
    "test_failure",
    "syntax_error",
    "runtime_error",
    "no_code",
    "timeout",
    "resource_limit",
    "regression",
    "tool_error",
    "tampered",
    "sandbox_error",
    "unscorable",
)

#: The declared :data:`FEEDBACK_KINDS` that say the verifier could not judge the attempt (the sandbox failed, the
#: answer could not be scored): no hint is given for them, since nothing in the attempt is known to be wrong.
#: Hint providers ask :attr:`Feedback.needs_hint` rather than naming kinds.
UNJUDGED_KINDS: frozenset[str] = frozenset({"sandbox_error", "unscorable"})


@dataclass
class Feedback:
    """Structured verifier feedback for one completion.

    ``kind`` is one of :data:`FEEDBACK_KINDS` (envs may add their own), ``message`` one human-readable line,
    ``details`` the machine-readable specifics (docs/envs.md, "The env contract"), ``reward`` None if unscorable.
    """

    kind: str
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None

    @property
    def ok(self) -> bool:
        """True when the completion was fully correct."""
        return self.kind == "correct"

    @property
    def judged(self) -> bool:
        """False when the verifier could not judge the attempt (a kind of :data:`UNJUDGED_KINDS`)."""
        return self.kind not in UNJUDGED_KINDS

    @property
    def needs_hint(self) -> bool:
        """A judged attempt that is not correct: what a hint provider answers."""
        return not self.ok and self.judged

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for logging / JSON)."""
        return asdict(self)


@dataclass
class Observation:
    """What an env shows the policy: the prompt text, the conversation so far, the task."""

    text: str
    messages: list[dict[str, str]] = field(default_factory=list)
    task: dict[str, Any] = field(default_factory=dict)
    feedback: Feedback | None = None
    done: bool = False
    reward: float | None = None


class StepResult(NamedTuple):
    """``(observation, reward, done, info)`` after Gym/OpenEnv; ``info["feedback"]`` is a :class:`Feedback`."""

    observation: Observation
    reward: float | None
    done: bool
    info: dict[str, Any]


def _message_text(x: Any) -> str:
    return str(x.get("content", "")) if isinstance(x, Mapping) else content_text(x)


def completion_text(completion: Any) -> str:
    """A completion as text: a string, a message dict, or a list of messages (last assistant turn)."""
    if isinstance(completion, Sequence) and not isinstance(completion, str):
        for msg in reversed(list(completion)):
            if isinstance(msg, Mapping) and msg.get("role", "assistant") == "assistant":
                return str(msg.get("content", ""))
        return "".join(completion_text(m) for m in completion)
    return _message_text(completion)


def prompt_text(prompt: Any) -> str:
    """A prompt as text: a string, or the concatenated contents of a list of messages."""
    if isinstance(prompt, Sequence) and not isinstance(prompt, str):
        return "\n".join(str(m.get("content", "")) if isinstance(m, Mapping) else str(m) for m in prompt)
    return _message_text(prompt)


#: Keyword arguments trainers pass to reward functions that are not task fields.
_TRAINER_KWARGS = frozenset({"trainer_state", "completion_ids", "log_extra", "log_metric", "prompts", "completions"})


def sample_cycling(pool: Sequence[Mapping[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` of ``pool``'s tasks, a fresh shuffle each pass (``[]`` for an empty pool), deterministic in ``seed``."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while pool and len(out) < n:
        order = list(range(len(pool)))
        rng.shuffle(order)
        out.extend(dict(pool[i]) for i in order[: n - len(out)])
    return out


def _task_key(completion: str, task: Mapping[str, Any]) -> str:
    blob = json.dumps({"c": completion, "t": task}, sort_keys=True, default=repr)
    return hashlib.sha1(blob.encode("utf-8", "replace")).hexdigest()


class Env(ABC):
    """Base class for env plugins. Subclasses implement :meth:`sample_tasks` and :meth:`_score`.

    Everything else is built on those two (docs/envs.md, "Writing an env plugin").

    ``max_turns`` (turns per :meth:`step` episode), ``num_workers`` (completions scored in parallel) and
    ``cache_size`` (scores remembered for ``feedback()`` after ``reward()``): docs/envs.md, "The env contract".
    """

    #: Registry name (set by subclasses).
    name: ClassVar[str] = "env"
    #: Fields every task row of a tasks file (``data.train_path``) needs for the reward, besides the prompt;
    #: an inner tuple means "one of these". Checked when a run starts, naming the file, line and field.
    task_fields: ClassVar[tuple[str | tuple[str, ...], ...]] = ()

    def __init__(self, *, max_turns: int = 1, num_workers: int = 1, cache_size: int = 4096) -> None:
        self.max_turns = max(1, int(max_turns))
        self.num_workers = max(1, int(num_workers))
        self._cache: OrderedDict[str, Feedback] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._episode: dict[str, Any] | None = None
        self._rng = random.Random(0)
        #: TRL logs reward functions by ``__name__``.
        self.__name__ = f"{self.name}_reward"

    # -- tasks ----------------------------------------------------------------------------
    @abstractmethod
    def sample_tasks(self, n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
        """``n`` task dicts (deterministic in ``seed``), each with a ``prompt``."""

    def dataset(self, n: int, split: str = "train", seed: int = 0) -> Any:
        """``n`` tasks as a :class:`datasets.Dataset` (columns: prompt + task fields)."""
        from datasets import Dataset

        rows = self.sample_tasks(n, split=split, seed=seed)
        return Dataset.from_list([{k: _jsonable(v) for k, v in r.items()} for r in rows])

    # -- scoring --------------------------------------------------------------------------
    @abstractmethod
    def _score(self, completion: str, task: Mapping[str, Any]) -> Feedback:
        """Score one completion against one task (no caching)."""

    def score(self, completion: Any, task: Mapping[str, Any]) -> Feedback:
        """Reward and feedback of one completion (cached)."""
        text = completion_text(completion)
        key = _task_key(text, task)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        fb = self._score(text, task)
        with self._lock:
            self._cache[key] = fb
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return fb

    def score_batch(self, prompts: Sequence[Any], completions: Sequence[Any], **task_fields: Any) -> list[Feedback]:
        """:meth:`score` for a batch in TRL's column layout (in parallel for ``num_workers > 1``)."""
        n = len(completions)
        cols = {
            k: v
            for k, v in task_fields.items()
            if k not in _TRAINER_KWARGS and isinstance(v, list | tuple) and len(v) == n
        }
        tasks = [{k: v[i] for k, v in cols.items()} for i in range(n)]
        for i, task in enumerate(tasks):
            task.setdefault("prompt", prompts[i] if i < len(prompts) else "")
        if self.num_workers > 1 and n > 1:
            with ThreadPoolExecutor(self.num_workers) as pool:
                return list(pool.map(self.score, completions, tasks))
        return [self.score(c, t) for c, t in zip(completions, tasks, strict=True)]

    def reward(self, prompts: Sequence[Any], completions: Sequence[Any], **task_fields: Any) -> list[float | None]:
        """TRL-style batch reward: one float (or None = unscorable) per completion."""
        return [fb.reward for fb in self.score_batch(prompts, completions, **task_fields)]

    __call__ = reward

    def feedback(self, prompt: Any, completion: Any, /, **task: Any) -> Feedback:
        """Structured feedback for one completion (free after :meth:`reward` on the same item)."""
        task = dict(task)
        task.setdefault("prompt", prompt)
        return self.score(completion, task)

    def reward_fn(self) -> Callable[..., list[float | None]]:
        """A plain function with a ``__name__`` (for trainers that need one)."""

        def fn(prompts: Sequence[Any], completions: Sequence[Any], **kw: Any) -> list[float | None]:
            return self.reward(prompts, completions, **kw)

        fn.__name__ = self.__name__
        return fn

    # -- OpenEnv-like episode API -------------------------------------------------------
    def reset(
        self, task: Mapping[str, Any] | None = None, seed: int | None = None, split: str = "train"
    ) -> Observation:
        """Start an episode on ``task`` (or on a task sampled with ``seed``)."""
        if task is None:
            s = seed if seed is not None else self._rng.randrange(2**31)
            task = self.sample_tasks(1, split=split, seed=s)[0]
        task = dict(task)
        prompt = prompt_text(task.get("prompt", ""))
        messages = [{"role": "user", "content": prompt}]
        self._episode = {"task": task, "turn": 0, "messages": messages}
        return Observation(text=prompt, messages=list(messages), task=task)

    def step(self, action: Any) -> StepResult:
        """Submit ``action`` (a completion) for the current episode."""
        if self._episode is None:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        ep = self._episode
        text = completion_text(action)
        ep["turn"] += 1
        ep["messages"].append({"role": "assistant", "content": text})
        fb = self.score(text, ep["task"])
        done = fb.ok or fb.reward is None or ep["turn"] >= self.max_turns
        next_text = "" if done else self.retry_prompt(fb)
        if not done:
            ep["messages"].append({"role": "user", "content": next_text})
        obs = Observation(
            text=next_text, messages=list(ep["messages"]), task=ep["task"], feedback=fb, done=done, reward=fb.reward
        )
        info = {"feedback": fb, "turn": ep["turn"], "task_id": ep["task"].get("task_id")}
        return StepResult(obs, fb.reward, done, info)

    def retry_prompt(self, feedback: Feedback) -> str:
        """The user turn after a failed attempt in a multi-turn episode."""
        return f"That is not right: {feedback.message} Please try again."

    def close(self) -> None:
        """Release resources (servers, temp dirs)."""
        self._episode = None

    def __enter__(self) -> Env:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _jsonable(v: Any) -> Any:
    if isinstance(v, str | int | float | bool) or v is None:
        return v
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, Mapping):
        return json.dumps(v, default=repr)
    return str(v)
