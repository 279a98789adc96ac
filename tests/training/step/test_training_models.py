"""Tiny model + tokenizer building/loading, grouped generation, log-prob utilities, metrics, data stream."""

from __future__ import annotations

import math

import pytest
import torch

from composer_plugins.models.generation import completion_mask_from_ids, generate_completions, tokenize_prompts
from composer_plugins.models.logprobs import completion_forward, completion_logprobs_no_grad, token_logprobs
from composer_plugins.models.tiny import TinyModelConfig, build_cached, build_tiny_model, cache_dir_for, load_policy
from composer_plugins.training.rollout.rewards import TaskStream, derive_seed
from composer_plugins.training.step.metrics import PassAtK, pass_at_k

CORPUS = [
    f"Question: Tom has {a} pens and buys {b} more.\nAnswer: {a} + {b} = {a + b}\n#### {a + b}"
    for a in range(1, 30)
    for b in range(1, 12)
]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_dir(request, tmp_path_factory):
    cfg = TinyModelConfig(
        arch=request.param,
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=128,
    )
    return build_tiny_model(cfg, CORPUS, tmp_path_factory.mktemp(request.param))


def test_tiny_model_roundtrips_through_from_pretrained(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.vocab_size == len(tok) <= 300
    assert model.config.model_type in ("qwen2", "llama")
    text = "Question: Tom has 17 pens.\nAnswer: 17 + 5 = 22\n#### 22"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: spaces and newlines survive
    digits = tok.convert_ids_to_tokens(tok("1234", add_special_tokens=False)["input_ids"])
    assert digits == ["1", "2", "3", "4"]  # one token per digit
    model2, tok2 = load_policy(tiny_dir)
    assert tok2.padding_side == "left" and tok2.pad_token_id is not None
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    )


def test_build_cached_builds_once(tmp_path):
    calls = []

    def build(d):
        calls.append(d)
        d.mkdir()
        (d / "x.txt").write_text("ok")

    key = {"a": 1}
    t1 = build_cached(cache_dir_for(tmp_path, "thing", key), build, meta=key)
    t2 = build_cached(cache_dir_for(tmp_path, "thing", key), build, meta=key)
    assert t1 == t2 and len(calls) == 1 and (t1 / "x.txt").read_text() == "ok"
    assert cache_dir_for(tmp_path, "thing", {"a": 2}) != t1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 9, 9, 9, 9]])
    assert completion_mask_from_ids(ids, 2).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_generation_is_grouped_seeded_and_logprobs_match_sampling(tiny_dir):
    model, tok = load_policy(tiny_dir)
    prompts = ["Question: Tom has 3 pens and buys 4 more.\nAnswer:", "Question: Tom has 12 pens.\nAnswer:"]
    state = torch.get_rng_state()
    ro = generate_completions(model, tok, prompts, 3, max_new_tokens=8, seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched
    again = generate_completions(model, tok, prompts, 3, max_new_tokens=8, seed=7)
    assert torch.equal(ro.completion_ids, again.completion_ids)
    assert ro.group_index.tolist() == [0, 0, 0, 1, 1, 1] and ro.prompts[:3] == [prompts[0]] * 3
    assert ro.prompt_mask[3:].sum(1).tolist() != ro.prompt_mask[:3].sum(1).tolist()  # left padding present
    # per-token log-probs from the training forward equal the sampling distribution's (greedy scores)
    ids, mask = tokenize_prompts(tok, prompts)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=8,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
            eos_token_id=None,
        )
    comp = out.sequences[:, ids.shape[1] :]
    want = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    cmask = torch.ones_like(comp)
    got = completion_forward(model, ids, mask, comp, cmask).logps
    assert torch.allclose(got, want, atol=1e-4)
    nog = completion_logprobs_no_grad(model, ids, mask, comp, cmask, chunk_size=1)
    assert torch.allclose(nog, got, atol=1e-5)
    for mode in (False, True):  # the module's train/eval mode is restored
        model.train(mode)
        completion_logprobs_no_grad(model, ids, mask, comp, cmask)
        assert model.training is mode


def test_token_logprobs_matches_log_softmax():
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    want = (logits / 0.7).log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, labels, temperature=0.7), want, atol=1e-6)


def test_pass_at_k_estimator_and_metric():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    m = PassAtK(2)
    m.update(torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool))
    assert float(m.compute()) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="at least 2 samples"):
        m.update(torch.ones(1, 1, dtype=torch.bool))


def test_task_stream_resumes_at_its_position():
    draw = lambda n, seed: [{"prompt": f"p{seed}-{i}"} for i in range(n)]  # noqa: E731
    full = list(TaskStream(draw, 2, 5, seed=3))
    s = TaskStream(draw, 2, 5, seed=3)
    it = iter(s)
    head = [next(it), next(it)]
    state = s.state_dict()
    s2 = TaskStream(draw, 2, 5, seed=3)
    s2.load_state_dict(state)
    assert head + list(s2) == full
    assert [b["index"] for b in full] == [0, 1, 2, 3, 4]
    assert full[0]["tasks"] == draw(2, derive_seed(3, 0, 0))
    assert next(iter(s2))["index"] == 5  # a second epoch continues the index (fresh tasks)


def test_reward_stats_leave_unscorable_rows_out():
    """A step's reward statistics are over the scorable rows (NaN = unscorable, as in the group advantages)."""
    from composer_plugins.training.step.metrics import reward_stats

    got = reward_stats(torch.tensor([1.0, float("nan"), 0.0, 0.5]), 2, 1.0)
    assert got["reward"] == pytest.approx(0.5) and got["accuracy"] == pytest.approx(1 / 3)
    assert got["unscorable"] == 0.25
    assert got["groups_with_signal"] == 0.5  # group 0 has one scorable row: no signal; group 1 differs
    none = reward_stats(torch.full((4,), float("nan")), 2, 1.0)
    assert math.isnan(none["reward"]) and none["unscorable"] == 1.0 and none["groups_with_signal"] == 0.0
