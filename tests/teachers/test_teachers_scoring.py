"""Scoring teachers for ``teacher_distill``: local causal LM, vLLM/SGLang-shaped servers, alignment, async.

* the loopback server (a real tiny model's top-k in vLLM's ``prompt_logprobs`` shape) scored through
  the replay engine equals the local causal LM scorer of the same model;
* kill the server mid-run, restart it: nothing answered before is scored again (cache), and the
  ledger never passes ``max_usd``;
* across tokenizers: the alignment rule against a hand-computed case, and two tiny models whose
  tokenizers differ, against the teacher's own log-probs;
* asynchronous scoring: a teacher past the deadline is skipped for the batch, without stalling.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from composer_plugins.teachers.align import align_scores
from composer_plugins.teachers.scoring import (
    LocalScorer,
    ScoreRequest,
    ScoringPool,
    ServerScorer,
    TeacherScorer,
    TeacherScores,
    parse_sglang_input_logprobs,
)

PROMPTS = ["What is 2 + 3?", "Add 4 and 5.", "What is 7 - 2?", "Sum 1 and 1.", "What is 3 * 3?", "What is 8 - 6?"]
ANSWERS = [
    "2 + 3 = 5\n#### 5",
    "4 + 5 = 9\n#### 9",
    "7 - 2 = 5\n#### 5",
    "1 + 1 = 2\n#### 2",
    "3 * 3 = 9\n#### 9",
    "8 - 6 = 2\n#### 2",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two tiny models whose tokenizers differ (vocabularies of 320 and 260, other seeds)."""
    from composer_plugins.testing.teacher_data import build_tiny_chat_model

    root = tmp_path_factory.mktemp("scorers")
    a = build_tiny_chat_model(root / "a", vocab_size=320, seed=0)
    b = build_tiny_chat_model(root / "b", vocab_size=260, seed=1)
    return a, b


@pytest.fixture(scope="module")
def server(tiny):
    """The loopback server serving model a (vLLM and SGLang scoring routes)."""
    from composer_plugins.testing.loopback_server import RolloutServerProcess

    with RolloutServerProcess(model=str(tiny[0])) as srv:
        yield srv


def _requests(tok, n=len(PROMPTS)):
    out = []
    for p, c in zip(PROMPTS[:n], ANSWERS[:n], strict=True):
        ids = tok(c, add_special_tokens=False)["input_ids"]
        pids = tok(p, add_special_tokens=False)["input_ids"]
        out.append(ScoreRequest(p, c, tuple(ids), tuple(pids)))
    return out


def _direct(model_dir, prompt_ids, completion_ids):
    """The teacher's own log-softmax at each completion position (the plain forward)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        x = torch.tensor([list(prompt_ids) + list(completion_ids)])
        lp = m(input_ids=x).logits[0].log_softmax(-1)
    return lp[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(completion_ids)]


def test_local_scorer_is_the_models_top_k(tiny):
    from transformers import AutoTokenizer

    a, _ = tiny
    tok = AutoTokenizer.from_pretrained(a)
    sc = LocalScorer(a, topk=5, batch_size=4, chunk_size=3)
    sc.bind(tok)
    reqs = _requests(tok)
    out = sc.score(reqs)
    for r, s in zip(reqs, out, strict=True):
        want = _direct(a, r.prompt_ids, r.completion_ids).topk(5, -1)
        assert s.mask.all() and s.token_ids.shape == (len(r.completion_ids), 5)
        torch.testing.assert_close(s.token_ids, want.indices)
        torch.testing.assert_close(s.logprobs, want.values, rtol=1e-5, atol=1e-5)
        own = _direct(a, r.prompt_ids, r.completion_ids).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(s.sampled, own, rtol=1e-5, atol=1e-5)  # the student's own token


def test_local_scorer_rows_in_one_head_pass_match_each_row_alone(tiny):
    """The head, log-softmax and top-k run once over every row's tokens; each row equals its own plain forward,
    a row without a prompt (its first token unscored) and an empty completion included."""
    from transformers import AutoTokenizer

    a, _ = tiny
    tok = AutoTokenizer.from_pretrained(a)
    enc = [tok(x, add_special_tokens=False)["input_ids"] for x in (*PROMPTS[:2], *ANSWERS[:3])]
    rows = [(enc[0], enc[2]), ([], enc[3]), (enc[1], []), (enc[1], enc[4])]
    sc = LocalScorer(a, topk=4, chunk_size=5)
    for (p, c), (actual, ids, lps) in zip(rows, sc._forward_topk(rows), strict=True):
        if not c:
            assert actual == [] and ids.shape[0] == 0
            continue
        lp = _direct(a, p or c[:1], c if p else c[1:])
        want = lp.topk(4, -1)
        got_ids, got_v = (ids, lps) if p else (ids[1:], lps[1:])
        torch.testing.assert_close(got_ids, want.indices)
        torch.testing.assert_close(got_v, want.values, rtol=1e-5, atol=1e-5)
        own = lp.gather(-1, torch.tensor(c if p else c[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(actual if p else actual[1:]), own, rtol=1e-5, atol=1e-5)
        if not p:
            assert math.isnan(actual[0]) and (ids[0] == -1).all()


@pytest.mark.slow
def test_server_scorer_vllm_and_sglang_shapes_match_the_local_model(tiny, server, tmp_path):
    from transformers import AutoTokenizer

    a, _ = tiny
    tok = AutoTokenizer.from_pretrained(a)
    local = LocalScorer(a, topk=4)
    local.bind(tok)
    reqs = _requests(tok, 3)
    want = local.score(reqs)
    srv = server
    for api in ("vllm", "sglang"):
        sc = ServerScorer("tiny", srv.base_url, id=f"t-{api}", api=api, topk=4, cache=str(tmp_path / "c.db"))
        sc.bind(tok)
        got = sc.score(reqs)
        for g, w in zip(got, want, strict=True):
            assert g is not None
            torch.testing.assert_close(g.token_ids, w.token_ids)
            torch.testing.assert_close(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)
        again = sc.score(reqs)  # all from the cache
        assert sc.stats.cache_hits == 3 and sc.stats.calls == 3
        assert all(torch.equal(x.token_ids, y.token_ids) for x, y in zip(again, got, strict=True))
        sc.close()


@pytest.mark.slow
def test_kill_the_server_mid_run_nothing_scored_twice_and_budget_held(tiny, server, tmp_path):
    from transformers import AutoTokenizer

    from composer_plugins.teachers.cache import ReplayCache
    from composer_plugins.testing.loopback_server import RolloutServerProcess

    a, _ = tiny
    tok = AutoTokenizer.from_pretrained(a)
    reqs = _requests(tok)
    price = 1e-3
    worst = [price * (len(r.prompt_ids) + len(r.completion_ids)) for r in reqs]
    max_usd = sum(worst) * 1.5  # room for everything once, plus some uncertain spend
    db = str(tmp_path / "scores.db")

    def scorer(url):
        sc = ServerScorer(
            "tiny",
            url,
            id="strong",
            topk=3,
            cache=db,
            max_usd=max_usd,
            prompt_usd_per_token=price,
            max_retries=1,
            timeout_s=5,
            max_concurrency=1,
        )
        sc.bind(tok)
        return sc

    srv = RolloutServerProcess(model=str(a), latency_s=0.4).start()
    first = scorer(srv.base_url)
    killer = threading.Timer(1.5, srv.proc.kill)  # mid-run: a few answered, the rest refused
    killer.start()
    try:
        out1 = first.score(reqs)
    finally:
        killer.cancel()
        srv.stop()
        first.close()
    done1 = [i for i, s in enumerate(out1) if s is not None]
    assert 0 < len(done1) < len(reqs)
    server.reset()  # the restarted server (a fresh process, counters from zero)
    second = scorer(server.base_url)
    out2 = second.score(reqs)
    second.close()
    billed = server.stats()["billed"]
    assert all(s is not None for s in out2)
    assert second.stats.cache_hits == len(done1)
    # the restarted server saw only the rows that had no answer: one request each, never a cached one
    assert sum(v[0] for v in billed.values()) == len(reqs) - len(done1)
    for i in done1:
        torch.testing.assert_close(out2[i].logprobs, out1[i].logprobs)
    with ReplayCache(db) as cache:
        assert cache.run_totals("teacher_distill").total_usd <= max_usd + 1e-12


def test_sglang_shape_parser():
    data = {
        "meta_info": {
            "input_token_logprobs": [[None, 5, None], [-0.5, 7, None], [-2.0, 3, None]],
            "input_top_logprobs": [None, [[-0.5, 7, "a"], [-1.5, 9, "b"]], [[-0.2, 4, "c"], [-1.0, 8, "d"]]],
        }
    }
    actual, ids, lps = parse_sglang_input_logprobs(data, 1, 2, [7, 3])
    assert actual == [-0.5, -2.0] and ids == [[7, 9], [4, 8]] and lps == [[-0.5, -1.5], [-0.2, -1.0]]


def test_alignment_by_hand():
    """Text "abcd": student tokens "ab" | "c" | "d", teacher tokens "a" | "b" | "cd".

    * student "ab" (id 10) is merged from the teacher's "a" (log 0.5) + "b" (log 0.8): probability
      0.4; the teacher's alternatives at "a": "x" (0.3, student id 11) and "ab" itself (0.1, the
      same text as the student's token: id 10) -> {10: 0.4 + 0.1, 11: 0.3}; "a" (the first piece) is
      not an alternative; "zz" (0.05) has no student twin and stays in the tail;
    * student "c" | "d" split the teacher's "cd": not scored.
    """
    teacher_text = {100: "a", 101: "b", 102: "cd", 103: "x", 104: "ab", 105: "zz"}
    student_id = {"ab": 10, "x": 11, "c": 12, "d": 13}

    def map_id(t):
        return student_id.get(teacher_text[t])

    al = align_scores(
        student_ids=[10, 12, 13],
        student_spans=[(0, 2), (2, 3), (3, 4)],
        teacher_ids=[100, 101, 102],
        teacher_spans=[(0, 1), (1, 2), (2, 4)],
        teacher_actual=[math.log(0.5), math.log(0.8), math.log(0.9)],
        teacher_top_ids=[[100, 103, 104, 105], [101], [102]],
        teacher_top_logprobs=[
            [math.log(0.5), math.log(0.3), math.log(0.1), math.log(0.05)],
            [math.log(0.8)],
            [math.log(0.9)],
        ],
        map_id=map_id,
        k=4,
    )
    assert al.mask == [True, False, False]
    assert al.ids[0] == [10, 11]
    assert math.exp(al.sampled[0]) == pytest.approx(0.5) and math.isnan(al.sampled[1])
    assert [math.exp(x) for x in al.logprobs[0]] == pytest.approx([0.5, 0.3])


def test_alignment_merged_block_adds_the_one_token_tokenization():
    """A student token the teacher wrote as two pieces (0.5 · 0.4) gets that chain-rule probability plus the
    teacher's probability of the whole text as one token (0.3, in its top-k at the block's first position):
    0.5, not only the tokenization seen (0.2), as align.py's docstring says."""
    al = align_scores(
        student_ids=[7],
        student_spans=[(0, 2)],
        teacher_ids=[100, 101],
        teacher_spans=[(0, 1), (1, 2)],
        teacher_actual=[math.log(0.5), math.log(0.4)],
        teacher_top_ids=[[100, 200, 104], [101]],
        teacher_top_logprobs=[[math.log(0.5), math.log(0.3), math.log(0.1)], [math.log(0.4)]],
        map_id={100: None, 101: None, 200: 7, 104: 9}.get,
        k=4,
    )
    assert al.mask == [True] and al.ids[0] == [7, 9]
    assert [math.exp(x) for x in al.logprobs[0]] == pytest.approx([0.5, 0.1])
    assert math.exp(al.sampled[0]) == pytest.approx(0.5)


def test_alignment_one_to_one_maps_ids_and_drops_untwinned():
    al = align_scores(
        [1, 2],
        [(0, 1), (1, 2)],
        [50, 51],
        [(0, 1), (1, 2)],
        [math.log(0.6), math.log(0.7)],
        [[50, 52, 53], [51, 50]],
        [[math.log(0.6), math.log(0.2), math.log(0.1)], [math.log(0.7), math.log(0.1)]],
        {50: 1, 51: 2, 52: None, 53: 3}.get,
        3,
    )
    assert al.mask == [True, True]
    assert al.ids == [[1, 3], [2, 1]]
    assert [math.exp(x) for x in al.logprobs[0]] == pytest.approx([0.6, 0.1])


def test_two_tiny_models_with_different_tokenizers(tiny):
    """The teacher (b) scores the student's (a) tokens: where a block is one-to-one the student's token gets
    the teacher's own log-prob of that text; merged blocks get the sum over the teacher's pieces."""
    from transformers import AutoTokenizer

    from composer_plugins.teachers.align import token_spans

    a, b = tiny
    s_tok, t_tok = AutoTokenizer.from_pretrained(a), AutoTokenizer.from_pretrained(b)
    assert s_tok.get_vocab() != t_tok.get_vocab()
    sc = LocalScorer(b, topk=8)
    sc.bind(s_tok)
    reqs = _requests(s_tok)
    out = sc.score(reqs)
    checked = merged = 0
    for r, s in zip(reqs, out, strict=True):
        text, s_spans = token_spans(s_tok, list(r.completion_ids))
        enc = t_tok(text, add_special_tokens=False, return_offsets_mapping=True)
        t_ids, t_spans = enc["input_ids"], enc["offset_mapping"]
        t_prompt = t_tok(r.prompt, add_special_tokens=False)["input_ids"]
        lp = _direct(b, t_prompt, t_ids)
        own = lp.gather(-1, torch.tensor(t_ids)[:, None]).squeeze(-1)
        ends = {e: i for i, (_, e) in enumerate(t_spans)}
        for j, (st, en) in enumerate(s_spans):
            if not s.mask[j]:
                continue
            sid = r.completion_ids[j]
            row = {int(i): float(v) for i, v in zip(s.token_ids[j], s.logprobs[j], strict=True) if i >= 0}
            i_end = ends[en]
            i_start = next(i for i, (x, _) in enumerate(t_spans) if x == st)
            want = float(own[i_start : i_end + 1].sum())
            if i_end > i_start:
                merged += 1
            if i_end == i_start and sid in row:  # one-to-one: the teacher's own log-prob of the text
                assert math.exp(row[sid]) == pytest.approx(math.exp(want), rel=1e-4, abs=1e-6) or (
                    math.exp(row[sid]) >= math.exp(want) - 1e-6  # plus a twin id of the same text
                )
            elif i_end > i_start:
                assert row[sid] == pytest.approx(want, rel=1e-4, abs=1e-5) or row[sid] > want
            checked += 1
    assert checked > 10 and merged > 0
    assert sum(float(s.mask.float().mean()) for s in out) / len(out) > 0.3


class _Slow(TeacherScorer):
    kind = "slow"

    def __init__(self, id, delay):
        super().__init__(id=id, topk=1)
        self.delay = delay

    def score(self, requests):
        time.sleep(self.delay)
        one = TeacherScores(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1), torch.ones(1, dtype=torch.bool))
        return [one for _ in requests]


def test_async_pool_overlaps_and_skips_a_teacher_past_the_deadline(caplog):
    pool = ScoringPool([_Slow("fast", 0.05), _Slow("late", 2.0)])
    try:
        job = pool.submit([ScoreRequest("p", "c", (1,))] * 2)
        busy = sum(range(10_000))  # the trainer's work goes on meanwhile
        t0 = time.monotonic()
        with caplog.at_level("WARNING"):
            scores, metrics = job.collect(deadline_s=0.5)
        waited = time.monotonic() - t0
        assert busy and set(scores) == {"fast"} and len(scores["fast"]) == 2
        assert metrics["teacher/late/skipped"] == 1.0 and metrics["teacher/fast/skipped"] == 0.0
        assert waited < 1.9  # returned at the deadline, not when the slow teacher finished
        assert "late" in caplog.text and "deadline" in caplog.text
    finally:
        pool.close()


def test_hook_register_teacher_scorers():
    from composer_plugins import hookimpl
    from composer_plugins.testing import plugin_registry

    class P:
        __name__ = "scorer_plugin"

        @hookimpl
        def register_teacher_scorers(self, register):
            register("slow", _Slow, "In-process slow scorer.")

    reg, _ = plugin_registry(P())
    e = reg.get("scorers", "slow")
    assert e.plugin == "scorer_plugin"
    built = e.build(id="x", delay=0.0)
    assert isinstance(built, TeacherScorer)
    assert {"causal_lm", "vllm", "sglang"} <= set(reg.names("scorers"))
