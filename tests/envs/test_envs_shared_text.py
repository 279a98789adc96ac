"""Text of prompts, completions and trace blocks through the one content reader, and the hint request's
``failure`` (the check every feedback-reading provider made itself)."""

from __future__ import annotations

from composer_plugins.envs.base import Feedback, completion_text, prompt_text
from composer_plugins.envs.hints.contract import HintRequest
from composer_plugins.teachers.traces import _block_text


def test_completion_and_prompt_text():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "t"}]
    assert completion_text(msgs) == "a1" and completion_text({"content": 3}) == "3"
    assert completion_text(None) == "" and completion_text("x") == "x" and completion_text(7) == "7"
    assert completion_text([{"role": "user", "content": "u"}, "s"]) == "us"  # no assistant turn: all of it
    assert prompt_text(msgs) == "q\na1\nt" and prompt_text(["a", {"content": "b"}]) == "a\nb"
    assert prompt_text(None) == "" and prompt_text({"content": "c"}) == "c" and prompt_text(1.5) == "1.5"


def test_block_text_of_claude_code_content():
    blocks = [{"type": "text", "text": "hi"}, {"type": "image"}, "raw", {"type": "tool_use"}]
    assert _block_text(blocks) == "hi\n[image]\nraw"
    assert _block_text(None) == "" and _block_text("s") == "s" and _block_text(5) == "5"


def test_hint_request_failure_is_the_feedback_that_asks_for_a_hint():
    wrong = Feedback(kind="wrong_answer", message="no")
    assert wrong.needs_hint and HintRequest(feedback=wrong).failure is wrong
    ok = Feedback(kind="correct", message="")
    assert not ok.needs_hint and HintRequest(feedback=ok).failure is None
    assert HintRequest().failure is None
