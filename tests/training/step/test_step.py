"""The read-only step record and its row operations (``training/step/record.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from composer_plugins.training.step.record import ROW_LISTS, ROW_TENSORS, RecordFrozenError, StepRecord


def _record(rows: int = 4, width: int = 5, **kw: Any) -> StepRecord:
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, 3:] = 0
    return StepRecord(
        tasks=[{"prompt": "p"}],
        prompts=["p"] * rows,
        completions=["c"] * rows,
        prompt_ids=torch.ones(rows, 2, dtype=torch.long),
        prompt_mask=torch.ones(rows, 2, dtype=torch.long),
        completion_ids=torch.ones(rows, width, dtype=torch.long),
        completion_mask=mask,
        rewards=kw.pop("rewards", torch.arange(rows, dtype=torch.float32)),
        advantages=kw.pop("advantages", torch.zeros(rows)),
        num_generations=rows,
        **kw,
    )


def test_the_step_record_round_trips_through_a_checkpoint_state():
    rec = _record(hint_contexts=[None, "ctx", None, "ctx2"], extras={"note": "kept"})
    back = StepRecord.from_state(rec.state())
    assert (
        back.hint_rows == [1, 3] and back.hinted_contexts == ["ctx", "ctx2"] and dict(back.extras) == {"note": "kept"}
    )
    assert torch.equal(back.completion_mask, rec.completion_mask) and dict(back.teacher_scores) == {}
    assert back.row_groups == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="not fields of a StepRecord"):
        StepRecord.from_state({**rec.state(), "rollout": {}})
    old = {**rec.state(), "step": 3, "total_steps": 9, "pairs": []}  # a 0.1 checkpoint from before StepMeta
    with pytest.raises(ValueError, match=r"not fields of a StepRecord: \['pairs', 'step', 'total_steps'\]"):
        StepRecord.from_state(old)


def test_the_record_refuses_writes_once_made_naming_the_line_and_the_fix():
    rec = _record()
    with pytest.raises(RecordFrozenError) as e:
        rec.advantages = torch.ones(4)
    assert f"{__file__}:" in str(e.value) and "ExperienceMaker.make" in str(e.value)
    with pytest.raises(RecordFrozenError, match="StepMeta"):
        rec.step = 3  # per-step meta is a StepMeta, never a record field
    with pytest.raises(TypeError):
        rec.extras["x"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        rec.hint_contexts.append("x")  # type: ignore[attr-defined]
    assert torch.equal(rec.advantages, torch.zeros(4))
    with pytest.raises(ValueError, match="rewards has 3 rows"):
        _record(rewards=torch.zeros(3))  # the consistency check at construction


def test_row_operations_select_concat_and_to():
    rec = _record(hint_contexts=[None, "a", None, "b"], teacher_scores={"t": [1, 2, 3, 4]})
    sub = rec.select([3, 1])
    assert sub.num_rows == 2 and sub.rewards.tolist() == [3.0, 1.0] and list(sub.hint_contexts) == ["b", "a"]
    assert sub.teacher_scores["t"] == [4, 2] and sub.completion_ids.data_ptr() != rec.completion_ids.data_ptr()
    a = _record(2, 3)
    b = StepRecord(
        tasks=[{"prompt": "q"}],
        prompts=["q"] * 2,
        completions=["d"] * 2,
        prompt_ids=torch.full((2, 4), 7),
        prompt_mask=torch.ones(2, 4, dtype=torch.long),
        completion_ids=torch.full((2, 6), 8),
        completion_mask=torch.ones(2, 6, dtype=torch.long),
        rewards=torch.tensor([5.0, 6.0]),
        advantages=torch.zeros(2),
        num_generations=2,
    )
    both = StepRecord.concat([a, b], pad_id=0)
    assert both.prompt_ids.shape == (4, 4) and both.completion_ids.shape == (4, 6)
    assert both.prompt_mask[:2].tolist() == [[0, 0, 1, 1]] * 2  # prompts re-left-padded
    assert both.completion_mask[:2, 3:].sum() == 0 and both.completion_ids[2:].eq(8).all()  # completions right-padded
    assert both.group_index.tolist() == [0, 0, 1, 1] and [t["prompt"] for t in both.tasks] == ["p", "q"]
    assert both.task_of(3)["prompt"] == "q" and both.rewards.tolist() == [0.0, 1.0, 5.0, 6.0]
    with pytest.raises(ValueError, match="before teacher scoring"):
        StepRecord.concat([rec, rec])
    moved = rec.to("meta")
    assert moved.completion_ids.device.type == "meta" and moved.rewards.device.type == "meta"


def test_a_future_of_teacher_scores_is_selected_when_it_resolves():
    import concurrent.futures as cf

    fut: cf.Future = cf.Future()
    sub = _record(teacher_scores={"t": fut}).select([2, 0])
    fut.set_result(["r0", "r1", "r2", "r3"])
    assert sub.teacher_scores["t"].result(timeout=1) == ["r2", "r0"]


def test_the_row_field_lists_are_read_from_the_records_annotations():
    """A per-row field is one annotated ``Tensor`` or ``RowList[...]``: selected, concatenated and checked by type."""
    from dataclasses import fields

    by_type = {f.name: str(f.type) for f in fields(StepRecord)}
    assert set(ROW_TENSORS) == {k for k, t in by_type.items() if t.startswith("Tensor")}
    assert set(ROW_LISTS) == {k for k, t in by_type.items() if t.startswith("RowList[")}
    assert "tasks" not in ROW_LISTS and {"prompts", "hint_kinds"} <= set(ROW_LISTS)
    with pytest.raises(ValueError, match="hint_kinds has 3 entries"):
        _record(hint_kinds=[None] * 3)
