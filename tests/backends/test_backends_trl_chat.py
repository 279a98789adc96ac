"""Chat templates in the TRL backend: the templated GSM8K task fed token for token as in the Lightning path.

``ComposerGRPOTrainer`` on the Qwen2-architecture stand-in (Qwen2.5-style template): TRL templates the
conversational prompt itself; the hinted teacher's context and the external teacher's conversation come
from :mod:`composer_plugins.training.rollout.chat`. The ids each model is fed are those of
tests/training/rollout/test_training_chat.py (tests/chat_case.py), and ``model.chat_template: none`` gives TRL
the plain text the native path reads.
"""

from __future__ import annotations

import pytest
import torch
from chat_case import HINT_TEMPLATES, HINTED_TEXT, STUDENT_TEXT, TEACHER_TEXT, Inputs, build_case, env_spec

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    torch.set_num_threads(1)
    return build_case(tmp_path_factory.mktemp("trl_chat"))


def test_trl_feeds_the_student_hinted_teacher_and_external_teacher_the_same_ids(case, tmp_path):
    from composer_plugins_trl.backend import ComposerGRPOTrainer, env_reward_func, trl_prompts
    from datasets import Dataset
    from trl import GRPOConfig

    from composer_plugins.envs.gsm8k import GSM8KEnv
    from composer_plugins.models.tiny import load_policy
    from composer_plugins.training.config.train import train_config_from_dict

    model, tok = load_policy(case["student"])
    env = GSM8KEnv(**{k: v for k, v in env_spec(case["data"]).items() if k != "name"})
    tasks = env.sample_tasks(2, "train", seed=0)
    cfg = train_config_from_dict({"model": {"name_or_path": str(case["student"])}})
    rows = trl_prompts(tasks, tok, cfg)
    assert rows[0]["prompt"] == tasks[0]["prompt"]  # a conversation: TRL applies the tokenizer's template
    keys = [k for k in rows[0] if k != "prompt"]
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=6,
        max_steps=1,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        learning_rate=1e-3,
        loss_type="dapo",
    )
    ext = {"kind": "causal_lm", "id": "ext", "model_path": str(case["teacher"]), "topk": 4}
    channels = [
        "policy",
        {"name": "hint_distill", "weight": 0.5},
        {"name": "teacher_distill", "weight": 0.5, "teachers": [ext]},
    ]
    tr = ComposerGRPOTrainer(
        model=model,
        reward_funcs=[env_reward_func(env, keys)],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        channels=channels,
        hint_env=env,
        hint_threshold=1.0,
        hint_provider={"name": "template", "reveal_answer": True, "templates": HINT_TEMPLATES},
    )
    t_model, t_tok = tr.teacher_scoring.scorers[0].load()
    student_ids = tok(STUDENT_TEXT, add_special_tokens=False)["input_ids"]
    hinted_ids = tok(HINTED_TEXT, add_special_tokens=False)["input_ids"]
    teacher_ids = t_tok(TEACHER_TEXT, add_special_tokens=False)["input_ids"]
    policy_in, teacher_in = Inputs(tr.model.model), Inputs(t_model.get_decoder())
    try:
        tr.train()
    finally:
        policy_in.close()
        teacher_in.close()
        tr.teacher_scoring.close()
    assert policy_in.rows[0] == student_ids  # TRL's generation starts from the templated prompt
    # TRL's log-prob forward: the templated prompt, then each sampled completion
    n = len(student_ids)
    completions = {tuple(r[n:]) for r in policy_in.starting_with(student_ids) if len(r) > n}
    assert len(completions) == 2 and all(completions)
    for c in completions:
        # the hinted teacher reads the hint in the conversation, then the same completion (as in Lightning)
        assert hinted_ids + list(c) in policy_in.rows
        # the external teacher: the conversation in its own template, then the completion re-tokenized
        text = tok.decode(list(c), skip_special_tokens=True)
        assert teacher_ids + t_tok(text, add_special_tokens=False)["input_ids"] in teacher_in.rows
    logs = [r for r in tr.state.log_history if "loss" in r]
    assert logs and logs[0]["composer/teacher/ext/skipped"] == 0.0 and logs[0]["composer/hint_distill/skipped"] == 0.0


def test_trl_gets_plain_text_under_none_and_text_prompts_as_they_are(case):
    from composer_plugins_trl.backend import trl_prompts

    from composer_plugins.models.tiny import load_policy
    from composer_plugins.training.config.train import train_config_from_dict
    from composer_plugins.training.rollout.chat import task_prompt

    _, tok = load_policy(case["student"])
    conv = {"prompt": [{"role": "user", "content": "Q?"}], "answer": "7"}
    text = {"prompt": "Question: Q?\nAnswer:", "answer": "7"}
    none = train_config_from_dict({"model": {"chat_template": "none"}})
    auto = train_config_from_dict({})
    assert trl_prompts([conv, text], tok, none) == [{"prompt": "Q?", "answer": "7"}, text]
    assert trl_prompts([conv, text], tok, auto) == [conv, text]
    assert trl_prompts([conv], tok, none)[0]["prompt"] == task_prompt(conv, tok, "none")
