"""composer-plugins-reverse: an example third-party env plugin, written from docs/envs.md alone.

Registers the env ``reverse_word``: "Reverse the letters of <word>." The reward is 1.0 for the
reversed word and 0.0 otherwise; a failed completion gets structured :class:`Feedback`
(``wrong_answer`` with expected/got, or ``no_answer``) that hint providers turn into a hint.
Install with ``pip install ./examples/composer-plugins-reverse``; then
``composer-plugins list envs reverse`` shows it and ``-S env.name=reverse_word`` trains on it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

from composer_plugins.api import Env, Feedback, hookimpl

#: Letters the words are made of (short words keep the tiny default policy's vocabulary small).
LETTERS = "abcdefghij"


def _split_of(word: str) -> str:
    """``train`` or ``test``, fixed per word, so the two splits never share a task."""
    return "test" if hashlib.sha1(word.encode()).digest()[0] % 5 == 0 else "train"


class ReverseWordEnv(Env):
    """Reverse a word: reward 1.0 for the exact reversal (first whitespace-separated token), else 0.0.

    Args:
        min_len, max_len: word lengths (letters from :data:`LETTERS`).
        max_turns: turns per episode (a wrong answer before the last turn returns the feedback).
    """

    name = "reverse_word"

    def __init__(self, min_len: int = 3, max_len: int = 5, *, max_turns: int = 1) -> None:
        super().__init__(max_turns=max_turns)
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        self.min_len, self.max_len = int(min_len), int(max_len)

    # -- the two methods every env implements --------------------------------------------
    def sample_tasks(self, n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
        """``n`` tasks of ``split`` (deterministic in ``seed``): prompt, answer, target and task_id."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rng = random.Random(f"{split}:{seed}")
        tasks: list[dict[str, Any]] = []
        while len(tasks) < n:
            word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(self.min_len, self.max_len)))
            if _split_of(word) != split:
                continue
            answer = word[::-1]
            tasks.append(
                {
                    "prompt": f"Reverse the letters of {word}. Answer:",  # what the policy sees
                    "answer": answer,  # what the reward checks (passed to reward() as a column)
                    "target": f" {answer}",  # a perfect completion: the SFT warm start trains on it
                    "task_id": f"reverse/{word}",
                }
            )
        return tasks

    def _score(self, completion: str, task: Mapping[str, Any]) -> Feedback:
        """Reward and feedback of one completion (the base class caches it and batches it)."""
        expected = str(task["answer"])
        words = completion.split()
        if not words:
            return Feedback("no_answer", "no word in the completion", {"expected": expected}, reward=0.0)
        got = words[0].strip(".,;:!?\"'")
        if got == expected:
            return Feedback("correct", "", {"expected": expected, "got": got}, reward=1.0)
        return Feedback(
            "wrong_answer", f"expected {expected}, got {got}", {"expected": expected, "got": got}, reward=0.0
        )


@hookimpl
def register_envs(register: Any) -> None:
    register("reverse_word", ReverseWordEnv)


__all__ = ["ReverseWordEnv", "register_envs"]
