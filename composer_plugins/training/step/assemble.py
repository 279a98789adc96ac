"""The one assembler of channel inputs: a read-only :class:`~composer_plugins.training.step.record.StepRecord`, its
:class:`~composer_plugins.training.step.record.StepMeta` and a policy in, each active channel's inputs out.

:func:`assemble_inputs` builds exactly the inputs the active channels read, each by the builder registered
through ``register_input_builders`` (one builder may provide several names and runs once per assembly); a
trainer's own inputs arrive as ``given``. It never writes the record: an input the record lacks fails with a
located :class:`MissingInputError`. Writing a builder: docs/plugins.md ``register_input_builders``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from composer_plugins.core.errors import ComposerPluginsError, closest
from composer_plugins.core.plugins import get_registry
from composer_plugins.training.step.input_plugin import BUILTINS
from composer_plugins.training.step.record import StepMeta, StepRecord

__all__ = [
    "ALWAYS",
    "PAIR_INPUTS",
    "Assembly",
    "InputBuilder",
    "MissingInputError",
    "Needs",
    "StepPolicy",
    "assemble_inputs",
    "input_builders",
]

#: ``builder(assembly) -> {input name: value}``.
InputBuilder = Callable[["Assembly"], Mapping[str, Any]]

#: Inputs built beside an input a channel declares, which the channels that declare it read when present
#: (the policy channels' sampling-time log-probs and importance-sampling ratio).
COMPANIONS: dict[str, tuple[str, ...]] = {"logprobs": BUILTINS["policy_logprobs"][0][1:]}

#: Inputs built for every step whatever the channels declare (cheap: read from the record and its meta): what the
#: built-in ``record_fields`` builder provides (:data:`composer_plugins.training.step.input_plugin.BUILTINS`).
ALWAYS: tuple[str, ...] = BUILTINS["record_fields"][0]

#: The preference-pair inputs (what the built-in ``pair_inputs`` builder provides).
PAIR_INPUTS: tuple[str, ...] = BUILTINS["pair_inputs"][0]


#: registry -> its input-builder table (resolved once per registry: ``module:attr`` targets import once).
_TABLES: weakref.WeakKeyDictionary[Any, dict[str, InputBuilder]] = weakref.WeakKeyDictionary()


def input_builders(registry: Any = None) -> dict[str, InputBuilder]:
    """Input name -> its builder, from the ``input_builders`` registry (``registry``: the process-wide one)."""
    if registry is None:
        registry = get_registry()
    table = _TABLES.get(registry)
    if table is None:
        table = _TABLES[registry] = {e.name: e.factory for e in registry.entries("input_builders")}
    return dict(table)


class Needs:
    """The inputs a trainer's own loss reads, declared as a composer's active channels would declare them
    (for adapters whose loss is the upstream trainer's: VeRL, PRIME-RL)."""

    def __init__(self, *names: str) -> None:
        self.names = tuple(names)
        self.channels: list[Any] = []

    def required_inputs(self) -> tuple[str, ...]:
        return self.names


class MissingInputError(ComposerPluginsError):
    """A channel reads an input that no builder provides, or that the trainer's step record lacks."""


@dataclass
class StepPolicy:
    """The models and settings that turn a record into channel inputs.

    Attributes:
        model: the policy being optimised (its forwards record gradients).
        tokenizer: its tokenizer (hinted contexts, preference pairs).
        teacher: the module scoring the hinted contexts (an :class:`~composer_plugins.training.step.ema.EMATeacher`);
            ``None``: the policy itself, without gradient.
        reference: the frozen reference model (the pairs' reference log-probs); ``None``: the policy,
            without gradient.
        temperature: the sampling temperature: the log-prob builders take the policy's, reference's and hint
            teacher's log-probs at it (they own it for those inputs); it is passed on as ``sampling_temperature``
            for channels that own their temperature (``hint_distill`` divides its logits by it, once).
        chunk_size: LM-head rows per chunk (``None``: chosen from the vocabulary).
        rows_per_micro_batch: ``f(sequence length) -> rows`` per forward micro-batch (``None``: all rows).
        max_context_length: hinted-context tokens kept (from the right).
        pair_prompt_length, pair_max_length: prompt and completion tokens kept per preference pair.
        importance_sampling: ``(mode, max, min)`` of the correction from a server's sampling log-probs
            (``rollout.importance_sampling``); ``None`` or mode ``off``: no correction.
        teacher_margin: log ``hint/teacher_margin`` (``hints.teacher_margin``: one more LM-head pass per step).
        teacher_scoring: the ``teacher_distill`` scorers' pool: the ``teacher_scores`` builder waits for the
            futures the experience maker started up to its ``deadline_s`` (a teacher past it is skipped).
    """

    model: Any
    tokenizer: Any
    teacher: Any = None
    reference: Any = None
    temperature: float = 1.0
    chunk_size: int | None = None
    rows_per_micro_batch: Callable[[int], int] | None = None
    max_context_length: int = 256
    pair_prompt_length: int = 256
    pair_max_length: int = 128
    importance_sampling: tuple[str, float, float | None] | None = None
    teacher_margin: bool = False
    teacher_scoring: Any = None

    @classmethod
    def from_config(cls, cfg: Any, **parts: Any) -> StepPolicy:
        """The settings a :class:`~composer_plugins.training.config.train.TrainConfig` gives, the one way every trainer
        path builds them; ``parts``: the built models (``model``, ``tokenizer``, ``teacher``, ``reference``,
        ``teacher_scoring``), or a setting a path overrides."""
        r, c = cfg.rollout, cfg.compute
        settings: dict[str, Any] = {
            "temperature": r.temperature,
            "chunk_size": c.chunk_size,
            "rows_per_micro_batch": c.rows_per_micro_batch,
            "max_context_length": cfg.hints.max_context_length,
            "pair_prompt_length": r.max_prompt_length,
            "pair_max_length": cfg.replay.max_completion_length,
            "importance_sampling": (r.importance_sampling, r.importance_sampling_max, r.importance_sampling_min),
            "teacher_margin": cfg.hints.teacher_margin,
        }
        return cls(**{**settings, **parts})

    def micro_batch(self, *tensors: Tensor) -> int | None:
        """Rows per micro-batch for sequences as long as the concatenated ``tensors``."""
        if self.rows_per_micro_batch is None:
            return None
        return self.rows_per_micro_batch(sum(int(t.shape[1]) for t in tensors))


@dataclass
class Assembly:
    """One assembly in progress: what builders read (the record, the meta, the policy) and write (values)."""

    record: StepRecord
    policy: StepPolicy
    required: tuple[str, ...]
    meta: StepMeta = field(default_factory=StepMeta)
    builders: Mapping[str, InputBuilder] = field(default_factory=dict)
    composer: Any = None
    values: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    #: Intermediate results builders share (``policy_hidden``: the student's hidden states).
    scratch: dict[str, Any] = field(default_factory=dict)
    _ran: set[int] = field(default_factory=set)

    def wants(self, name: str) -> bool:
        """True when some active channel reads ``name``."""
        return name in self.required

    def get(self, name: str) -> Any:
        """Input ``name``, built now if it was not (``None`` when its builder does not provide it)."""
        if name not in self.values:
            builder = self.builders.get(name)
            if builder is not None and id(builder) not in self._ran:
                self._ran.add(id(builder))
                for k, v in builder(self).items():
                    self.values.setdefault(k, v)
        return self.values.get(name)

    def lacking(self, name: str, field_name: str, fix: str) -> MissingInputError:
        """The located error for a channel that reads ``name`` where the record's ``field_name`` is ``None``."""
        readers = _readers(name, self.composer)
        return MissingInputError(
            f"loss channel {readers} reads the input {name!r}, but this step record has no {field_name} "
            f"(StepRecord.{field_name} is None: the trainer that made it does not compute it). Fix: {fix}, "
            "or disable the channel for this trainer."
        )

    @property
    def device(self) -> torch.device:
        return self.record.completion_ids.device


def assemble_inputs(
    record: StepRecord,
    composer: Any,
    policy: StepPolicy,
    *,
    meta: StepMeta | None = None,
    given: Mapping[str, Any] | None = None,
    builders: Mapping[str, InputBuilder] | None = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """``(inputs, stats)``: every input the active channels of ``composer`` read, built from ``record``.

    ``meta``: the step, run length and preference pairs. ``given``: inputs the trainer already holds (their
    builders do not run); ``record.extras`` is given too. ``builders``: the input-builder table (default: the
    registry's). Pass ``inputs`` to the composer. ``stats`` holds what the builders measured (``hint/rows`` ...).
    Raises :class:`MissingInputError` naming the channel for an input nothing provides or the record lacks.
    """
    required = tuple(composer.required_inputs())
    table = input_builders() if builders is None else builders
    asm = Assembly(record, policy, required, meta or StepMeta(), table, composer)
    asm.values.update({k: v for k, v in record.extras.items() if v is not None})
    asm.values.update({k: v for k, v in (given or {}).items() if v is not None})
    for name in (*ALWAYS, *required):
        if name in asm.values:
            continue
        if name not in table:
            raise MissingInputError(_missing_message(name, composer, table))
        asm.get(name)
    for name in required:
        for extra in COMPANIONS.get(name, ()):
            if extra not in asm.values:
                asm.get(extra)
    return asm.values, asm.stats


def _readers(name: str, composer: Any) -> str:
    chans = getattr(composer, "channels", None) or ()
    readers = [c.name for c in chans if getattr(c, "weight", 1.0) != 0.0 and name in _channel_inputs(c)]
    return ", ".join(map(repr, readers)) or f"(the trainer's own loss: {type(composer).__name__})"


def _missing_message(name: str, composer: Any, table: Mapping[str, Any]) -> str:
    near = closest(name, list(table))
    sugg = f" Did you mean: {', '.join(map(repr, near))}?" if near else ""
    have = ", ".join(sorted(table))
    return (
        f"loss channel {_readers(name, composer)} reads the input {name!r}, which no input builder provides — "
        f"register one through the register_input_builders hook (composer_plugins.training.step.assemble), "
        f"or put it in StepRecord.extras. Inputs with a builder: {have}.{sugg}"
    )


def _channel_inputs(ch: Any) -> tuple[str, ...]:
    opts = tuple(k for grp in getattr(ch, "input_options", ()) or () for k in grp)
    return tuple(ch.required_inputs()) + opts
