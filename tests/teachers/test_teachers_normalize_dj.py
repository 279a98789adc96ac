"""Pair normalisation with data-juicer's own executor and ops, from the shipped YAML recipe."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from composer_plugins.teachers.normalize import DEFAULT_RECIPE, NormalizeError, normalize_pairs
from composer_plugins.teachers.pairs import validate_pair

pytestmark = pytest.mark.slow


def _pair(sid: str, question: str, chosen: str = "#### 4", rejected: str = "#### 5", **kw) -> dict:
    messages = [{"role": "system", "content": "Solve."}, {"role": "user", "content": question}]
    rec = {
        "state_id": sid,
        "trace_id": sid.split("#")[0],
        "step": 0,
        "source": "traces.jsonl:1",
        "prompt": f"<|system|>\nSolve.\n<|user|>\n{question}",
        "messages": messages,
        "chosen": chosen,
        "rejected": rejected,
        "chosen_message": {"role": "assistant", "content": chosen},
        "rejected_message": {"role": "assistant", "content": rejected, "thinking": "2+2 is 5?"},
        "teachers": ["a", "oracle"],
        "k": 2,
        "n_teachers": 3,
        "agreement": 0.666667,
        "dissent": {"b": "#### 3"},
        "compare": "text",
        "metadata": {"answer": "4", "nested": {"list": [1, None, {"x": "ü"}]}},
    }
    rec.update(kw)
    return rec


def test_recipe_is_shipped_with_the_four_ops_and_errors_on():
    recipe = yaml.safe_load(DEFAULT_RECIPE.read_text())
    ops = [next(iter(op)) for op in recipe["process"]]
    assert ops == ["text_length_filter", "words_num_filter", "special_characters_filter", "document_deduplicator"]
    assert recipe["skip_op_error"] is False


def test_normalize_round_trip_filter_and_dedup(tmp_path):
    tool = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}],
    }
    pairs = [
        _pair("a#0", "What is 2 + 2?"),
        _pair("dup#0", "What is 2 + 2?", chosen="#### 4 ", rejected="####  5"),  # same after normalisation
        _pair("b#0", "What is 1 + 3? Explain.", chosen="1 + 3 = 4\n#### 4"),
        _pair("sym#0", "#$%&*!?~^" * 20, chosen="#### 4"),  # nearly all symbols: degenerate
        _pair(
            "tool#0",
            "Find the docs about ünïcode",
            chosen='{"tool": "search", "arguments": "{\\"q\\": \\"x\\"}"}',
            chosen_message=tool,
        ),
    ]
    kept, report = normalize_pairs(pairs, work_dir=tmp_path / "dj")
    assert [p["state_id"] for p in kept] == ["a#0", "b#0", "tool#0"]
    assert report.n_in == 5 and report.n_out == 3 and sorted(report.dropped) == ["dup#0", "sym#0"]
    # records round-trip exactly: chat messages, flat text and provenance
    by_id = {p["state_id"]: p for p in pairs}
    for p in kept:
        assert p == by_id[p["state_id"]]
        assert validate_pair(p) == []  # keeps the schema
        assert isinstance(p["messages"], list) and isinstance(p["prompt"], str)
    assert (tmp_path / "dj" / "out" / "pairs_out.jsonl").exists()


def test_op_errors_are_not_swallowed(tmp_path):
    """Even a recipe asking for skip_op_error: true runs with it off: a failing op stops the run."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "project_name: bad\ntext_keys: text\nnp: 1\nskip_op_error: true\nuse_cache: false\n"
        "process:\n  - words_num_filter:\n      text_key: step\n      min_num: 1\n"
    )
    with pytest.raises(NormalizeError, match="data-juicer failed while running the recipe"):
        normalize_pairs([_pair("a#0", "What is 2 + 2?")], bad, columns=["step"])
    with pytest.raises(NormalizeError, match="recipe not found"):
        normalize_pairs([_pair("a#0", "q")], tmp_path / "missing.yaml")
    assert normalize_pairs([], bad)[0] == []


def test_normalize_cli(tmp_path):
    from composer_plugins.core.cli import load_commands

    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in [_pair("a#0", "What is 2 + 2?"), _pair("a#1", "")]))
    out = tmp_path / "norm.jsonl"
    res = CliRunner().invoke(load_commands(), ["replay", "normalize", str(src), str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output.strip().splitlines()[-1])
    assert report["n_in"] == 2 and report["n_out"] == 2
    assert [json.loads(x)["state_id"] for x in out.read_text().splitlines()] == ["a#0", "a#1"]
