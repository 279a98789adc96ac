"""The ``hf`` teacher on a tiny locally trained model, and ``replay record`` from a registered env."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from composer_plugins.teachers.base import TeacherError
from composer_plugins.testing.teacher_data import build_tiny_chat_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A two-layer Llama + a BPE tokenizer trained here with `tokenizers`, written with save_pretrained."""
    import torch

    torch.set_num_threads(1)
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


class ArithEnv:
    """A single-turn GSM8K-format env: reset() gives a question, step(answer) scores it."""

    def __init__(self, max_operand: int = 20) -> None:
        self.max_operand = max_operand
        self.answer = 0

    def reset(self, seed: int | None = None) -> dict:
        import random

        rng = random.Random(seed)
        a, b = rng.randint(1, self.max_operand), rng.randint(1, self.max_operand)
        self.answer = a + b
        return {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}

    def step(self, action: str):
        reward = 1.0 if action.strip().endswith(f"#### {self.answer}") else 0.0
        return None, reward, True, {}


def test_a_teachers_response_is_priced_and_stamped_by_the_teacher():
    """``Teacher.response``: the one place a teacher's answer gets its cost, its id and its model."""
    from composer_plugins.teachers.openai_compat import OpenAITeacher
    from composer_plugins.teachers.oracle import OracleTeacher

    t = OpenAITeacher("m", api_key_env=None, id="a", prompt_usd_per_token=1e-6, completion_usd_per_token=4e-6)
    r = t.response("hi", 10, 2, latency_s=0.5, finish_reason="stop")
    assert (r.text, r.message, r.cost_usd) == ("hi", {"role": "assistant", "content": "hi"}, pytest.approx(18e-6))
    assert (r.teacher, r.model, r.latency_s, r.finish_reason, r.cached) == ("a", "m", 0.5, "stop", False)
    served = t.response("", 3, message={"role": "assistant", "content": None}, model="m-0613")
    assert served.message["content"] is None and served.model == "m-0613" and served.cost_usd == pytest.approx(3e-6)
    oracle = OracleTeacher().act([{"role": "user", "content": "What is 6 * 7?"}])
    assert (oracle.text, oracle.model, oracle.teacher, oracle.cost_usd) == ("#### 42", "oracle", "oracle", 0.0)


def test_both_sampling_teachers_check_temperature_top_p_and_seed_by_one_rule(tiny_model):
    """``check_sampling``: ``temperature >= 0``, ``top_p`` in (0, 1], a whole ``seed``, for ``openai`` (None: the
    endpoint's default) and ``hf`` (required) alike; ``hf``'s cache key keeps its numbers as floats."""
    from composer_plugins.teachers.base import check_sampling
    from composer_plugins.teachers.hf import HFTeacher
    from composer_plugins.teachers.openai_compat import OpenAITeacher

    assert check_sampling("t", None, None, None) == (None, None, None)
    with pytest.raises(TeacherError, match="t: temperature must be a number"):
        check_sampling("t", None, 1.0, 0, required=True)
    cases = [
        ({"temperature": -0.5}, "temperature", "must be >= 0"),
        ({"top_p": 0}, "top_p", "must be > 0"),
        ({"top_p": 1.5}, "top_p", "must be <= 1"),
        ({"seed": 1.5}, "seed", "must be a whole number"),
    ]
    for kw, field, why in cases:
        for make in (
            lambda kw: OpenAITeacher("m", api_key_env=None, id="o", **kw),
            lambda kw: HFTeacher(str(tiny_model), id="h", **kw),
        ):
            with pytest.raises(TeacherError, match=f"teacher '[oh]': {field} {why}") as e:
                make(kw)
            assert e.value.field == field
    o = OpenAITeacher("m", api_key_env=None, temperature=None, top_p=0.9, seed=7)
    assert (o.temperature, o.top_p, o.seed) == (None, 0.9, 7) and "temperature" not in o.cache_params()
    h = HFTeacher(str(tiny_model), temperature=1, top_p=1, seed=3).cache_params()
    assert (h["temperature"], h["top_p"], h["seed"]) == (1.0, 1.0, 3) and isinstance(h["temperature"], float)


def test_hf_teacher_from_registry(tiny_model):
    import composer_plugins

    t = composer_plugins.build("teachers", "hf", model_path=str(tiny_model), max_new_tokens=6, id="tiny")
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    r1 = t.act(msgs)
    r2 = t.act(msgs)
    assert r1.text == r2.text  # greedy: deterministic
    assert r1.prompt_tokens > 0 and 0 < r1.completion_tokens <= 6
    assert r1.cost_usd == 0.0 and r1.teacher == "tiny" and r1.latency_s > 0
    assert t.prompt_text(msgs) == "<|user|>\nWhat is 2 + 3?\n<|assistant|>\n"  # the saved chat template
    sampled = composer_plugins.build(
        "teachers", "hf", model_path=str(tiny_model), max_new_tokens=6, temperature=1.0, seed=3
    )
    assert sampled.act(msgs).text == sampled.act(msgs).text  # seeded sampling is reproducible
    with pytest.raises(TeacherError, match="cannot load a model"):
        composer_plugins.build("teachers", "hf", model_path=str(tiny_model.parent / "missing")).act(msgs)


def test_record_then_replay_with_oracle(tiny_model, tmp_path, isolated_plugins):
    from composer_plugins.core.cli import load_commands
    from composer_plugins.teachers.engine import ReplayEngine
    from composer_plugins.teachers.oracle import OracleTeacher
    from composer_plugins.teachers.pairs import extract_pairs
    from composer_plugins.teachers.traces import load_traces

    isolated_plugins.get_registry().register("envs", "arith-test", ArithEnv, "test env", max_operand=9)
    out = tmp_path / "traces.jsonl"
    args = [
        "replay",
        "record",
        "--policy",
        str(tiny_model),
        "--env",
        "arith-test",
        "--episodes",
        "3",
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
        "--no-progress",
        "--env-arg",
        "max_operand=5",
    ]
    res = CliRunner().invoke(load_commands(), args)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["episodes"] == 3 and summary["student_steps"] == 3
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["messages"][0]["role"] == "user" and rows[0]["messages"][1]["role"] == "assistant"
    assert rows[0]["metadata"]["env"] == "arith-test" and "answer" in rows[0]["metadata"]
    assert all(int(r["metadata"]["answer"]) <= 10 for r in rows)  # env_arg reached the factory
    # the recorded traces feed a replay: the oracle answers from the recorded ground truth
    states = load_traces(out)
    assert len(states) == 3
    result = ReplayEngine([OracleTeacher()], progress=False).run(states)
    pairs, stats = extract_pairs(states, result.responses, k=1)
    assert stats.pairs + stats.student_agrees == 3
    for p in pairs:
        assert p["chosen"] == f"#### {p['metadata']['answer']}"
    # a built-in env from the registry (gsm8k, offline generator), multi-turn: the retry prompt is recorded
    out2 = tmp_path / "gsm8k.jsonl"
    args = [
        "replay",
        "record",
        "--policy",
        str(tiny_model),
        "--env",
        "gsm8k",
        "--episodes",
        "2",
        "--max-turns",
        "2",
        "--env-arg",
        "max_turns=2",
        "--max-new-tokens",
        "4",
        "--out",
        str(out2),
        "--no-progress",
    ]
    res = CliRunner().invoke(load_commands(), args)
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out2.read_text().splitlines()]
    roles = [m["role"] for m in rows[0]["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]  # the tiny policy is wrong: it gets a second turn
    assert rows[0]["metadata"]["answer"] and rows[0]["metadata"]["task_id"]
    states = load_traces(out2)
    assert len(states) == 4
    result = ReplayEngine([OracleTeacher()], progress=False).run(states)
    assert all(result.responses[s.state_id]["oracle"].text == f"#### {s.metadata['answer']}" for s in states)
    # unknown env: the registry error names the alternatives
    res = CliRunner().invoke(
        load_commands(),
        ["replay", "record", "--policy", str(tiny_model), "--env", "arith-tst", "--out", str(tmp_path / "x.jsonl")],
    )
    assert res.exit_code != 0 and "arith-test" in (res.output + str(res.exception))
