"""Chat templates end to end in the Lightning path (``model.chat_template``; composer_plugins.training.rollout.chat).

* one templated GSM8K task: the token ids the student (rollout and evaluation), the hinted teacher and an
  external ``causal_lm`` teacher (its own tokenizer and template) are fed, token for token;
* a GSM8K answer read from a templated completion (ending in the template's ``<|im_end|>``);
* ``none`` and a template file; text prompts left exactly as they were; the SFT examples and replay
  pairs rendered as the rollouts are; ``model.chat_template`` validated at load with the file and line.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from chat_case import HINT_TEMPLATES, HINTED_TEXT, QUESTION, STUDENT_TEXT, TEACHER_TEXT, Inputs, build_case, env_spec

from composer_plugins.chat.render import render_prompt
from composer_plugins.core.errors import ConfigError
from composer_plugins.training.config.train import loads_train_config, train_config_from_dict
from composer_plugins.training.rollout.rewards import task_prompt, teacher_contexts


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    torch.set_num_threads(1)
    return build_case(tmp_path_factory.mktemp("chat"))


def chat_config(case, out, **extra):
    cfg = {
        "seed": 0,
        "output_dir": str(out),
        "cache_dir": str(out / "cache"),
        "model": {"name_or_path": str(case["student"])},
        "env": env_spec(case["data"]),
        "losses": {
            "grpo": {"weight": 1.0},
            "hint_distill": {"weight": 0.5},
            "teacher_distill": {
                "weight": 0.5,
                "teachers": [{"kind": "causal_lm", "id": "ext", "model_path": str(case["teacher"]), "topk": 4}],
            },
        },
        "hints": {"provider": {"name": "template", "reveal_answer": True, "templates": HINT_TEMPLATES}},
        "sft": {"enabled": False},
        "rollout": {
            "prompts_per_step": 1,
            "num_generations": 2,
            "max_new_tokens": 6,
            "temperature": 1.0,
            "max_prompt_length": 512,
        },
        "trainer": {"max_steps": 1, "enable_progress_bar": False, "num_threads": 1},
        "eval": {"num_problems": 1, "batch_size": 1, "k": 1, "num_samples": 1},
        **extra,
    }
    return train_config_from_dict(cfg)


def test_student_hinted_teacher_and_external_teacher_read_the_templated_task_token_for_token(case, tmp_path):
    from composer_plugins.training.lightning.module import ComposerModule

    mod = ComposerModule(chat_config(case, tmp_path))
    tok = mod.tokenizer
    student_ids = tok(STUDENT_TEXT, add_special_tokens=False)["input_ids"]
    hinted_ids = tok(HINTED_TEXT, add_special_tokens=False)["input_ids"]
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert student_ids[0] == im_start and student_ids.count(im_end) == 2  # the template's tokens, one id each
    scorer = mod.teacher_scoring.scorers[0]
    t_model, t_tok = scorer.load()
    teacher_ids = t_tok(TEACHER_TEXT, add_special_tokens=False)["input_ids"]

    tasks = mod.env.sample_tasks(1, "train", seed=0)
    student_in, teacher_in = Inputs(mod.policy.model), Inputs(t_model.get_decoder())
    try:
        rec = mod.make_rollout_batch(tasks, seed=1)
        # the student: the rollout's prompt rows and the first forward of generation
        for i in range(rec.num_rows):
            assert rec.prompt_ids[i][rec.prompt_mask[i].bool()].tolist() == student_ids
        assert student_in.rows[0] == student_ids
        # the hinted teacher: every row failed (a random model), each got the hint in its user turn
        assert list(rec.hint_contexts) == [HINTED_TEXT] * rec.num_rows
        student_in.rows.clear()
        loss, stats = mod.loss_on(rec, seed=1)
        assert torch.isfinite(loss)
        for i in range(rec.num_rows):
            n = int(rec.completion_mask[i].sum())
            completion = rec.completion_ids[i][:n].tolist()
            seen = [r[: len(hinted_ids) + n] for r in student_in.starting_with(hinted_ids)]
            assert hinted_ids + completion in seen  # the hinted context, then the student's completion
            # the external teacher: the conversation in its own template, then the student's completion re-tokenized
            text = tok.decode(completion, skip_special_tokens=True)
            want = teacher_ids + t_tok(text, add_special_tokens=False)["input_ids"]
            assert want in teacher_in.rows
        assert stats["teacher_distill/skipped"] == 0.0 and stats["teacher/ext/skipped"] == 0.0
        # evaluation reads the same prompt
        student_in.rows.clear()
        mod.validator.evaluate(mod.policy, tasks, seed=0)
        assert student_in.rows[0] == student_ids
    finally:
        student_in.close()
        teacher_in.close()
        mod.teacher_scoring.close()


def test_a_gsm8k_answer_is_read_from_a_templated_completion(case):
    from composer_plugins.envs.gsm8k import GSM8KEnv
    from composer_plugins.models.generation import completion_mask_from_ids
    from composer_plugins.models.tiny import load_policy

    _, tok = load_policy(case["student"])
    env = GSM8KEnv(**{k: v for k, v in env_spec(case["data"]).items() if k != "name"})
    task = env.sample_tasks(1, "train", seed=0)[0]
    # what a chat model writes after the generation prompt: its turn, closed by <|im_end|>, then anything
    ids = tok("He has 3 + 4 = 7 apples.\n#### 7<|im_end|>\n<|im_start|>user\n#### 9", add_special_tokens=False)
    c = torch.tensor([ids["input_ids"]])
    mask = completion_mask_from_ids(c, tok.eos_token_id)  # stops at the template's end of turn
    text = tok.batch_decode(torch.where(mask.bool(), c, tok.pad_token_id), skip_special_tokens=True)[0]
    assert text == "He has 3 + 4 = 7 apples.\n#### 7"
    assert env.reward([task["prompt"]], [text], answer=[task["answer"]]) == [1.0]


def test_none_a_template_file_and_text_prompts(case, tmp_path):
    from composer_plugins.models.tiny import load_policy
    from composer_plugins.training.rollout.chat import install_chat_template, pair_prompt

    _, tok = load_policy(case["student"])
    msgs = [{"role": "system", "content": "S."}, {"role": "user", "content": "Q?"}]
    task = {"prompt": msgs, "answer": "7"}
    # never the Python repr of a list, with or without a tokenizer
    assert task_prompt(task) == "<|system|>\nS.\n<|user|>\nQ?\n<|assistant|>\n"
    assert task_prompt(task, tok, "none") == task_prompt(task)
    assert task_prompt({"prompt": [{"role": "user", "content": "Q?"}]}, tok, "none") == "Q?"
    assert (
        task_prompt(task, tok)
        == "<|im_start|>system\nS.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    )
    # a template file: applied, and installed on the tokenizer (TRL, vLLM and the exported model read it)
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    assert task_prompt(task, tok, str(f)) == "[system] S.\n[user] Q?\n[assistant] "
    install_chat_template(tok, str(f))
    assert task_prompt(task, tok) == "[system] S.\n[user] Q?\n[assistant] "
    # text prompts are left exactly as they are, whatever the mode
    for mode in ("auto", "none", str(f)):
        assert task_prompt({"prompt": "Question: 1+1?\nAnswer:"}, tok, mode) == "Question: 1+1?\nAnswer:"
        assert render_prompt("x", tok, mode) == "x"
    # replay pairs: their conversation when a template applies, else their flat prompt
    pair = {"prompt": "Q?", "messages": [{"role": "user", "content": "Q?"}], "chosen": "a", "rejected": "b"}
    assert pair_prompt(pair, tok) == "[user] Q?\n[assistant] "
    assert pair_prompt(pair, tok, "none") == "Q?" and pair_prompt(pair) == "Q?"


def test_text_prompt_hint_contexts_are_unchanged_and_chat_ones_go_in_the_conversation(case):
    from composer_plugins.envs.gsm8k import GSM8KEnv
    from composer_plugins.envs.hints import build_hint_provider
    from composer_plugins.models.tiny import load_policy

    _, tok = load_policy(case["student"])
    provider = build_hint_provider({"name": "template", "reveal_answer": True, "templates": HINT_TEMPLATES})
    text_env = GSM8KEnv(source=str(case["data"]))
    t = text_env.sample_tasks(1, "train", seed=0)[0]
    want = f"Question: {QUESTION}\nHint: The answer is 7.\nAnswer:"  # before the answer cue, as before
    assert teacher_contexts(text_env, provider, [t], ["#### 5"]) == [want]
    assert teacher_contexts(text_env, provider, [t], ["#### 5"], tokenizer=tok) == [want]
    chat_env = GSM8KEnv(**{k: v for k, v in env_spec(case["data"]).items() if k != "name"})
    c = chat_env.sample_tasks(1, "train", seed=0)[0]
    assert teacher_contexts(chat_env, provider, [c], ["#### 5"], tokenizer=tok) == [HINTED_TEXT]


def test_sft_examples_and_pairs_read_as_the_rollouts(case, tmp_path):
    from composer_plugins.models.tiny import load_policy
    from composer_plugins.training.runs.sft import sft_pairs
    from composer_plugins.training.step.components import build_env

    cfg = chat_config(case, tmp_path, sft={"enabled": True, "num_examples": 1, "hint_fraction": 0.0})
    _, tok = load_policy(case["student"])
    pairs = sft_pairs(build_env(cfg), cfg, tok)
    assert pairs[0][0] == STUDENT_TEXT and pairs[0][1].startswith(" He has 3 + 4")


def test_chat_template_is_validated_where_it_is_written(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }")
    text = textwrap.dedent(f"""\
        seed: 0
        model:
          chat_template: {tmp_path / "missing.jinja"}
    """)
    with pytest.raises(ConfigError) as e:
        loads_train_config(text)
    msg = str(e.value)
    assert "model.chat_template" in msg and "missing.jinja" in msg and ":3" in msg and "auto" in msg
    with pytest.raises(ConfigError, match="not valid Jinja"):
        loads_train_config(text.replace(str(tmp_path / "missing.jinja"), str(bad)))
    for ok in ("auto", "none"):
        assert loads_train_config(text.replace(str(tmp_path / "missing.jinja"), ok))[0].model.chat_template == ok


def test_the_sft_warm_start_cache_knows_the_chat_template(case, tmp_path):
    from composer_plugins.training.step.policy import sft_cache_key

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    keys = [
        sft_cache_key(chat_config(case, tmp_path, model={"name_or_path": "x", "chat_template": m}), "x")
        for m in ("auto", "none", str(f))
    ]
    assert "chat_template" not in keys[0]  # auto: the keys of earlier configs (and their cached warm starts) hold
    assert keys[1]["chat_template"] == "none" and keys[2]["chat_template"].startswith(str(f) + "@")
    assert len({repr(k) for k in keys}) == 3


def test_one_prompt_renderer_for_policies_teachers_and_pairs():
    """A conversation with a tool call renders the same for a policy without a template and for a replay pair."""
    from composer_plugins.chat.render import plain_prompt
    from composer_plugins.teachers import pairs

    msgs = [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "ls", "arguments": {"d": "."}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    ]
    text = plain_prompt(msgs)
    assert text == (
        '<|user|>\nlist files\n<|assistant|>\n{"tool": "ls", "arguments": "{\\"d\\": \\".\\"}"}\n'
        "<|tool:c1|>\na.py\n<|assistant|>\n"
    )
    import composer_plugins.teachers.base as teacher_base

    assert pairs.plain_prompt is plain_prompt and not hasattr(teacher_base, "prompt_text")
