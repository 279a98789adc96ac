"""GSM8K: answer extraction, the offline generator, loaders (jsonl/parquet/hub layout), reward and episodes."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from composer_plugins import build
from composer_plugins.core.errors import ComposerPluginsError, ConfigError
from composer_plugins.envs.answers import answers_match, extract_answer, extract_boxed, format_number, parse_number
from composer_plugins.envs.arith import generate_problems, resolve_difficulty, split_of
from composer_plugins.envs.base import Feedback
from composer_plugins.envs.gsm8k import GSM8KEnv, load_gsm8k_file, write_gsm8k_jsonl

# Gold solutions in GSM8K's own format (calculator annotations, "#### answer").
GSM8K_GOLD = [
    (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
        "72",
    ),
    (
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
        "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
        "10",
    ),
    (
        "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her 15 * 2 = "
        "$<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 more.\n#### 5",
        "5",
    ),
    (
        "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
        "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer’s market.\n#### 18",
        "18",
    ),
    ("The store sold 1200 * 3 = <<1200*3=3600>>3600 pens.\n#### 3,600", "3600"),
    ("The temperature fell 5 - 8 = <<5-8=-3>>-3 degrees.\n#### -3", "-3"),
    ("Each share is 3 / 4 = <<3/4=0.75>>0.75 of a pie.\n#### 0.75", "0.75"),
]

MESSY = [
    ("The answer is 18.", "18"),
    ("So she makes $18.00 every day.", "18"),
    ("Therefore the answer is: **18**", "18"),
    ("$$\\boxed{18}$$", "18"),
    ("Final answer: \\boxed{\\$1{,}234.50}", "1234.5"),
    ("The total is \\boxed{\\frac{3}{4}} of the cake.", "0.75"),
    ("\\boxed{\\dfrac{1}{3}}", "1/3"),
    ("Answer: 1,000,000 grains", "1000000"),
    ("It is −5 degrees outside.", "-5"),
    ("She pays 3-4 dollars a day, the answer is 12 dollars", "12"),
    ("It takes 25% longer, so 30 minutes.", "30"),
    ("The answer is 3/4 of a cup", "0.75"),
    ("I'm not sure, but I think eighteen.", "18"),
    ("#### 72\n\nQuestion: Tom has 2 apples...\nAnswer: 2 + 3 = 5\n#### 5", "72"),  # kept generating
    ("The value is .5 liters", "0.5"),
    ("Step 1: 2 + 2 = 4. Step 2: 4 * 3 = 12.", "12"),
    ("no numbers at all", None),
    ("", None),
]


@pytest.mark.parametrize("text,answer", GSM8K_GOLD)
def test_extracts_gsm8k_gold_answers(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("text,answer", MESSY)
def test_extracts_answers_from_messy_model_outputs(text, answer):
    assert extract_answer(text) == answer


def test_number_helpers():
    assert parse_number("about $1,234.50 total") == Fraction("1234.5")
    assert parse_number("-7 degrees") == -7
    assert format_number(Fraction(1, 3)) == "1/3"
    assert format_number(Fraction(-7, 2)) == "-3.5"
    assert format_number(Fraction(1, 8)) == "0.125"
    assert extract_boxed("a \\boxed{x^{2}} b \\boxed{4}") == "4"
    assert extract_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert answers_match("the answer is 0.50", "1/2")
    assert answers_match("#### 3,600", 3600)
    assert not answers_match("#### 3601", "#### 3600")
    assert not answers_match(None, "5")


@pytest.mark.parametrize("difficulty", range(6))
def test_generator_solutions_match_answers_and_are_deterministic(difficulty):
    probs = generate_problems(50, difficulty, seed=7)
    assert probs == generate_problems(50, difficulty, seed=7)
    assert probs != generate_problems(50, difficulty, seed=8)
    for p in probs:
        assert p.solution.rstrip().endswith(f"#### {p.answer}")
        assert extract_answer(p.solution) == str(p.answer)
        assert p.answer >= 0 and p.difficulty == difficulty
        assert ("<<" in p.solution) == (difficulty >= 2)
        assert split_of(p.question) == "train"


def test_easiest_levels_are_single_additions_with_small_numbers():
    for p in generate_problems(200, "trivial", seed=0):
        a, b = (int(x) for x in p.solution.split(" = ")[0].split()[-3::2])
        assert 1 <= a <= 9 and 1 <= b <= 9 and p.answer == a + b
    for p in generate_problems(200, "easy", seed=0):
        a, b = (int(x) for x in p.solution.split(" = ")[0].split()[-3::2])
        assert 1 <= a <= 99 and 1 <= b <= 99 and p.answer == a + b
        assert p.solution.count("\n") == 1  # one line of work, then "#### n"


def test_train_and_test_questions_never_overlap():
    train = {p.question for p in generate_problems(1500, 0, seed=0)}
    test = {p.question for p in generate_problems(200, 0, seed=0, split="test")}
    assert train and test and not train & test


def test_difficulty_names_and_errors():
    assert resolve_difficulty("two-step") == 3
    assert resolve_difficulty("4") == 4
    with pytest.raises(ValueError, match="unknown difficulty"):
        resolve_difficulty("impossible")
    with pytest.raises(ValueError):
        resolve_difficulty(9)


def test_env_reward_trl_shape_and_feedback():
    env = build("envs", "gsm8k", difficulty=1)
    tasks = env.sample_tasks(4, seed=3)
    assert tasks == env.sample_tasks(4, seed=3)
    assert all(t["prompt"].startswith("Question: ") and t["prompt"].endswith("Answer:") for t in tasks)
    prompts = [t["prompt"] for t in tasks]
    completions = [tasks[0]["target"], f"The answer is {tasks[1]['answer']}.", "#### 100000", "I don't know"]
    cols = {k: [t[k] for t in tasks] for k in ("answer", "question", "task_id")}
    rewards = env.reward(prompts, completions, trainer_state=None, completion_ids=[[1]] * 4, **cols)
    assert rewards == [1.0, 1.0, 0.0, 0.0]
    # conversational completions work too
    chat = [[{"role": "assistant", "content": tasks[0]["target"]}]]
    assert env.reward(prompts[:1], chat, answer=cols["answer"][:1]) == [1.0]
    fb = env.feedback(prompts[2], completions[2], **tasks[2])
    assert isinstance(fb, Feedback) and fb.kind == "wrong_answer" and fb.details["got"] == "100000"
    assert fb.details["expected"] == tasks[2]["answer"]
    assert env.feedback(prompts[3], completions[3], **tasks[3]).kind == "no_answer"
    assert env.feedback(prompts[0], "x", question="no gold").kind == "unscorable"
    assert env.reward(["p"], ["#### 1"], other=["x"]) == [None]
    fn = env.reward_fn()
    assert fn.__name__ == "gsm8k_reward" and fn(prompts[:1], completions[:1], answer=cols["answer"][:1]) == [1.0]


def test_strict_format_requires_hashes():
    env = GSM8KEnv(strict_format=True)
    t = env.sample_tasks(1)[0]
    assert env.score(f"the answer is {t['answer']}", t).reward == 0.0
    assert env.score(f"...\n#### {t['answer']}", t).reward == 1.0


def test_reset_step_multi_turn_episode():
    env = GSM8KEnv(difficulty=0, max_turns=2)
    obs = env.reset(seed=11)
    assert obs.text == obs.task["prompt"] and not obs.done
    r = env.step("#### 999")
    observation, reward, done, info = r
    assert reward == 0.0 and not done and info["feedback"].kind == "wrong_answer"
    assert "try again" in observation.text and observation.messages[-1]["role"] == "user"
    r2 = env.step(f"#### {obs.task['answer']}")
    assert r2.reward == 1.0 and r2.done and r2.info["turn"] == 2
    env.close()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("x")


def test_dataset_export():
    ds = GSM8KEnv(difficulty=2).dataset(5, seed=1)
    assert ds.num_rows == 5 and {"prompt", "answer", "solution"} <= set(ds.column_names)


def test_loads_local_jsonl_and_parquet_and_hub_layout(tmp_path):
    rows = [{"question": q, "answer": a} for q, a in (("Q1: 2+2?", GSM8K_GOLD[0][0]), ("Q2?", GSM8K_GOLD[4][0]))]
    jl = tmp_path / "train.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    tasks = load_gsm8k_file(jl)
    assert [t["answer"] for t in tasks] == ["72", "3600"]
    assert tasks[0]["solution"] == GSM8K_GOLD[0][0]
    # the hub repository's layout: main/{train,test}-00000-of-00001.parquet
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "hub" / "main").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "hub" / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "hub" / "main" / "test-00000-of-00001.parquet")
    env = GSM8KEnv(str(tmp_path / "hub"))
    assert len(env.tasks("train")) == 2 and len(env.tasks("test")) == 1
    sampled = env.sample_tasks(5, seed=0)
    assert len(sampled) == 5 and {t["answer"] for t in sampled} == {"72", "3600"}
    assert env.score(GSM8K_GOLD[0][0], env.tasks("test")[0]).reward == 1.0
    # a {"train": ..., "test": ...} mapping and write_gsm8k_jsonl round trip
    out = write_gsm8k_jsonl(tmp_path / "gen.jsonl", GSM8KEnv().sample_tasks(3))
    env2 = GSM8KEnv({"train": str(out), "test": str(jl)})
    assert len(env2.tasks("train")) == 3 and len(env2.tasks("test")) == 2


def test_malformed_files_name_file_and_line(tmp_path):
    good = json.dumps({"question": "q", "answer": "x\n#### 1"})
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(f"{good}\n{good}\n{{not json\n")
    with pytest.raises(ConfigError) as e:
        load_gsm8k_file(bad_json)
    assert f"{bad_json}:3:" in str(e.value) and "invalid JSON" in str(e.value)
    no_hash = tmp_path / "nohash.jsonl"
    no_hash.write_text(f"{good}\n" + json.dumps({"question": "q", "answer": "the answer is 4"}) + "\n")
    with pytest.raises(ConfigError) as e:
        load_gsm8k_file(no_hash)
    assert f"{no_hash}:2:" in str(e.value) and "####" in str(e.value)
    not_num = tmp_path / "notnum.jsonl"
    not_num.write_text(json.dumps({"question": "q", "answer": "#### many"}) + "\n")
    with pytest.raises(ConfigError, match=r"notnum.jsonl:1: .*not a number"):
        load_gsm8k_file(not_num)
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"answer": "#### 1"}) + "\n")
    with pytest.raises(ConfigError, match=r"missing.jsonl:1: .*'question'"):
        load_gsm8k_file(missing)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "q", "solution": "#### 1"}]), tmp_path / "cols.parquet")
    with pytest.raises(ConfigError, match=r"cols.parquet: .*lacks column"):
        load_gsm8k_file(tmp_path / "cols.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "none"}]),
        tmp_path / "rows.parquet",
    )
    with pytest.raises(ConfigError, match=r"rows.parquet: row 2: .*####"):
        load_gsm8k_file(tmp_path / "rows.parquet")
    with pytest.raises(ConfigError, match="does not exist"):
        GSM8KEnv(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="no test split"):
        (tmp_path / "empty").mkdir()
        GSM8KEnv(str(tmp_path / "empty")).tasks("test")


def test_hub_source_fails_clearly_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    env = GSM8KEnv("hf", dataset_id="openai/gsm8k-not-cached-here")
    with pytest.raises(ComposerPluginsError, match="source='generator'"):
        env.sample_tasks(1)
