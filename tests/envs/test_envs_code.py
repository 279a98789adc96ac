"""The ``code`` env: HumanEval-format tasks scored in the sandbox, partial credit, and reward hacks that fail."""

from __future__ import annotations

import json

import pytest

from composer_plugins import build
from composer_plugins.core.errors import ConfigError
from composer_plugins.envs.code_env import CodeEnv, build_program, extract_code, load_code_tasks, load_humaneval


@pytest.fixture(scope="module")
def env() -> CodeEnv:
    return CodeEnv(per_test_timeout_s=1.0, timeout_s=8.0)


@pytest.fixture(scope="module")
def asserts_env() -> CodeEnv:
    return CodeEnv(test_mode="asserts", per_test_timeout_s=1.0, timeout_s=8.0)


@pytest.fixture(scope="module")
def tasks(env):
    return {t["entry_point"]: t for t in env.tasks("train") + env.tasks("test")}


def cols(ts):
    return {k: [t.get(k) for t in ts] for k in ts[0]}


def test_embedded_tasks_and_splits(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) + len(test) == 14 and len(test) >= 3
    assert not {t["task_id"] for t in train} & {t["task_id"] for t in test}
    assert env.sample_tasks(20, seed=1) == env.sample_tasks(20, seed=1)
    assert len(env.sample_tasks(20)) == 20


@pytest.mark.slow
def test_canonical_solutions_score_one_in_both_modes(env, asserts_env):
    ts = env.tasks("train") + env.tasks("test")
    sols = [t["canonical_solution"] for t in ts]
    assert env.reward([t["prompt"] for t in ts], sols, **cols(ts)) == [1.0] * len(ts)
    few = ts[:4]
    assert asserts_env.reward([t["prompt"] for t in few], sols[:4], **cols(few)) == [1.0] * 4


def test_partial_credit_and_feedback(env, asserts_env, tasks):
    t = tasks["sum_of_squares"]
    fb = env.score("    return sum(nums)\n", t)  # right for [] and [0,...]? only [] here
    assert 0 < fb.reward < 1 and fb.kind == "test_failure"
    assert fb.details["passed"] == 1 and fb.details["total"] == 4
    assert fb.details["expected"] == "14" and fb.details["actual"] == "6"
    fa = asserts_env.score("    return sum(nums)\n", t)
    assert fa.reward == fb.reward and fa.details["test"] == "assert candidate([1, 2, 3]) == 14"
    assert fa.details["actual"] == "6"


def test_completion_styles(env, tasks):
    t = tasks["count_vowels"]
    body = '    return sum(1 for c in s.lower() if c in "aeiou")\n'
    chat = "Here you go:\n```python\ndef count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n```\nDone."
    extra = body + "\n\ndef check(x):\n    pass\n\nprint('noise')\n"  # HumanEval stop sequences cut this
    for completion in (body, chat, extra):
        assert env.score(completion, t).reward == 1.0, completion
    assert extract_code(chat, "count_vowels")[1] is True
    assert build_program("def f():\n", "    return 1\n", "f") == "def f():\n    return 1\n"


@pytest.mark.parametrize(
    "completion,kind",
    [
        ("    return sum(\n", "syntax_error"),
        ("    raise ValueError('nope')\n", "runtime_error"),
        ("    return undefined_name\n", "runtime_error"),
        ("", "no_code"),
        ("    while True:\n        pass\n", "timeout"),
    ],
)
def test_failure_kinds(env, hack_envs, tasks, completion, kind):
    e = hack_envs[0] if kind == "timeout" else env
    fb = e.score(completion, tasks["digit_sum"])
    assert fb.kind == kind, fb
    assert fb.reward == 0.0


def test_humaneval_problems_load_and_score(tmp_path):
    problems = load_humaneval()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    he = build("envs", "code", source="humaneval", per_test_timeout_s=5.0, timeout_s=30.0)
    picked = [t for t in he.tasks("test") if t["task_id"] in ("HumanEval/0", "HumanEval/32", "HumanEval/53")]
    assert len(picked) == 3
    rewards = he.reward([t["prompt"] for t in picked], [t["canonical_solution"] for t in picked], **cols(picked))
    assert rewards == [1.0, 1.0, 1.0]
    wrong = he.score("    return False\n", picked[0])
    assert 0 < wrong.reward < 1  # half of has_close_elements' asserts expect False


def test_malformed_task_files_name_file_and_line(tmp_path):
    good = {"task_id": "t/1", "prompt": "def f(x):\n", "entry_point": "f", "cases": [{"args": [1], "expected": 1}]}
    p = tmp_path / "tasks.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps({**good, "test": "def nope(c):\n    pass\n"}) + "\n")
    with pytest.raises(ConfigError) as e:
        load_code_tasks(p)
    assert f"{p}:2:" in str(e.value) and "check(candidate)" in str(e.value)
    p.write_text(json.dumps(good) + "\n\n" + "{oops\n")
    with pytest.raises(ConfigError, match=r"tasks.jsonl:3: invalid JSON"):
        load_code_tasks(p)
    p.write_text(json.dumps({**good, "cases": [{"args": 1}]}) + "\n")
    with pytest.raises(ConfigError, match=r"tasks.jsonl:1: cases\[0\]"):
        load_code_tasks(p)
    p.write_text(json.dumps({**good, "prompt": "def f(:\n"}) + "\n")  # "def f(x):\n" alone is fine
    with pytest.raises(ConfigError, match=r"tasks.jsonl:1: field 'prompt' is not valid Python"):
        load_code_tasks(p)
    # a valid custom file works end to end
    p.write_text(json.dumps(good) + "\n")
    custom = CodeEnv(str(p))
    assert custom.score("    return x\n", custom.tasks()[0]).reward == 1.0


# -- reward hacks ------------------------------------------------------------------------------

ALWAYS_EQUAL = """```python
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __bool__(self):
        return True
    def __hash__(self):
        return 0

def {name}(*args, **kwargs):
    return Anything()
```"""


@pytest.mark.parametrize("name", ["sum_of_squares", "is_palindrome", "flatten"])
def test_always_equal_object_scores_zero(env, asserts_env, tasks, name):
    assert env.score(ALWAYS_EQUAL.format(name=name), tasks[name]).reward == 0.0
    assert asserts_env.score(ALWAYS_EQUAL.format(name=name), tasks[name]).reward == 0.0


HACKS = {
    "exit_early": "    import sys\n    sys.exit(0)\n",
    "exit_at_definition": "    pass\nimport os\nos._exit(0)\n",
    "print_fake_results": "    return None\nprint('All tests passed! 4/4 PASSED')\n",
    "read_the_tests": (
        "    import json, os\n"
        "    spec = json.load(open('task.json'))\n"  # deleted before the solution runs
        "    return spec\n"
    ),
    "forge_channel": (
        "    return None\n"
        "import os, json\n"
        "for fd in sorted(int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2):\n"
        "    try:\n"
        "        for i in range(10):\n"
        "            os.write(fd, json.dumps({'kind': 'case', 'i': i, 'ok': True, 'output': 14}).encode() + b'\\n')\n"
        "    except OSError:\n"
        "        pass\n"
    ),
    "redefine_harness_helpers": ("    return None\n_cp_eq = lambda a, b: True\n_cp_true = lambda x: True\n"),
    "huge_output": "    print('x' * 10_000_000)\n    return 14\n",
    "fork_bomb": "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n"
    "            pass\n",
}


@pytest.fixture(scope="module")
def hack_envs():
    """Short wall-clock limits: several hacks only end when the sandbox kills them."""
    return [CodeEnv(test_mode=m, per_test_timeout_s=0.5, timeout_s=2.0) for m in ("cases", "asserts")]


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_reward_hacks_fail(hack_envs, tasks, hack):
    t = tasks["sum_of_squares"]
    for e in hack_envs:
        fb = e.score(HACKS[hack], t)
        if hack == "huge_output":  # returns 14 after printing; the output limit stops it first
            assert fb.kind == "resource_limit" and fb.reward <= 0.25, fb
        else:
            assert fb.reward == 0.0, (hack, e.test_mode, fb)
    assert hack_envs[0].score(HACKS["forge_channel"], t).kind == "tampered"
