"""The step record and the one assembler of channel inputs (``training/step.py``, ``training/assemble.py``)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from composer_plugins.losses.base import ChannelComposer, LossChannel
from composer_plugins.training.assemble import (
    INPUT_BUILDERS,
    MissingInputError,
    StepPolicy,
    assemble_inputs,
    register_input_builder,
)
from composer_plugins.training.builders import build_env
from composer_plugins.training.step import StepRecord


class LengthBonus(LossChannel):
    """A third-party channel reading an input no built-in channel reads (``completion_lengths``)."""

    requires: ClassVar[tuple[str, ...]] = ("completion_lengths",)

    def __init__(self, weight: float = 0.1, name: str = "length_bonus") -> None:
        super().__init__(weight=weight, name=name)
        self.seen: list[torch.Tensor] = []

    def forward(self, model_outputs, batch):
        lengths = self.get("completion_lengths", model_outputs, batch)
        self.seen.append(lengths.detach().clone())
        return lengths.float().mean() * 0.0, {"mean_length": float(lengths.float().mean())}


@pytest.fixture
def lengths_builder():
    """The third party's one edit: a builder for its input, registered in the one table."""

    @register_input_builder("completion_lengths")
    def completion_lengths(asm):
        return {"completion_lengths": asm.record.completion_mask.sum(1)}

    yield completion_lengths
    INPUT_BUILDERS.pop("completion_lengths")


def test_a_third_party_input_reaches_its_channel_in_lightning(make_cfg, lengths_builder):
    from composer_plugins.training.module import ComposerModule

    cfg, src = make_cfg("", "losses.hint_distill.enabled=false")
    env = build_env(cfg, src)
    bonus = LengthBonus()
    from composer_plugins.training.builders import build_channels

    m = ComposerModule(cfg, env=env, src=src, channels=[*build_channels(cfg, src), bonus])
    assert "completion_lengths" in m.composer.required_inputs()
    _, stats = m.compute_step(env.sample_tasks(2, "train", seed=1), seed=3)
    assert stats["length_bonus/skipped"] == 0.0 and len(bonus.seen) == 1
    assert torch.equal(bonus.seen[0], m.last_rollout.completion_mask.sum(1))


def _record(rows: int = 4, width: int = 5) -> StepRecord:
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
        rewards=torch.arange(rows, dtype=torch.float32),
        advantages=torch.zeros(rows),
        num_generations=rows,
    )


def test_only_what_the_active_channels_read_is_built(lengths_builder):
    calls = []

    @register_input_builder("expensive_input")
    def expensive(asm):
        calls.append(1)
        return {"expensive_input": torch.zeros(())}

    try:
        off = LengthBonus(weight=0.0, name="off")
        off.requires = ("expensive_input",)  # type: ignore[misc]
        composer = ChannelComposer([LengthBonus(), off])
        assert composer.required_inputs() == ("completion_lengths",)  # a weight-0 channel reads nothing
        inputs, _ = assemble_inputs(_record(), composer, StepPolicy(model=None, tokenizer=None))
        assert calls == [] and inputs["completion_lengths"].tolist() == [3, 5, 5, 5]
        # a trainer's own value wins over the builder, and record.extras is handed over as is
        rec = _record()
        rec.extras["completion_lengths"] = torch.tensor([9, 9, 9, 9])
        inputs, _ = assemble_inputs(rec, composer, StepPolicy(None, None))
        assert inputs["completion_lengths"].tolist() == [9, 9, 9, 9]
        inputs, _ = assemble_inputs(rec, composer, StepPolicy(None, None), given={"completion_lengths": 1})
        assert inputs["completion_lengths"] == 1
    finally:
        INPUT_BUILDERS.pop("expensive_input")


def test_an_input_nothing_builds_is_refused_naming_the_channel_and_the_fix():
    ch = LengthBonus(name="mine")
    ch.requires = ("completion_lenghts",)  # type: ignore[misc]
    with pytest.raises(MissingInputError) as e:
        assemble_inputs(_record(), ChannelComposer([ch]), StepPolicy(None, None))
    msg = str(e.value)
    assert "loss channel 'mine' reads the input 'completion_lenghts'" in msg
    assert "@register_input_builder('completion_lenghts')" in msg and "StepRecord.extras" in msg
    with pytest.raises(ValueError, match="already built"):
        register_input_builder("advantages")(lambda asm: {})


def test_the_step_record_round_trips_through_a_checkpoint_state():
    rec = _record()
    rec.hint_contexts = [None, "ctx", None, "ctx2"]
    rec.extras["note"] = "kept"
    back = StepRecord.from_state(rec.state())
    assert back.hint_rows == [1, 3] and back.hinted_contexts == ["ctx", "ctx2"] and back.extras == {"note": "kept"}
    assert torch.equal(back.completion_mask, rec.completion_mask) and back.teacher_scores == {}
    assert back.rollout.group_index.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="not fields of a StepRecord"):
        StepRecord.from_state({**rec.state(), "rollout": {}})


def test_a_trainers_own_log_probs_come_with_the_records_sampling_time_ones():
    """TRL gives its per-token log-probs; the record's ``old_logprobs`` (TRL's ``old_per_token_logps``) still
    reach the policy channel, which reads them when present."""
    from composer_plugins import build

    composer = ChannelComposer([build("losses", "grpo")])
    rec = _record()
    rec.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    rec.old_logprobs = torch.full((4, 5), -1.0)
    lp = torch.zeros(4, 5, requires_grad=True)
    inputs, _ = assemble_inputs(rec, composer, StepPolicy(None, None), given={"logprobs": lp})
    assert inputs["logprobs"] is lp and inputs["old_logprobs"] is rec.old_logprobs
    assert inputs["inference_logprobs"] is rec.old_logprobs
    loss, _ = composer(inputs, inputs)
    rec.old_logprobs = None  # on-policy: the given log-probs, detached
    inputs, _ = assemble_inputs(rec, composer, StepPolicy(None, None), given={"logprobs": lp})
    assert torch.equal(inputs["old_logprobs"], lp.detach()) and not inputs["old_logprobs"].requires_grad
    on_policy, _ = composer(inputs, inputs)
    assert not torch.allclose(loss, on_policy)  # the ratio against the sampling-time log-probs is live
