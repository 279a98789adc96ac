"""A toy addition env and hint provider for the backend tests (importable by class_path, also in actor processes)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from composer_plugins.envs.base import Env, Feedback


class ToyAddEnv(Env):
    """``Q: a+b=? A:`` prompts; reward 1 for the right answer, else a length-shaped partial reward (< 1).

    The shaping gives every group reward variance, so policy-gradient channels get non-zero advantages
    even from an untrained tiny model.
    """

    name = "toy_add"

    def sample_tasks(self, n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
        rng = random.Random(f"{split}-{seed}")
        out = []
        for _ in range(n):
            a, b = rng.randrange(10), rng.randrange(10)
            out.append({"prompt": f"Q: {a}+{b}=? A:", "answer": str(a + b)})
        return out

    def _score(self, completion: str, task: Mapping[str, Any]) -> Feedback:
        if completion.strip().startswith(str(task["answer"])):
            return Feedback("correct", reward=1.0)
        return Feedback("wrong_answer", f"expected {task['answer']}", reward=(len(completion) % 4) / 4)


class AnswerHints:
    """Hint provider (``hint(feedback, prompt=, completion=, task=)``): the expected answer."""

    def hint(self, feedback: Any, *, prompt: str = "", completion: str = "", task: Mapping[str, Any]) -> str:
        return f"The answer is {task['answer']}."
