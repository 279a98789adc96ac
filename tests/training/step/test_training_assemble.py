"""The one assembler of channel inputs with its builders registered through the ``register_input_builders`` hook
(``training/step/assemble.py``); the record it reads is tested in ``test_step.py``."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from composer_plugins.core import plugins
from composer_plugins.core.hookspecs import hookimpl
from composer_plugins.losses.base import ChannelComposer, LossChannel
from composer_plugins.training.step.assemble import MissingInputError, StepPolicy, assemble_inputs
from composer_plugins.training.step.components import build_env
from composer_plugins.training.step.record import StepMeta, StepRecord


class LengthBonus(LossChannel):
    """A third-party channel reading an input no built-in channel reads (``completion_lengths``)."""

    requires: ClassVar[tuple[str, ...]] = ("completion_lengths",)

    def __init__(self, weight: float = 0.1, name: str = "length_bonus") -> None:
        super().__init__(weight=weight, name=name)
        self.seen: list[torch.Tensor] = []

    def forward(self, inputs):
        lengths = inputs["completion_lengths"]
        self.seen.append(lengths.detach().clone())
        return lengths.float().mean() * 0.0, {"mean_length": float(lengths.float().mean())}


def completion_lengths(asm: Any) -> dict[str, Any]:
    """The third party's input builder: each row's completion length."""
    return {"completion_lengths": asm.record.completion_mask.sum(1)}


CALLS: list[int] = []


def expensive(asm: Any) -> dict[str, Any]:
    CALLS.append(1)
    return {"expensive_input": torch.zeros(())}


class LengthsPlugin:
    """The third party's one edit: a hook implementation registering its builders."""

    __name__ = "lengths_plugin"

    @hookimpl
    def register_input_builders(self, register: Any) -> None:
        register("completion_lengths", completion_lengths)
        register("expensive_input", expensive, description="An input no live channel reads.")


@pytest.fixture
def lengths_builder(isolated_plugins):
    pm = plugins.make_plugin_manager(entrypoints=False)
    pm.register(LengthsPlugin(), name="lengths_plugin")
    plugins.use_plugin_manager(pm)
    CALLS.clear()
    yield completion_lengths


def test_hook_register_input_builders(lengths_builder):
    """Third-party builders are registry entries with their provenance, beside the built-ins."""
    reg = plugins.get_registry()
    names = set(reg.names("input_builders"))
    assert {"completion_lengths", "expensive_input", "logprobs", "hint_mask", "teacher_scores"} <= names
    assert reg.get("input_builders", "completion_lengths").plugin == "lengths_plugin"
    assert reg.get("input_builders", "logprobs").plugin == "composer_plugins.training.runs.plugin"
    assert reg.get("input_builders", "expensive_input").description == "An input no live channel reads."


def test_a_third_party_input_reaches_its_channel_in_lightning(make_cfg, lengths_builder):
    from composer_plugins.training.lightning.module import ComposerModule

    cfg, src = make_cfg("", "losses.hint_distill.enabled=false")
    env = build_env(cfg, src)
    bonus = LengthBonus()
    from composer_plugins.training.step.components import build_channels

    m = ComposerModule(cfg, env=env, src=src, channels=[*build_channels(cfg, src), bonus])
    assert "completion_lengths" in m.composer.required_inputs()
    _, stats = m.compute_step(env.sample_tasks(2, "train", seed=1), seed=3)
    assert stats["length_bonus/skipped"] == 0.0 and len(bonus.seen) == 1
    assert torch.equal(bonus.seen[0], m.last_rollout.completion_mask.sum(1))


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


def test_only_what_the_active_channels_read_is_built(lengths_builder):
    off = LengthBonus(weight=0.0, name="off")
    off.requires = ("expensive_input",)  # type: ignore[misc]
    composer = ChannelComposer([LengthBonus(), off])
    assert composer.required_inputs() == ("completion_lengths",)  # a weight-0 channel reads nothing
    inputs, _ = assemble_inputs(_record(), composer, StepPolicy(model=None, tokenizer=None))
    assert CALLS == [] and inputs["completion_lengths"].tolist() == [3, 5, 5, 5]
    # a trainer's own value wins over the builder, and record.extras is handed over as is
    rec = _record(extras={"completion_lengths": torch.tensor([9, 9, 9, 9])})
    inputs, _ = assemble_inputs(rec, composer, StepPolicy(None, None))
    assert inputs["completion_lengths"].tolist() == [9, 9, 9, 9]
    inputs, _ = assemble_inputs(rec, composer, StepPolicy(None, None), given={"completion_lengths": 1})
    assert inputs["completion_lengths"] == 1


def test_an_input_nothing_builds_is_refused_naming_the_channel_and_the_fix():
    ch = LengthBonus(name="mine")
    ch.requires = ("completion_lenghts",)  # type: ignore[misc]
    with pytest.raises(MissingInputError) as e:
        assemble_inputs(_record(), ChannelComposer([ch]), StepPolicy(None, None))
    msg = str(e.value)
    assert "loss channel 'mine' reads the input 'completion_lenghts'" in msg
    assert "register_input_builders hook" in msg and "StepRecord.extras" in msg
    assert "Did you mean: 'completion_lengths'" not in msg  # not registered in this process: not suggested


def test_a_field_the_trainer_lacks_is_refused_by_the_channel_that_reads_it():
    """No placeholder: a record without advantages (VeRL's own) fails where a channel reads them."""
    from composer_plugins import build

    rec = _record(advantages=None)
    composer = ChannelComposer([build("losses", "grpo")])
    with pytest.raises(MissingInputError, match=r"'grpo' reads the input 'advantages'.*StepRecord.advantages is None"):
        assemble_inputs(rec, composer, StepPolicy(None, None), given={"logprobs": torch.zeros(4, 5)})
    with pytest.raises(MissingInputError, match=r"ref_logprobs.*reference model"):
        assemble_inputs(rec, _Reads("ref_logprobs"), StepPolicy(None, None))
    # a trainer whose own loss reads none of them assembles the rest
    inputs, _ = assemble_inputs(rec, _Reads("completion_mask"), StepPolicy(None, None))
    assert "advantages" not in inputs and inputs["global_step"] == 0


class _Reads:
    def __init__(self, *names: str) -> None:
        self.names, self.channels, self.needs_teacher = names, [], False

    def required_inputs(self) -> tuple[str, ...]:
        return self.names


def test_a_trainers_own_log_probs_come_with_the_records_sampling_time_ones():
    """TRL gives its per-token log-probs; the record's ``old_logprobs`` (TRL's ``old_per_token_logps``) still
    reach the policy channel, which reads them when present."""
    from composer_plugins import build

    composer = ChannelComposer([build("losses", "grpo")])
    old = torch.full((4, 5), -1.0)
    rec = _record(advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), old_logprobs=old)
    lp = torch.zeros(4, 5, requires_grad=True)
    meta = StepMeta(step=2, total_steps=5)
    inputs, _ = assemble_inputs(rec, composer, StepPolicy(None, None), meta=meta, given={"logprobs": lp})
    assert inputs["logprobs"] is lp and inputs["old_logprobs"] is rec.old_logprobs
    assert inputs["inference_logprobs"] is rec.old_logprobs
    assert inputs["global_step"] == 2 and inputs["total_steps"] == 5
    loss, _ = composer(inputs)
    rec = rec.replace(old_logprobs=None)  # on-policy: the given log-probs, detached
    inputs, _ = assemble_inputs(rec, composer, StepPolicy(None, None), given={"logprobs": lp})
    assert torch.equal(inputs["old_logprobs"], lp.detach()) and not inputs["old_logprobs"].requires_grad
    on_policy, _ = composer(inputs)
    assert not torch.allclose(loss, on_policy)  # the ratio against the sampling-time log-probs is live


def test_step_policy_from_config_reads_every_setting_and_takes_the_built_parts(make_cfg):
    """The one way from a config to the assembler's settings (the module and the backends' local modes use it)."""
    from composer_plugins.training.step.assemble import StepPolicy

    cfg, _ = make_cfg(
        "",
        "compute.chunk_size=7",
        "hints.max_context_length=33",
        "replay.max_completion_length=21",
        "rollout.importance_sampling=token_mask",
        "rollout.temperature=0.7",
    )
    model, tok = object(), object()
    sp = StepPolicy.from_config(cfg, model=model, tokenizer=tok, temperature=0.5)
    assert (sp.model, sp.tokenizer, sp.teacher, sp.reference) == (model, tok, None, None)
    assert (sp.chunk_size, sp.max_context_length, sp.pair_max_length, sp.temperature) == (7, 33, 21, 0.5)
    assert sp.pair_prompt_length == cfg.rollout.max_prompt_length and sp.importance_sampling[0] == "token_mask"
    assert sp.micro_batch(torch.zeros(1, 8)) == cfg.compute.rows_per_micro_batch(8)
