"""The training config: the schema of ``composer-plugins train|sft|eval --config``, its loading and validation.

:class:`TrainConfig` and its sections (one dataclass per top-level key, one comment per field) are what a
YAML file may say; :func:`load_train_config` / :func:`loads_train_config` read YAML with dotted
``key.sub=value`` overrides and ``$env`` secrets, fill the default component specs and validate, raising a
located :class:`~composer_plugins.core.errors.ConfigError` (file:line, key, valid keys, did-you-mean).
:mod:`composer_plugins.training.loss_specs` parses the ``losses`` section (:func:`channel_spec`, the list
form). The strategy names the validation needs live here too; the numeric ranges are
:mod:`composer_plugins.training.limits`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from composer_plugins.core.config import Config, from_dict, load_config, loads_config, redact, to_dict
from composer_plugins.core.errors import ConfigError
from composer_plugins.models.tiny import TinyModelConfig
from composer_plugins.training.limits import check_ranges
from composer_plugins.training.loss_specs import CHANNEL_KEYS as CHANNEL_KEYS  # re-exported: their old home
from composer_plugins.training.loss_specs import ChannelSpec as ChannelSpec
from composer_plugins.training.loss_specs import channel_spec, check_channel, losses_as_mapping


@dataclass
class ModelSection:
    """Policy to train: a hub id, a local ``save_pretrained`` directory, or ``tiny`` (embedded default)."""

    name_or_path: str = "tiny"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: How a prompt given as chat messages (``[{role, content}, ...]``) becomes the text the model reads:
    #: ``auto`` (the tokenizer's chat template, generation prompt added; plain text without one), ``none``
    #: (plain: a lone user message verbatim, else ``<|role|>`` headers) or the path of a Jinja chat-template
    #: file (installed on the loaded tokenizer, so the exported model carries it). Text prompts are never changed.
    chat_template: str = "auto"
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class DataSection:
    """Where tasks come from. By default the env's own seeded generator; JSONL files override it."""

    train_path: str | None = None
    test_path: str | None = None
    train_split: str = "train"
    test_split: str = "test"


@dataclass
class SFTSection:
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
    #: Fraction of examples whose prompt is a hinted teacher context (hint for a wrong attempt,
    #: from ``hints.provider``), so the policy learns to use hints before hint distillation.
    hint_fraction: float = 0.5
    #: What the hinted examples carry, as shares: ``feedback`` (the hint ``hints.provider`` gives for a
    #: wrong attempt) and ``demonstration`` (a worked solution of the same problem, shown as a successful
    #: sibling through the ``demonstration`` provider: the policy learns to use a solution in context).
    #: ``step_check`` (the worked solution with one false step, hinted by the ``step_check`` provider).
    #: ``null``: ``{demonstration: 1}`` when ``hints.provider`` is ``demonstration``, else ``{feedback: 1}``.
    hint_kinds: dict[str, float] | None = None
    #: Use the cache (``cache_dir``) for the SFT checkpoint.
    cache: bool = True
    #: Show a progress bar.
    progress: bool = True


@dataclass
class RolloutSection:
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
    #: Reward at or above which a completion counts as correct (accuracy; no hint below it).
    success_threshold: float = 1.0
    #: Extra keyword arguments of ``losses.functional.group_advantages``.
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


@dataclass
class HintsSection:
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


@dataclass
class ReplaySection:
    """Preference pairs (JSONL ``prompt``/``chosen``/``rejected``) for the replay DPO channel."""

    pairs_path: str | None = None
    pairs_per_step: int = 4
    max_completion_length: int = 128


@dataclass
class OptimSection:
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


@dataclass
class TrainerSection:
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


@dataclass
class ComputeSection:
    """How one training step holds memory: micro-batches of rows, chunks of the LM head.

    The rollout batch's forward/backward runs ``micro_batch_size`` rows at a time (activation
    checkpointing per micro-batch when there are several), and every log-prob, entropy and
    divergence is computed from the final hidden states through the LM head ``chunk_size`` rows
    at a time: no ``rows × tokens × vocab`` tensor is built. The composed loss is the same as the
    one-shot loss (it is computed once, over the whole batch, from the hidden states).
    """

    #: Rows per forward/backward micro-batch (``null``: as many as fit ``micro_batch_tokens``).
    micro_batch_size: int | None = None
    #: Token budget of one micro-batch, rows × (prompt + completion length), when ``micro_batch_size`` is null.
    micro_batch_tokens: int = 4096
    #: LM-head rows per chunk (``null``: about 16M logits per chunk, e.g. 96 rows at a 151,936 vocabulary).
    chunk_size: int | None = None
    #: Hugging Face gradient checkpointing inside each micro-batch (per decoder layer).
    gradient_checkpointing: bool = False

    def rows_per_micro_batch(self, seq_len: int) -> int:
        """Rows of one micro-batch for sequences of ``seq_len`` tokens."""
        if self.micro_batch_size is not None:
            return int(self.micro_batch_size)
        return max(1, int(self.micro_batch_tokens) // max(1, int(seq_len)))


@dataclass
class EvalSection:
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
    #: every this many optimizer steps (0: off); history.csv column ``train/heldout/accuracy`` (training/curves.py).
    every_n_steps: int = 0
    curve_problems: int = 100
    #: Denser early: also every ``curve_early_every`` steps up to step ``curve_early_until`` (0, 0: off).
    curve_early_every: int = 0
    curve_early_until: int = 0


@dataclass
class MLflowSection:
    """MLflow tracking through Lightning's ``MLFlowLogger`` (``sqlite:///`` store by default)."""

    enabled: bool = False
    tracking_uri: str | None = None
    experiment: str | None = None
    run_name: str | None = None
    tags: dict[str, Any] = field(default_factory=dict)
    log_checkpoints: bool = True


@dataclass
class TrainConfig:
    """The whole ``train`` config. ``losses`` maps channel keys to ``{enabled, weight, name, **kwargs}``.

    A file may give ``losses`` as a list of ``{name, weight, label, **kwargs}`` instead (docs/losses.md):
    each item's key is its ``label``, else its ``name`` (:func:`losses_mapping`).
    """

    seed: int = 0
    output_dir: str = "runs/default"
    cache_dir: str = ".composer_cache"
    model: ModelSection = field(default_factory=ModelSection)
    env: Any = field(default_factory=lambda: {"name": "gsm8k", "difficulty": "trivial"})
    data: DataSection = field(default_factory=DataSection)
    losses: dict[str, Any] = field(default_factory=lambda: {"grpo": {"weight": 1.0}, "hint_distill": {"weight": 1.0}})
    hints: HintsSection = field(default_factory=HintsSection)
    replay: ReplaySection = field(default_factory=ReplaySection)
    sft: SFTSection = field(default_factory=SFTSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    optim: OptimSection = field(default_factory=OptimSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    compute: ComputeSection = field(default_factory=ComputeSection)
    eval: EvalSection = field(default_factory=EvalSection)
    mlflow: MLflowSection = field(default_factory=MLflowSection)
    #: Free-form settings read by wrappers of the training loop (e.g. DiLoCo replicas).
    diloco: dict[str, Any] = field(default_factory=dict)


DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def train_config_from_dict(data: Mapping[str, Any], src: Config | None = None, key: str = "") -> TrainConfig:
    """Build a :class:`TrainConfig` from plain data, with located errors (see :func:`from_dict`)."""
    cfg = from_dict(TrainConfig, data, src, key)
    _check(cfg, src if src is not None else Config(), key)
    return cfg


def _check(cfg: TrainConfig, src: Config, key: str = "") -> None:
    pre = f"{key}." if key else ""
    positive = {
        "rollout.num_generations": cfg.rollout.num_generations,
        "rollout.prompts_per_step": cfg.rollout.prompts_per_step,
        "rollout.max_new_tokens": cfg.rollout.max_new_tokens,
        "rollout.num_iterations": cfg.rollout.num_iterations,
        "trainer.max_steps": cfg.trainer.max_steps,
        "trainer.accumulate_grad_batches": cfg.trainer.accumulate_grad_batches,
        "eval.batch_size": cfg.eval.batch_size,
        "eval.hint_uplift_samples": cfg.eval.hint_uplift_samples,
        "compute.micro_batch_tokens": cfg.compute.micro_batch_tokens,
    }
    for k in ("micro_batch_size", "chunk_size"):
        v = getattr(cfg.compute, k)
        if v is not None and v < 1:
            positive[f"compute.{k}"] = v
    for k, v in positive.items():
        if v < 1:
            raise src.error(pre + k, f"must be >= 1, got {v}.")
    if cfg.rollout.temperature <= 0:
        raise src.error(pre + "rollout.temperature", f"must be > 0, got {cfg.rollout.temperature}.")
    if not cfg.eval.temperature >= 0:  # NaN included
        raise src.error(pre + "eval.temperature", f"must be >= 0 (0: greedy samples), got {cfg.eval.temperature}.")
    check_ranges(cfg, src, pre)
    from composer_plugins.training.chat import check_chat_template

    check_chat_template(cfg.model.chat_template, src, pre + "model.chat_template")
    gen = cfg.rollout.generator
    gen_name = gen.get("name") if isinstance(gen, Mapping) else gen
    if cfg.rollout.max_turns > 1 and gen_name not in (None, "hf"):
        raise src.error(
            pre + "rollout.generator",
            f"multi-turn episodes (rollout.max_turns={cfg.rollout.max_turns}) are sampled in-process; "
            "set rollout.generator=hf or rollout.max_turns=1.",
        )
    is_modes = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "off")
    if cfg.rollout.importance_sampling not in is_modes:
        raise src.error(
            pre + "rollout.importance_sampling", f"unknown mode {cfg.rollout.importance_sampling!r}.", valid=is_modes
        )
    strat = cfg.trainer.strategy
    if (
        isinstance(strat, str)
        and "." not in strat
        and strat.strip().lower() not in STRATEGY_SHORTHANDS  # these are known without importing Lightning
        and strat.strip().lower() not in strategy_names()
    ):
        raise unknown_strategy(strat, src, pre + "trainer.strategy")
    devices = cfg.trainer.devices
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 1:
        if cfg.rollout.prompts_per_step % devices:
            k = cfg.rollout.prompts_per_step
            raise src.error(
                pre + "rollout.prompts_per_step",
                f"{k} prompts per step cannot be split over trainer.devices={devices} data-parallel ranks; "
                f"use a multiple of {devices} (each rank draws prompts_per_step / devices).",
            )
    if cfg.eval.k > cfg.eval.num_samples:
        raise src.error(pre + "eval.k", f"pass@{cfg.eval.k} needs eval.num_samples >= {cfg.eval.k}.")
    if not isinstance(cfg.losses, Mapping) or not cfg.losses:
        raise src.error(pre + "losses", "give at least one loss channel, e.g. {grpo: {weight: 1.0}}.")
    for name, spec in cfg.losses.items():
        ch = channel_spec(name, spec, src, pre)
        if ch.enabled:
            check_channel(name, ch, src, pre)
    from composer_plugins.core.config import check_component_name
    from composer_plugins.training.callbacks import check_callback_names
    from composer_plugins.training.optim import check_optimizer_name

    check_optimizer_name(cfg.optim.name, src, pre + "optim.name")
    check_component_name("hints", cfg.hints.provider, pre + "hints.provider", src)
    check_callback_names(cfg.trainer.callbacks, src, pre + "trainer.callbacks")


#: Free-form component fields whose defaults are whole specs: a file that omits one gets the default
#: spec, so an override such as ``losses.hint_distill.enabled=false`` edits it instead of replacing it.
COMPONENT_DEFAULTS: tuple[str, ...] = ("env", "losses", "hints.provider")


def _fill_component_defaults(src: Config) -> None:
    import copy

    defaults = to_dict(TrainConfig())
    for key in COMPONENT_DEFAULTS:
        node: Any = src
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.get(part) if isinstance(node, Mapping) else None
            if nxt is None:
                nxt = node[part] = {}
            node = nxt
        if isinstance(node, dict) and parts[-1] not in node:
            value: Any = defaults
            for part in parts:
                value = value[part]
            node[parts[-1]] = copy.deepcopy(value)


def _finish(src: Config, overrides: Sequence[str]) -> tuple[TrainConfig, Config]:
    from composer_plugins.core.config import apply_overrides, resolve_env

    losses_as_mapping(src)
    _fill_component_defaults(src)
    apply_overrides(src, overrides)
    resolve_env(src, src)
    return train_config_from_dict(src, src), src


def load_train_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (), section: str | None = None
) -> tuple[TrainConfig, Config]:
    """Read ``path`` (default: the packaged ``configs/default.yaml``), apply overrides, validate.

    ``section`` selects a sub-mapping of the file (e.g. ``train`` in a DVC ``params.yaml``);
    overrides are then relative to that section. Keys the file omits take the
    :class:`TrainConfig` defaults (component specs ``env``, ``losses``, ``hints.provider``
    included, so overrides edit the default spec).
    """
    p = Path(path) if path is not None else DEFAULT_CONFIG
    if section:
        full = load_config(p)
        node = full.get_path(section)
        if not isinstance(node, Mapping):
            raise full.error(section, f"section {section!r} not found or not a mapping.", valid=list(full))
        lines = {k[len(section) + 1 :]: v for k, v in full.lines.items() if k.startswith(section + ".")}
        src = Config(dict(node), str(p), lines)
    else:
        src = load_config(p)
    return _finish(src, overrides)


def loads_train_config(text: str, overrides: Sequence[str] = ()) -> tuple[TrainConfig, Config]:
    """Like :func:`load_train_config` for YAML text."""
    return _finish(loads_config(text), overrides)


def config_to_yaml(cfg: TrainConfig) -> str:
    """The effective config as YAML (secrets redacted), for ``--print-config``."""
    import yaml

    return yaml.safe_dump(redact(to_dict(cfg)), sort_keys=False)


#: Strategy names this config accepts besides Lightning's registered ones.
STRATEGY_SHORTHANDS: tuple[str, ...] = ("auto", "ddp", "fsdp")


def strategy_names() -> list[str]:
    """Every name ``trainer.strategy`` accepts (Lightning's registry + ``auto``/``ddp``/``fsdp``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return sorted({*STRATEGY_SHORTHANDS, *StrategyRegistry.available_strategies()})


def unknown_strategy(name: str, src: Config, key: str) -> ConfigError:
    from composer_plugins.core.errors import closest

    valid = strategy_names()
    sugg = closest(name.strip().lower(), valid)
    hint = f" Did you mean: {', '.join(repr(x) for x in sugg)}?" if sugg else ""
    return src.error(key, f"unknown strategy {name!r}.{hint} Or give a class path (a.b.MyStrategy).", valid=valid)
