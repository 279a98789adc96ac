"""One templated GSM8K task, and the exact text the student, the hinted teacher and an external teacher read.

Shared by the Lightning test (tests/training/rollout/test_training_chat.py) and the TRL one
(tests/backends/test_backends_trl_chat.py): both must feed the models these token ids.

* the student: a Qwen2-architecture model whose tokenizer carries a Qwen2.5-style chat template
  (:func:`composer_plugins.testing.chat_model.build_instruct_model`);
* the external teacher: another tokenizer (another vocabulary, a ``<|role|>`` template) on a tiny Llama
  (:func:`composer_plugins.testing.teacher_data.build_tiny_chat_model`), scored as a ``causal_lm`` scorer;
* the task: one GSM8K-format row read from a local file by the ``gsm8k`` env with ``chat: true``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
SYSTEM = "Put the final answer after ####."
HINT_TEMPLATES = {"wrong_answer": "The answer is {expected}.", "no_answer": "The answer is {expected}."}

#: What the student reads (the Qwen2.5-style template, the system turn given by the env).
STUDENT_TEXT = (
    "<|im_start|>system\nPut the final answer after ####.<|im_end|>\n"
    f"<|im_start|>user\nQuestion: {QUESTION}\nAnswer:<|im_end|>\n"
    "<|im_start|>assistant\n"
)
#: What the hinted teacher reads: the hint appended to the user turn (docs/envs.md), then the same template.
HINTED_TEXT = (
    "<|im_start|>system\nPut the final answer after ####.<|im_end|>\n"
    f"<|im_start|>user\nQuestion: {QUESTION}\nAnswer:\n\nHint: The answer is 7.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
#: What the external teacher reads: the same conversation in its own template.
TEACHER_TEXT = f"<|system|>\nPut the final answer after ####.\n<|user|>\nQuestion: {QUESTION}\nAnswer:\n<|assistant|>\n"


def build_case(root: Path) -> dict[str, Path]:
    """The student and teacher checkpoints and the GSM8K directory under ``root``."""
    from composer_plugins.core.io import atomic_write_jsonl
    from composer_plugins.testing.chat_model import build_instruct_model
    from composer_plugins.testing.teacher_data import build_tiny_chat_model

    data = root / "gsm8k"
    data.mkdir(parents=True, exist_ok=True)
    row = {"question": QUESTION, "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"}
    atomic_write_jsonl(data / "train.jsonl", [row], ensure_ascii=True)
    atomic_write_jsonl(data / "test.jsonl", [row], ensure_ascii=True)
    return {
        "student": build_instruct_model(root / "student"),
        "teacher": build_tiny_chat_model(root / "teacher", vocab_size=300, seed=3),
        "data": data,
    }


def env_spec(data: Path) -> dict[str, Any]:
    return {"name": "gsm8k", "source": str(data), "chat": True, "system_prompt": SYSTEM}


class Inputs:
    """Records every ``input_ids`` row (padding removed) a module's forward receives."""

    def __init__(self, module: Any) -> None:
        self.rows: list[list[int]] = []
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, mod: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        mask = kwargs.get("attention_mask")
        if mask is not None and (mask.dim() != 2 or mask.shape[-1] != ids.shape[-1]):
            return  # a cached decoding step: only the new token is fed
        for b in range(ids.shape[0]):
            row = ids[b] if mask is None else ids[b][mask[b].bool()]
            self.rows.append(row.tolist())

    def starting_with(self, prefix: list[int]) -> list[list[int]]:
        return [r for r in self.rows if r[: len(prefix)] == prefix]

    def close(self) -> None:
        self.handle.remove()
