"""The sections of a train config, each validating itself: one dataclass per top-level key, one comment per field.

:meth:`Section.validate` checks a section's own values and raises a located
:class:`~composer_plugins.core.errors.ConfigError`; :class:`~composer_plugins.training.config.train.TrainConfig`
checks what spans sections. See docs/training.md "Config".
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from composer_plugins.core.config import Config, check_component_name
from composer_plugins.losses.correction import IS_MODES
from composer_plugins.models import CompileMode
from composer_plugins.models.tiny import TinyModelConfig

__all__ = [
    "SFT_HINT_KINDS",
    "ComputeSection",
    "DataSection",
    "EvalSection",
    "HintsSection",
    "MLflowSection",
    "ModelSection",
    "OptimSection",
    "ReplaySection",
    "RolloutSection",
    "SFTSection",
    "Section",
    "TrainerSection",
    "need",
    "positive",
]

#: What a hinted SFT example can carry (``sft.hint_kinds``).
SFT_HINT_KINDS = ("feedback", "demonstration", "step_check")
#: Strategy names this config accepts besides Lightning's registered ones.
#: ``compute.gradient_checkpointing`` modes.
Checkpointing = Literal["auto", "layer", "none"]


def need(src: Config, key: str, ok: bool, value: Any, problem: str, fix: str) -> None:
    """Refuse ``value`` at ``key`` unless ``ok``: ``file:line: key: <problem>, got <value> — <fix>.``"""
    if not ok:
        raise src.error(key, f"{problem}, got {value!r} — {fix}.")


def _lr_and_warmup(src: Config, key: str, section: Any, example: str) -> None:
    """Refuse a learning rate ``<= 0`` (``key.lr``) and a negative ``key.warmup_steps`` (the SFT and RL optimizers)."""
    lr, warmup = section.lr, section.warmup_steps
    need(src, f"{key}.lr", lr > 0, lr, "a learning rate must be > 0", f"use a small positive number such as {example}")
    need(src, f"{key}.warmup_steps", warmup >= 0, warmup, "must be >= 0", "use 0 for no warmup")


def positive(src: Config, key: str, section: Any, *names: str) -> None:
    """Refuse the first of ``section``'s fields ``names`` below 1: ``file:line: key.name: must be >= 1, got v.``"""
    for name in names:
        v = getattr(section, name)
        if v < 1:
            raise src.error(f"{key}.{name}", f"must be >= 1, got {v}.")


class Section:
    """A config section: a dataclass that checks its own values (:meth:`validate`)."""

    def validate(self, src: Config, key: str) -> None:
        """Refuse values this section cannot run with, located at ``key.<field>`` in ``src``; nothing by default."""


@dataclass
class ModelSection(Section):
    """Policy to train: a hub id, a local ``save_pretrained`` directory, or ``tiny`` (embedded default)."""

    name_or_path: str = "tiny"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: How a prompt given as chat messages (``[{role, content}, ...]``) becomes the text the model reads:
    #: ``auto`` (the tokenizer's chat template, generation prompt added; plain text without one), ``none``
    #: (plain: a lone user message verbatim, else ``<|role|>`` headers) or the path of a Jinja chat-template
    #: file (installed on the loaded tokenizer, so the exported model carries it). Text prompts are never changed.
    chat_template: str = "auto"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def validate(self, src: Config, key: str = "model") -> None:
        """The ``tiny`` shape (sizes >= 1, heads dividing) and ``chat_template`` (a mode or a template file)."""
        tiny = self.tiny
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            v = getattr(tiny, f)
            need(src, f"{key}.tiny.{f}", v >= 1, v, "must be >= 1", "use a positive integer")
        for f, of, most in (("num_heads", "hidden_size", 12), ("num_kv_heads", "num_heads", None)):
            n, total = getattr(tiny, f), getattr(tiny, of)
            divisors = [h for h in range(1, total + 1) if total % h == 0][:most]
            problem = f"must divide model.tiny.{of} ({total})"
            need(src, f"{key}.tiny.{f}", total % n == 0, n, problem, f"use one of {divisors}")
        from composer_plugins.training.rollout.chat import check_chat_template

        check_chat_template(self.chat_template, src, f"{key}.chat_template")


@dataclass
class DataSection(Section):
    """Where tasks come from. By default the env's own seeded generator; JSONL files override it."""

    train_path: str | None = None
    test_path: str | None = None
    train_split: str = "train"
    test_split: str = "test"


@dataclass
class SFTSection(Section):
    """Supervised warm start on the env's worked solutions (cached by config hash)."""

    enabled: bool = True
    steps: int = 140
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    num_examples: int = 4000
    max_length: int = 256
    seed: int = 0
    #: Fraction of examples whose prompt is a hinted teacher context (so the policy learns to use hints).
    hint_fraction: float = 0.5
    #: Shares of ``feedback``, ``demonstration``, ``step_check`` among hinted examples (docs/training.md).
    #: ``null``: ``{demonstration: 1}`` if ``hints.provider`` is ``demonstration``, else ``{feedback: 1}``.
    hint_kinds: dict[str, float] | None = None
    #: Share of plain demonstrations given with the env's slip (at the column levels the dropped last carry).
    slip_rate: float = 0.0
    #: Use the cache (``cache_dir``) for the SFT checkpoint.
    cache: bool = True
    #: Show a progress bar.
    progress: bool = True

    def validate(self, src: Config, key: str = "sft") -> None:
        """A positive ``lr``, ``warmup_steps >= 0``, ``hint_kinds`` shares of known kinds, sizes >= 1, steps >= 0."""
        _lr_and_warmup(src, key, self, "0.003")
        kinds = self.hint_kinds
        if kinds is not None:
            ok = isinstance(kinds, Mapping) and bool(kinds)
            fix = "e.g. {feedback: 0.5, demonstration: 0.5}"
            need(src, f"{key}.hint_kinds", ok, kinds, "must map hint kinds to shares", fix)
            for k, v in kinds.items():
                if k not in SFT_HINT_KINDS:
                    raise src.error(f"{key}.hint_kinds.{k}", "unknown hint kind.", valid=SFT_HINT_KINDS)
                ok = isinstance(v, int | float) and v >= 0
                need(src, f"{key}.hint_kinds.{k}", ok, v, "a share must be a number >= 0", "use e.g. 0.5")
            need(src, f"{key}.hint_kinds", sum(kinds.values()) > 0, kinds, "the shares sum to 0", "give one share > 0")
        ok = isinstance(self.slip_rate, int | float) and 0.0 <= self.slip_rate <= 1.0
        need(src, f"{key}.slip_rate", ok, self.slip_rate, "a share must be in [0, 1]", "use e.g. 0.7, or 0: none")
        for f in ("batch_size", "num_examples", "max_length"):
            v = getattr(self, f)
            need(src, f"{key}.{f}", v >= 1, v, "must be >= 1", "use a positive integer")
        fix = "use a number of optimizer steps, or sft.enabled: false to skip the warm start"
        need(src, f"{key}.steps", self.steps >= 0, self.steps, "must be >= 0", fix)


@dataclass
class RolloutSection(Section):
    """Sampling of the ``G`` completions per prompt."""

    prompts_per_step: int = 8
    num_generations: int = 8
    temperature: float = 0.5
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    max_prompt_length: int = 192
    #: > 1 drives the env's reset/step loop (tool-using envs).
    max_turns: int = 1
    #: Optimizer steps per rollout batch (PPO-style epochs, TRL's ``num_iterations``); > 1 keeps the
    #: sampling-time log-probs as ``old_logprobs`` so the clipped importance ratio is live.
    num_iterations: int = 1
    #: Share of steps the policy samples (TRL GKD's ``lmbda``); the rest train on each task's reference completion.
    on_policy_fraction: float = 1.0
    #: Reward at or above which a completion counts as correct (accuracy; no hint below it).
    success_threshold: float = 1.0
    #: Deprecated (0.2, removed in 0.3): ``group_advantages`` kwargs; use ``losses.<key>.advantage``.
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)
    #: What samples the completions (registry kind ``rollout_generators``): ``hf`` (HF ``generate``
    #: in the training process) or ``{name: server, base_url: http://host:port/v1, ...}`` (vLLM/SGLang).
    generator: Any = "hf"
    #: Correction of an inference engine's policy lag (generators that report sampling log-probs):
    #: ``token_truncate`` | ``token_mask`` | ``sequence_truncate`` | ``sequence_mask`` (TRL's
    #: ``vllm_importance_sampling_mode``) or ``off``.
    importance_sampling: str = "token_truncate"
    #: Upper bound of the importance-sampling ratio (TRL's ``vllm_importance_sampling_clip_max``).
    importance_sampling_max: float | None = 3.0
    #: Lower bound (``null``: none).
    importance_sampling_min: float | None = None
    #: ``hf`` generator: a static KV cache and a compiled decode step ``on``, ``off`` or ``auto`` (on for CUDA).
    compile: CompileMode | bool = "auto"

    def validate(self, src: Config, key: str = "rollout") -> None:
        """Counts >= 1, a temperature > 0, a registered ``generator`` (in-process for multi-turn), a known IS mode."""
        positive(src, key, self, "num_generations", "prompts_per_step", "max_new_tokens", "num_iterations")
        if self.temperature <= 0:
            raise src.error(f"{key}.temperature", f"must be > 0, got {self.temperature}.")
        f, why = self.on_policy_fraction, "must be in [0, 1], and 1 with multi-turn episodes (rollout.max_turns > 1)"
        need(src, f"{key}.on_policy_fraction", f == 1 or (0 <= f < 1 and self.max_turns == 1), f, why, "e.g. 0.5")
        check_component_name("rollout_generators", self.generator, f"{key}.generator", src)
        gen = self.generator
        gen_name = gen.get("name") if isinstance(gen, Mapping) else gen
        if self.max_turns > 1 and gen_name not in (None, "hf"):
            raise src.error(
                f"{key}.generator",
                f"multi-turn episodes (rollout.max_turns={self.max_turns}) are sampled in-process; "
                "set rollout.generator=hf or rollout.max_turns=1.",
            )
        if isinstance(self.compile, bool):  # YAML reads a bare on/off as a boolean
            self.compile = "on" if self.compile else "off"
        if self.importance_sampling not in (*IS_MODES, "off"):
            valid = (*IS_MODES, "off")
            raise src.error(f"{key}.importance_sampling", f"unknown mode {self.importance_sampling!r}.", valid=valid)


@dataclass
class HintsSection(Section):
    """Hint provider for the hint-distillation channel (registry kind ``hints``)."""

    provider: Any = field(
        default_factory=lambda: {
            "name": "template",
            "reveal_answer": True,
            "templates": {"wrong_answer": "The answer is {expected}.", "no_answer": "The answer is {expected}."},
        }
    )
    max_hinted_per_step: int | None = None
    max_context_length: int = 256
    #: Log ``hint/teacher_margin`` (teacher − student log-prob per hinted token): one more LM-head pass of both.
    teacher_margin: bool = False

    def validate(self, src: Config, key: str = "hints") -> None:
        """``provider`` names a registered hint provider (nothing is built)."""
        check_component_name("hints", self.provider, f"{key}.provider", src)


@dataclass
class ReplaySection(Section):
    """Preference pairs (JSONL ``prompt``/``chosen``/``rejected``) for the replay DPO channel."""

    pairs_path: str | None = None
    pairs_per_step: int = 4
    max_completion_length: int = 128


@dataclass
class OptimSection(Section):
    """Optimizer and learning-rate schedule of the RL phase."""

    #: A registered optimizer (``composer-plugins list optimizers``): ``adamw``, ``adam``, ``sgd`` built in.
    name: str = "adamw"
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.0
    warmup_steps: int = 0
    scheduler: Literal["constant", "cosine", "linear"] = "cosine"
    #: Further keyword arguments of the optimizer (e.g. ``{amsgrad: true}``), passed as they are.
    args: dict[str, Any] = field(default_factory=dict)
    #: ``auto``: ``fused=True`` on CUDA, ``foreach=True`` elsewhere (optimizers taking them); a bool: ``fused``.
    fused: Literal["auto"] | bool = "auto"

    def validate(self, src: Config, key: str = "optim") -> None:
        """A positive ``lr``, ``warmup_steps >= 0`` and a registered optimizer ``name``."""
        _lr_and_warmup(src, key, self, "2e-05")
        from composer_plugins.training.step.optim import check_optimizer_name

        check_optimizer_name(self.name, src, f"{key}.name")


@dataclass
class TrainerSection(Section):
    """Lightning ``Trainer`` settings."""

    max_steps: int = 80
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    gradient_clip_algorithm: Literal["norm", "value"] = "norm"
    log_every_n_steps: int = 1
    #: Validate every N optimizer steps (``None``: only at the start and end).
    val_every_n_steps: int | None = None
    checkpoint_every_n_steps: int = 10
    keep_checkpoints: int = 1
    enable_progress_bar: bool = True
    #: With the bar off (``enable_progress_bar: false``, as in the DVC stages), one line on stderr every N
    #: optimizer steps and at the last: ``train runs/x: step 20/40 reward=0.41 loss=0.093 (31 s)``; 0: none.
    #: ``--no-progress`` silences the lines too.
    progress_every_n_steps: int = 10
    accelerator: str = "cpu"
    devices: Any = 1
    #: ``auto``, ``ddp``, ``fsdp`` (each decoder layer its own FSDP unit), any Lightning strategy name
    #: (``ddp_spawn``, ``fsdp_cpu_offload`` ...) or a class path / ``{class_path, init_args}``.
    #: With ``devices: N`` each of the N data-parallel ranks draws 1/N of ``rollout.prompts_per_step``.
    strategy: Any = "auto"
    #: Limit of every collective of the ``ddp``/``fsdp`` process group (seconds).
    dist_timeout_s: float = 1800.0
    precision: str = "32-true"
    deterministic: bool = False
    #: ``torch.set_num_threads`` (``None`` keeps the default).
    num_threads: int | None = None
    #: Callbacks from plugins (``composer-plugins list callbacks``), added after the built-in ones:
    #: names, ``{name: ..., <kwargs>}`` or ``{class_path: ..., init_args: ...}``.
    callbacks: list[Any] = field(default_factory=list)

    def validate(self, src: Config, key: str = "trainer") -> None:
        """Step counts, checkpoint settings, a known ``strategy`` and registered ``callbacks``."""
        positive(src, key, self, "max_steps", "accumulate_grad_batches")
        every, keep = self.checkpoint_every_n_steps, self.keep_checkpoints
        fix = "use 0 to write no checkpoints, or N to write one every N steps"
        need(src, f"{key}.checkpoint_every_n_steps", every >= 0, every, "must be >= 0", fix)
        fix = "use -1 to keep every checkpoint, or how many to keep"
        need(src, f"{key}.keep_checkpoints", keep >= -1, keep, "must be >= -1", fix)
        strat = self.strategy
        import composer_plugins.training.config.strategy_names as sn

        if (
            isinstance(strat, str)
            and "." not in strat
            and strat.strip().lower() not in sn.STRATEGY_SHORTHANDS  # these are known without importing Lightning
            and strat.strip().lower() not in sn.strategy_names()
        ):
            raise sn.unknown_strategy(strat, src, f"{key}.strategy")
        from composer_plugins.training.lightning.callbacks import check_callback_names

        check_callback_names(self.callbacks, src, f"{key}.callbacks")


@dataclass
class ComputeSection(Section):
    """How one training step holds memory: micro-batches of rows, chunks of the LM head.

    The rollout batch's forward/backward runs ``micro_batch_size`` rows at a time (activation
    checkpointing per decoder layer when there are several: ``gradient_checkpointing``), and every log-prob, entropy and
    divergence is computed from the final hidden states through the LM head ``chunk_size`` rows
    at a time: no ``rows × tokens × vocab`` tensor is built. The composed loss is the same as the
    one-shot loss (it is computed once, over the whole batch, from the hidden states).
    """

    #: Rows per forward/backward micro-batch (``null``: as many as fit ``micro_batch_tokens``).
    micro_batch_size: int | None = None
    #: Token budget of one micro-batch, rows × (prompt + completion length), when ``micro_batch_size`` is null.
    micro_batch_tokens: int = 4096
    #: LM-head rows per chunk (``null``: from the device's free memory, ~1,024 on a GPU, 96 on the CPU at V=151,936).
    chunk_size: int | None = None
    #: LM-head kernels: ``auto`` (picked per device and memory at the start of training, logged), ``materialised``
    #: (one chunk of all a step's tokens), ``chunked`` or ``liger`` (``composer_plugins.kernels.select``).
    kernels: str = "auto"
    #: Activation checkpointing per decoder layer (HF ``gradient_checkpointing_enable``, non-reentrant): ``layer``,
    #: ``none`` (nothing recomputed), or ``auto``: on only when a step's rows need more than one micro-batch.
    gradient_checkpointing: Checkpointing | bool = "auto"

    def __post_init__(self) -> None:
        if isinstance(old := self.gradient_checkpointing, bool):  # before 0.2: true (layer) / false (auto)
            self.gradient_checkpointing = new = "layer" if old else "auto"
            msg = f"{str(old).lower()} (YAML's on/off too) is deprecated and means {new}; write auto, layer or none"
            warnings.warn(f"compute.gradient_checkpointing: {msg}", DeprecationWarning, stacklevel=3)

    def pick_kernels(self, vocab: int, tokens: int, device: Any = None, free_bytes: int | None = None) -> Any:
        """The :class:`~composer_plugins.kernels.select.KernelPick` of ``kernels`` for steps of ``tokens`` tokens."""
        from composer_plugins.losses.distill import liger_available
        from composer_plugins.losses.functional import pick_kernels

        kw = {"device": device, "chunk_size": self.chunk_size, "free_bytes": free_bytes, "liger": liger_available()}
        return pick_kernels(self.kernels, vocab=vocab, tokens=tokens, **kw)

    def rows_per_micro_batch(self, seq_len: int) -> int:
        """Rows of one micro-batch for sequences of ``seq_len`` tokens."""
        if self.micro_batch_size is not None:
            return int(self.micro_batch_size)
        return max(1, int(self.micro_batch_tokens) // max(1, int(seq_len)))

    def validate(self, src: Config, key: str = "compute") -> None:
        """``micro_batch_tokens``, ``micro_batch_size`` and ``chunk_size`` (when set) >= 1; ``kernels`` a known one."""
        optional = (f for f in ("micro_batch_size", "chunk_size") if getattr(self, f) is not None)
        positive(src, key, self, "micro_batch_tokens", *optional)
        from composer_plugins.losses import KERNEL_SETTINGS

        if self.kernels not in KERNEL_SETTINGS:
            raise src.error(f"{key}.kernels", f"unknown kernels {self.kernels!r}.", valid=KERNEL_SETTINGS)


@dataclass
class EvalSection(Section):
    """Held-out evaluation (torchmetrics): greedy accuracy, mean reward, pass@k."""

    num_problems: int = 400
    batch_size: int = 200
    k: int = 4
    num_samples: int = 4
    #: Sampling temperature of the ``num_samples`` completions (and ``hint_uplift_samples``); 0: greedy.
    temperature: float = 0.5
    max_new_tokens: int | None = None
    seed: int = 1234
    #: Evaluate the starting policy before RL (the "SFT start" figure).
    at_start: bool = True
    at_end: bool = True
    #: Write per-problem predictions JSONL next to the metrics.
    predictions: bool = False
    #: Also measure whether hints fix greedy failures: ``<env>/hint_fix_rate`` (of the failures that got a
    #: ``hints.provider`` hint, the fraction the same policy then solves greedily with the hint in context),
    #: ``<env>/hint_coverage`` (the fraction of failures that got one) and the counts ``hint_failures``,
    #: ``hint_hinted``, ``hint_fixed``.
    hint_uplift: bool = False
    #: Samples per failed problem (at ``temperature``) that form its rollout group, for providers that read
    #: groups (``demonstration``: a successful sample is the sibling shown).
    hint_uplift_samples: int = 8
    #: Held-out learning curve during RL: greedy accuracy on the first ``curve_problems`` held-out problems
    #: every this many optimizer steps (0: off); history.csv column ``train/heldout/accuracy`` (lightning/curves.py).
    every_n_steps: int = 0
    curve_problems: int = 100
    #: Denser early: also every ``curve_early_every`` steps up to step ``curve_early_until`` (0, 0: off).
    curve_early_every: int = 0
    curve_early_until: int = 0

    def validate(self, src: Config, key: str = "eval") -> None:
        """Sizes >= 1, a temperature >= 0 (0: greedy) and ``k <= num_samples`` for pass@k."""
        positive(src, key, self, "batch_size", "hint_uplift_samples")
        if not self.temperature >= 0:  # NaN included
            raise src.error(f"{key}.temperature", f"must be >= 0 (0: greedy samples), got {self.temperature}.")
        if self.k > self.num_samples:
            raise src.error(f"{key}.k", f"pass@{self.k} needs eval.num_samples >= {self.k}.")


@dataclass
class MLflowSection(Section):
    """MLflow tracking through Lightning's ``MLFlowLogger`` (``sqlite:///`` store by default)."""

    enabled: bool = False
    tracking_uri: str | None = None
    experiment: str | None = None
    run_name: str | None = None
    tags: dict[str, Any] = field(default_factory=dict)
    log_checkpoints: bool = True
