"""Hint providers (template, raw error, LLM teacher, chain) and the teacher context built from a hint."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from composer_plugins import build, get_registry
from composer_plugins.envs.base import Feedback
from composer_plugins.envs.code_env import CodeEnv
from composer_plugins.envs.gsm8k import GSM8KEnv
from composer_plugins.envs.hints import (
    HintRequest,
    LLMTeacherHintProvider,
    RawErrorHintProvider,
    TemplateHintProvider,
    build_hint_provider,
    build_teacher_context,
)


@pytest.fixture(scope="module")
def code_env():
    return CodeEnv(per_test_timeout_s=1.0, timeout_s=6.0)


@pytest.fixture(scope="module")
def digit_sum(code_env):
    return next(t for t in code_env.tasks("train") if t["entry_point"] == "digit_sum")


def test_registered_providers():
    names = set(get_registry().names("hints"))
    assert {"template", "raw_error", "llm_teacher", "chain"} <= names
    assert isinstance(build("hints", "template"), TemplateHintProvider)
    assert isinstance(build_hint_provider({"name": "raw_error", "max_chars": 50}), RawErrorHintProvider)


def test_template_hints_per_feedback_kind(code_env, digit_sum):
    tpl = build("hints", "template")
    gsm = GSM8KEnv()
    task = gsm.sample_tasks(1, seed=2)[0]
    wrong = gsm.score("#### 12345", task)
    h = tpl.hint(HintRequest(feedback=wrong))
    assert "12345" in h and "not correct" in h and task["answer"] not in h
    assert task["answer"] in TemplateHintProvider(reveal_answer=True).hint(HintRequest(feedback=wrong))
    assert "####" in tpl.hint(HintRequest(feedback=gsm.score("no idea", task)))
    assert tpl.hint(HintRequest(feedback=gsm.score(task["target"], task))) is None  # correct: no hint

    failing = code_env.score("    return n\n", digit_sum)
    h = tpl.hint(HintRequest(feedback=failing))
    assert failing.kind == "test_failure"
    assert "`digit_sum(-472)` fails: expected 13, got -472" in h
    assert "syntax error on line" in tpl.hint(HintRequest(feedback=code_env.score("    return (\n", digit_sum)))
    rt = tpl.hint(HintRequest(feedback=code_env.score("    return 1 / 0\n", digit_sum)))
    assert "ZeroDivisionError" in rt and "digit_sum(-472)" in rt
    assert "takes too long" in tpl.hint(HintRequest(feedback=Feedback("timeout", "timed out", {"test": "f(1)"}, 0.0)))
    tool = tpl.hint(HintRequest(feedback=Feedback("tool_error", "bad call", {"message": "unknown tool 'serch'"}, 0.0)))
    assert "unknown tool 'serch'" in tool
    custom = TemplateHintProvider({"wrong_answer": "Nope, {got} is off."})
    assert custom.hint(HintRequest(feedback=wrong)) == "Nope, 12345 is off."


def test_raw_error_hint_keeps_the_verifiers_words(code_env, digit_sum):
    raw = build("hints", "raw_error")
    fb = code_env.score("    return int('x')\n", digit_sum)
    h = raw.hint(HintRequest(feedback=fb))
    assert "ValueError" in h and "invalid literal" in h and "digit_sum(-472)" in h
    assert raw.hint(HintRequest(feedback=Feedback("correct", "", {}, 1.0))) is None
    short = RawErrorHintProvider(max_chars=30).hint(HintRequest(feedback=fb))
    assert len(short) == 30 and short.startswith("...")


@dataclass
class _Reply:
    text: str


class TinyAsyncTeacher:
    """The teacher protocol: ``async def complete(messages) -> result with .text``."""

    def __init__(self, reply: str = "Check the sign of n before summing its digits.", delay: float = 0.0) -> None:
        self.reply = reply
        self.delay = delay
        self.calls: list[list[dict]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.closed = False

    async def complete(self, messages, **kw):
        self.calls.append(messages)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        return _Reply(self.reply)

    async def aclose(self):
        self.closed = True


class TinySyncTeacher:
    def generate(self, messages):
        return "Use abs(n)."


class BrokenTeacher:
    async def complete(self, messages):
        raise ConnectionError("teacher unreachable")


def test_llm_teacher_hint_from_feedback(code_env, digit_sum):
    teacher = TinyAsyncTeacher()
    provider = LLMTeacherHintProvider(teacher)
    fb = code_env.score("    return sum(int(c) for c in str(n))\n", digit_sum)
    hint = provider.hint(
        HintRequest(feedback=fb, prompt=digit_sum["prompt"], completion="    return sum(int(c) for c in str(n))\n")
    )
    assert hint == "Check the sign of n before summing its digits."
    msgs = teacher.calls[0]
    assert msgs[0]["role"] == "system" and "hint" in msgs[0]["content"].lower()
    assert "def digit_sum" in msgs[1]["content"] and "str(n)" in msgs[1]["content"]
    assert fb.kind in msgs[1]["content"]
    assert provider.hint(HintRequest(feedback=Feedback("correct", "", {}, 1.0))) is None
    provider.close()
    assert teacher.closed


def test_llm_teacher_does_not_leak_the_answer_unless_allowed():
    gsm = GSM8KEnv()
    task = gsm.sample_tasks(1, seed=4)[0]
    fb = gsm.score("#### 98765", task)
    t1, t2 = TinyAsyncTeacher(), TinyAsyncTeacher()
    LLMTeacherHintProvider(t1).hint(HintRequest(feedback=fb, prompt=task["prompt"], completion="#### 98765"))
    LLMTeacherHintProvider(t2, reveal_answer=True).hint(
        HintRequest(feedback=fb, prompt=task["prompt"], completion="#### 98765")
    )
    assert f'"expected": "{task["answer"]}"' not in t1.calls[0][1]["content"]
    assert f'"expected": "{task["answer"]}"' in t2.calls[0][1]["content"]


def test_llm_teacher_sync_generate_fallback_and_batch():
    fb = Feedback("wrong_answer", "The final answer 3 is wrong.", {"got": "3", "expected": "4"}, 0.0)
    assert LLMTeacherHintProvider(TinySyncTeacher()).hint(HintRequest(feedback=fb)) == "Use abs(n)."
    broken = LLMTeacherHintProvider(BrokenTeacher())
    assert "not correct" in broken.hint(HintRequest(feedback=fb))  # fell back to the template provider
    assert broken.errors and "teacher unreachable" in broken.errors[0]
    assert LLMTeacherHintProvider(BrokenTeacher(), fallback=None).hint(HintRequest(feedback=fb)) is None
    slow = TinyAsyncTeacher(delay=0.05)
    batch = LLMTeacherHintProvider(slow, max_concurrency=3).hints([HintRequest(prompt="q", feedback=fb)] * 9)
    assert batch == [slow.reply] * 9 and 1 < slow.max_in_flight <= 3
    with pytest.raises(TypeError, match="complete"):
        LLMTeacherHintProvider(object())


def test_llm_teacher_built_by_name_through_the_teachers_registry():
    reg = get_registry()
    made: list[TinyAsyncTeacher] = []

    def factory(reply: str = "default") -> TinyAsyncTeacher:
        t = TinyAsyncTeacher(reply)
        made.append(t)
        return t

    reg.register("teachers", "tiny_hint_test_teacher", factory, description="test teacher", override=True)
    try:
        provider = build("hints", "llm_teacher", teacher="tiny_hint_test_teacher", teacher_kwargs={"reply": "Hi!"})
        failing = HintRequest(feedback=Feedback("test_failure", "f(1) failed", {"test": "f(1)"}, 0.0))
        assert provider.hint(failing) == "Hi!"
        assert len(made) == 1
        # usable from inside a running event loop as well
        assert asyncio.run(provider.ahint(HintRequest(feedback=Feedback("timeout", "slow", {}, 0.0)))) == "Hi!"
    finally:
        reg.unregister("teachers", "tiny_hint_test_teacher")


def test_chain_uses_the_first_hint():
    chain = build(
        "hints", "chain", providers=[{"name": "llm_teacher", "teacher": BrokenTeacher(), "fallback": None}, "raw_error"]
    )
    fb = Feedback("runtime_error", "boom", {"error": "KeyError", "message": "'x'"}, 0.0)
    assert chain.hint(HintRequest(feedback=fb)) == "KeyError: 'x'"


def test_teacher_context_text_prompt():
    prompt = "Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:"
    ctx = build_teacher_context(prompt, "Add the two numbers.")
    assert ctx == "Question: Tom has 3 apples and buys 4 more. How many?\nHint: Add the two numbers.\nAnswer:"
    assert build_teacher_context("Write a function.", "Mind n < 0.") == "Write a function.\n\nHint: Mind n < 0."
    assert build_teacher_context(prompt, None) == prompt


def test_teacher_context_at_the_failing_turn():
    convo = [
        {"role": "system", "content": "You solve tasks."},
        {"role": "user", "content": "Compute 2+2."},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "That is not right. Try again."},
        {"role": "assistant", "content": "6"},
    ]
    ctx = build_teacher_context(convo, "Count on your fingers.")
    assert len(ctx) == 4 and ctx[-1]["content"].endswith("Hint: Count on your fingers.")
    assert convo[3]["content"] == "That is not right. Try again."  # the input is not modified
    first = build_teacher_context(convo, "2 and 2 make 4.", failing_turn=2)
    assert [m["role"] for m in first] == ["system", "user"] and first[1]["content"].endswith("Hint: 2 and 2 make 4.")
    tool = [
        {"role": "user", "content": "Search it"},
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "error: unknown tool"},
        {"role": "assistant", "content": "done"},
    ]
    ctx2 = build_teacher_context(tool, "Call `search`, not `serch`.")
    assert ctx2[-1]["role"] == "tool" and "Hint: Call `search`" in ctx2[-1]["content"]
    after_system = build_teacher_context([{"role": "system", "content": "s"}], "h")
    assert after_system[-1] == {"role": "user", "content": "Hint: h"}
    with pytest.raises(ValueError, match="not the assistant"):
        build_teacher_context(convo, "h", failing_turn=1)
    with pytest.raises(IndexError):
        build_teacher_context(convo, "h", failing_turn=9)


def test_env_feedback_to_hint_to_teacher_context_end_to_end():
    env = GSM8KEnv(difficulty=1, max_turns=2)
    obs = env.reset(seed=5)
    step = env.step("#### 1")
    fb = step.info["feedback"]
    hint = build("hints", "template").hint(HintRequest(feedback=fb, prompt=obs.text))
    single = build_teacher_context(obs.text, hint)
    assert single.endswith("\nAnswer:") and "Hint: Your final answer 1 is not correct" in single
    convo = [*step.observation.messages[:-1]]  # user prompt, failing assistant turn
    ctx = build_teacher_context(convo, hint)
    assert ctx == [{"role": "user", "content": obs.text + "\n\nHint: " + hint}]
