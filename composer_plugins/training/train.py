"""Training entry points: typed config, policy resolution, the Lightning ``Trainer`` and the runs.

* :class:`TrainConfig` (+ sections) is the schema of ``composer-plugins train|sft|eval --config``;
  :func:`load_train_config` reads YAML with dotted overrides and raises located
  :class:`~composer_plugins.core.errors.ConfigError` naming the key, file:line and valid keys.
* :func:`resolve_policy` turns ``model.name_or_path`` into a directory or hub id: ``tiny``
  builds the embedded default (tokenizer + model, cached by config hash), and ``sft.enabled``
  adds a cached SFT warm start on the env's worked solutions.
* :func:`build_trainer` is the single place a Lightning ``Trainer`` is made (callbacks,
  MLflow logger, checkpointing); wrappers (e.g. DiLoCo) inject ``extra_callbacks``/``strategy``.
* :func:`run_sft`, :func:`run_train`, :func:`run_eval` are what the CLI commands call.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from lightning.pytorch.callbacks import Callback

from composer_plugins.core.config import Config, from_dict, load_config, loads_config, redact, to_dict
from composer_plugins.core.errors import ConfigError
from composer_plugins.core.io import read_jsonl
from composer_plugins.models.tiny import TinyModelConfig, build_cached, cache_dir_for, load_policy, tiny_model_dir

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _set_threads(cfg: TrainConfig) -> None:
    if cfg.trainer.num_threads:
        import torch

        torch.set_num_threads(cfg.trainer.num_threads)


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    import logging
    import warnings

    import transformers

    names = (
        "lightning.pytorch.utilities.rank_zero",
        "lightning.pytorch.accelerators.cuda",
        "lightning.fabric",
        "lightning.pytorch.trainer.connectors.signal_connector",
    )
    transformers.utils.logging.disable_progress_bar()
    old = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*but have no `val_dataloader`.*")
        warnings.filterwarnings("ignore", message=".*Checkpoint directory .* exists and is not empty.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        warnings.filterwarnings("ignore", message=".*`isinstance\\(treespec, LeafSpec\\)`.*")
        try:
            yield
        finally:
            for n, lvl in old.items():
                logging.getLogger(n).setLevel(lvl)


# ---------------------------------------------------------------------------------------
# config schema
# ---------------------------------------------------------------------------------------


@dataclass
class ModelSection:
    """Policy to train: a hub id, a local ``save_pretrained`` directory, or ``tiny`` (embedded default)."""

    name_or_path: str = "tiny"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
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
    """The whole ``train`` config. ``losses`` maps channel keys to ``{enabled, weight, name, **kwargs}``."""

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


CHANNEL_KEYS = ("enabled", "weight", "name")
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
    _check_ranges(cfg, src, pre)
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
    if isinstance(strat, str) and "." not in strat and strat.strip().lower() not in strategy_names():
        raise _unknown_strategy(strat, src, pre + "trainer.strategy")
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
        channel_spec(name, spec, src, pre)
    from composer_plugins.core.config import check_component_name
    from composer_plugins.training.callbacks import check_callback_names
    from composer_plugins.training.optim import check_optimizer_name

    check_optimizer_name(cfg.optim.name, src, pre + "optim.name")
    check_component_name("hints", cfg.hints.provider, pre + "hints.provider", src)
    check_callback_names(cfg.trainer.callbacks, src, pre + "trainer.callbacks")


def _check_ranges(cfg: TrainConfig, src: Config, pre: str) -> None:
    """Numbers a run cannot use, refused at load with ``file:line: key: problem — fix``."""

    def need(key: str, ok: bool, value: Any, problem: str, fix: str) -> None:
        if not ok:
            raise src.error(pre + key, f"{problem}, got {value!r} — {fix}.")

    for key, value, default in (("optim.lr", cfg.optim.lr, 2e-5), ("sft.lr", cfg.sft.lr, 3e-3)):
        need(key, value > 0, value, "a learning rate must be > 0", f"use a small positive number such as {default:g}")
    kinds = cfg.sft.hint_kinds
    if kinds is not None:
        need("sft.hint_kinds", isinstance(kinds, Mapping) and bool(kinds), kinds, "must map hint kinds to shares",
             "e.g. {feedback: 0.5, demonstration: 0.5}")  # fmt: skip
        for k, v in kinds.items():
            if k not in SFT_HINT_KINDS:
                raise src.error(pre + f"sft.hint_kinds.{k}", "unknown hint kind.", valid=SFT_HINT_KINDS)
            need(f"sft.hint_kinds.{k}", isinstance(v, int | float) and v >= 0, v, "a share must be a number >= 0",
                 "use e.g. 0.5")  # fmt: skip
        need("sft.hint_kinds", sum(kinds.values()) > 0, kinds, "the shares sum to 0", "give one share > 0")
    for key, value in (("sft.batch_size", cfg.sft.batch_size), ("sft.num_examples", cfg.sft.num_examples),
                       ("sft.max_length", cfg.sft.max_length)):  # fmt: skip
        need(key, value >= 1, value, "must be >= 1", "use a positive integer")
    need("sft.steps", cfg.sft.steps >= 0, cfg.sft.steps, "must be >= 0",
         "use a number of optimizer steps, or sft.enabled: false to skip the warm start")  # fmt: skip
    need("sft.warmup_steps", cfg.sft.warmup_steps >= 0, cfg.sft.warmup_steps, "must be >= 0", "use 0 for no warmup")
    need("optim.warmup_steps", cfg.optim.warmup_steps >= 0, cfg.optim.warmup_steps, "must be >= 0",
         "use 0 for no warmup")  # fmt: skip
    t = cfg.trainer
    need("trainer.checkpoint_every_n_steps", t.checkpoint_every_n_steps >= 0, t.checkpoint_every_n_steps,
         "must be >= 0", "use 0 to write no checkpoints, or N to write one every N steps")  # fmt: skip
    need("trainer.keep_checkpoints", t.keep_checkpoints >= -1, t.keep_checkpoints, "must be >= -1",
         "use -1 to keep every checkpoint, or how many to keep")  # fmt: skip
    tiny = cfg.model.tiny
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "max_position_embeddings"):  # fmt: skip
        v = getattr(tiny, f)
        need(f"model.tiny.{f}", v >= 1, v, "must be >= 1", "use a positive integer")
    need("model.tiny.num_heads", tiny.hidden_size % tiny.num_heads == 0, tiny.num_heads,
         f"must divide model.tiny.hidden_size ({tiny.hidden_size})",
         f"use one of {[h for h in range(1, tiny.hidden_size + 1) if tiny.hidden_size % h == 0][:12]}")  # fmt: skip
    need("model.tiny.num_kv_heads", tiny.num_heads % tiny.num_kv_heads == 0, tiny.num_kv_heads,
         f"must divide model.tiny.num_heads ({tiny.num_heads})",
         f"use one of {[h for h in range(1, tiny.num_heads + 1) if tiny.num_heads % h == 0]}")  # fmt: skip


class ChannelSpec(NamedTuple):
    """One ``losses.<key>`` entry, parsed: whether it is on, its registry name, weight and other kwargs."""

    enabled: bool
    name: str
    weight: float
    kwargs: dict[str, Any]

    @property
    def active(self) -> bool:
        """Enabled and with a non-zero weight (what the study counts as a channel that is on)."""
        return self.enabled and self.weight != 0.0


def channel_spec(key: str, spec: Any, src: Config | None = None, pre: str = "") -> ChannelSpec:
    """Parse one ``losses.<key>`` entry (the one parser of channel specs: training, backends, pipeline).

    ``spec`` is ``true``/``false``/``null``, a number (the weight) or a mapping with ``enabled``,
    ``weight``, ``name`` (registry name, default ``key``) and the channel's own kwargs. Errors name
    ``<pre>losses.<key>[.field]`` in ``src``'s file and line.
    """
    src = src if src is not None else Config()
    where = f"{pre}losses.{key}"
    if spec is None or isinstance(spec, bool):
        return ChannelSpec(bool(spec), key, 1.0, {})
    if isinstance(spec, int | float):
        return ChannelSpec(True, key, float(spec), {})
    if not isinstance(spec, Mapping):
        raise src.error(where, f"expected a mapping like {{weight: 1.0}}, true/false or a weight; got {spec!r}.")
    spec = dict(spec)
    enabled = spec.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise src.error(f"{where}.enabled", f"expected true or false, got {enabled!r}.")
    weight = spec.pop("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise src.error(f"{where}.weight", f"expected a number, got {weight!r}.")
    name = str(spec.pop("name", key))
    return ChannelSpec(enabled, name, float(weight), spec)


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


# ---------------------------------------------------------------------------------------
# components
# ---------------------------------------------------------------------------------------


def build_env(cfg: TrainConfig, src: Config | None = None) -> Any:
    """The env named by ``cfg.env`` (registry kind ``envs``)."""
    from composer_plugins.core.config import build_component

    return build_component("envs", cfg.env, key="env", cfg=src)


def build_generator(cfg: TrainConfig, src: Config | None = None) -> Any:
    """The rollout generator named by ``rollout.generator`` (registry kind ``rollout_generators``)."""
    from composer_plugins.core.config import build_component

    spec = cfg.rollout.generator if cfg.rollout.generator is not None else "hf"
    return build_component("rollout_generators", spec, key="rollout.generator", cfg=src)


def build_hint_provider(cfg: TrainConfig, src: Config | None = None) -> Any:
    """The hint provider named by ``cfg.hints.provider`` (registry kind ``hints``)."""
    from composer_plugins.core.config import build_component

    if cfg.hints.provider is None:
        raise (src or Config()).error("hints.provider", "a hint-distillation channel is on but no provider is set.")
    return build_component("hints", cfg.hints.provider, key="hints.provider", cfg=src)


def build_channels(cfg: TrainConfig, src: Config | None = None) -> list[Any]:
    """The enabled loss channels of ``cfg.losses`` (disabled ones are not built at all)."""
    import inspect

    from composer_plugins.core.errors import UnknownPluginError
    from composer_plugins.core.plugins import get_registry

    src = src if src is not None else Config()
    reg = get_registry()
    out = []
    for key, spec in cfg.losses.items():
        enabled, name, weight, kw = channel_spec(key, spec, src)
        if not enabled:
            continue
        where = f"losses.{key}"
        if "class_path" in kw:
            from composer_plugins.core.config import build_component

            spec_cp = {"class_path": kw.pop("class_path"), "init_args": kw.pop("init_args", {})}
            if kw:
                raise src.error(
                    f"{where}.{sorted(kw)[0]}",
                    "unknown key next to class_path.",
                    valid=[*CHANNEL_KEYS, "class_path", "init_args"],
                )
            out.append(build_component("losses", spec_cp, key=where, cfg=src, weight=weight, name=key))
            continue
        try:
            entry = reg.get("losses", name)
        except UnknownPluginError as e:
            raise src.error(where if name == key else f"{where}.name", str(e)) from e
        try:
            sig = inspect.signature(entry.factory)
            params = sig.parameters
            accepts_var = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            params, accepts_var = {}, True  # type: ignore[assignment]
        if not accepts_var:
            valid = [p for p in params if p not in ("self", "args", "kwargs")]
            for k in kw:
                if k not in params:
                    raise src.error(
                        f"{where}.{k}", f"loss channel {name!r} has no parameter {k!r}.", valid=[*CHANNEL_KEYS, *valid]
                    )
        from composer_plugins.core.config import build_located

        out.append(build_located(entry, {**kw, "weight": weight, "name": key}, where, src))
    return out


# ---------------------------------------------------------------------------------------
# tasks
# ---------------------------------------------------------------------------------------


def env_tasks(env: Any, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` seeded tasks of ``split`` from the env's generator."""
    return [dict(t) for t in env.sample_tasks(n, split=split, seed=seed)]


def task_drawer(env: Any, cfg: TrainConfig, split: Literal["train", "test"]) -> Callable[[int, int], list[dict]]:
    """``draw(n, seed) -> tasks`` for ``split``: from ``data.<split>_path`` JSONL if set, else the env."""
    path = cfg.data.train_path if split == "train" else cfg.data.test_path
    name = cfg.data.train_split if split == "train" else cfg.data.test_split
    if path:
        pool = read_jsonl(path)
        if not pool:
            raise ConfigError(f"{path} holds no tasks", key=f"data.{split}_path")

        def draw_pool(n: int, seed: int) -> list[dict[str, Any]]:
            rng = random.Random(seed)
            return [dict(pool[rng.randrange(len(pool))]) for _ in range(n)]

        return draw_pool
    return lambda n, seed: env_tasks(env, name, n, seed)


def eval_batches(env: Any, cfg: TrainConfig) -> Any:
    """The fixed held-out problems as validation batches ``{"index", "tasks"}``."""
    path = cfg.data.test_path
    if path:
        tasks = read_jsonl(path)[: cfg.eval.num_problems]
    else:
        tasks = env_tasks(env, cfg.data.test_split, cfg.eval.num_problems, cfg.eval.seed)
    bs = cfg.eval.batch_size
    from composer_plugins.training.module import StaticBatches

    return StaticBatches([{"index": i, "tasks": tasks[s : s + bs]} for i, s in enumerate(range(0, len(tasks), bs))])


def sft_pairs(env: Any, cfg: TrainConfig) -> list[tuple[str, str]]:
    """``(prompt, solution)`` pairs for the SFT warm start from the env's train generator."""
    from composer_plugins.training.module import task_prompt

    if cfg.data.train_path:
        tasks = read_jsonl(cfg.data.train_path)[: cfg.sft.num_examples]
    else:
        tasks = env_tasks(env, cfg.data.train_split, cfg.sft.num_examples, derive_seed_sft(cfg))
    out = []
    for t in tasks:
        sol = t.get("target")
        if sol is None and t.get("solution") is not None:
            sol = " " + str(t["solution"]).lstrip()
        if sol is None:
            raise ConfigError(
                "the env's tasks carry no worked 'solution'; SFT needs one. HINT: set sft.enabled=false "
                "and start from an already fine-tuned model.name_or_path",
                key="sft.enabled",
            )
        out.append((task_prompt(t), str(sol)))
    if cfg.sft.hint_fraction > 0 and cfg.hints.provider is not None:
        out = _hint_augment(env, cfg, tasks, out)
    return out


def _wrong_attempt(task: Mapping[str, Any], rng: random.Random) -> str | None:
    """A plausible wrong final answer for a task with a numeric ``answer`` (``None`` otherwise)."""
    try:
        value = int(str(task.get("answer")))
    except (TypeError, ValueError):
        return None
    delta = rng.choice([d for d in range(-10, 11) if d != 0])
    return f"#### {value + delta}"


#: What a hinted SFT example can carry (``sft.hint_kinds``).
SFT_HINT_KINDS = ("feedback", "demonstration")


def _provider_name(spec: Any) -> str | None:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        return str(spec.get("name")) if spec.get("name") is not None else None
    return getattr(spec, "name", None)


def sft_hint_kinds(cfg: TrainConfig) -> dict[str, float]:
    """``sft.hint_kinds`` as shares summing to 1 (the default follows ``hints.provider``)."""
    kinds = cfg.sft.hint_kinds
    if kinds is None:
        kinds = {"demonstration": 1.0} if _provider_name(cfg.hints.provider) == "demonstration" else {"feedback": 1.0}
    total = float(sum(kinds.values()))
    return {k: float(v) / total for k, v in kinds.items() if v > 0}


def _hint_augment(env: Any, cfg: TrainConfig, tasks: Sequence[Mapping[str, Any]],
                  pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:  # fmt: skip
    """Replace ``sft.hint_fraction`` of the prompts by hinted teacher contexts for a wrong attempt.

    Each hinted example is of one kind (``sft.hint_kinds``): ``feedback``, the provider's hint for
    the wrong attempt; or ``demonstration``, the rollout group ``(wrong attempt, worked solution)``
    given to a provider that reads groups (``hints.provider`` if it does, else the default
    ``demonstration`` provider), so the context shows the problem's worked solution as a
    successful sibling. The target stays the worked solution.
    """
    from composer_plugins.envs.hints import sibling_groups, wants_groups
    from composer_plugins.training.module import derive_seed, teacher_contexts

    rng = random.Random(derive_seed(cfg.sft.seed, 91))
    picked = [i for i in range(len(pairs)) if rng.random() < cfg.sft.hint_fraction]
    attempts = {i: _wrong_attempt(tasks[i], rng) for i in picked}
    picked = [i for i in picked if attempts[i] is not None]
    if not picked:
        return pairs
    shares = sft_hint_kinds(cfg)
    names, weights = list(shares), list(shares.values())
    if len(names) == 1:
        kind = dict.fromkeys(picked, names[0])
    else:  # drawn from their own stream, so {feedback: 1} keeps today's examples exactly
        krng = random.Random(derive_seed(cfg.sft.seed, 92))
        kind = {i: krng.choices(names, weights)[0] for i in picked}
    provider = build_hint_provider(cfg)
    out = list(pairs)
    fb_rows = [i for i in picked if kind[i] == "feedback"]
    if fb_rows:
        ctxs = teacher_contexts(env, provider, [tasks[i] for i in fb_rows], [str(attempts[i]) for i in fb_rows])
        for i, ctx in zip(fb_rows, ctxs, strict=True):
            if ctx is not None:
                out[i] = (ctx, pairs[i][1])
    demo_rows = [i for i in picked if kind[i] == "demonstration"]
    if demo_rows:
        from composer_plugins.core.config import build_component

        demo = provider if wants_groups(provider) else build_component("hints", "demonstration", key="sft.hint_kinds")
        groups = []
        for i in demo_rows:  # the wrong attempt fails, the worked solution succeeds
            groups += sibling_groups([str(attempts[i]), pairs[i][1]], [0.0, 1.0], 2, 1.0)[:1]
        ctxs = teacher_contexts(env, demo, [tasks[i] for i in demo_rows], [str(attempts[i]) for i in demo_rows],
                                groups=groups)  # fmt: skip
        for i, ctx in zip(demo_rows, ctxs, strict=True):
            if ctx is not None:
                out[i] = (ctx, pairs[i][1])
    return out


def derive_seed_sft(cfg: TrainConfig) -> int:
    from composer_plugins.training.module import derive_seed

    return derive_seed(cfg.sft.seed, 77)


# ---------------------------------------------------------------------------------------
# policy resolution (tiny default, SFT warm start cache)
# ---------------------------------------------------------------------------------------


def _tiny_corpus_key(cfg: TrainConfig) -> Any:
    return {"env": redact(cfg.env), "train_path": _file_digest(cfg.data.train_path)}


def _file_digest(path: str | None) -> str | None:
    """``path@sha256`` of a data file, so a cache keyed on it notices new contents."""
    if not path:
        return None
    import hashlib

    try:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return str(path)
    return f"{path}@{digest}"


def base_policy_path(cfg: TrainConfig, env: Any = None) -> str:
    """``model.name_or_path``, or the cached directory of the embedded tiny model when it is ``tiny``."""
    if cfg.model.name_or_path != "tiny":
        return cfg.model.name_or_path
    env = env if env is not None else build_env(cfg)
    tcfg = cfg.model.tiny

    def corpus() -> Iterator[str]:
        from composer_plugins.training.module import task_prompt

        if cfg.data.train_path:
            tasks = read_jsonl(cfg.data.train_path)[: tcfg.tokenizer_corpus_size]
        else:
            tasks = env_tasks(env, cfg.data.train_split, tcfg.tokenizer_corpus_size, 1)
        for t in tasks:
            yield task_prompt(t) + str(t.get("target", t.get("solution", "")))

    return str(tiny_model_dir(tcfg, corpus, cfg.cache_dir, corpus_key=_tiny_corpus_key(cfg)))


def sft_cache_key(cfg: TrainConfig, base: str) -> dict[str, Any]:
    """What determines an SFT checkpoint: the base policy, the data and the SFT settings."""
    sft = asdict(cfg.sft)
    sft.pop("cache")
    sft.pop("progress")
    if sft.get("hint_kinds") is None:
        sft.pop("hint_kinds")  # the default: configs from before the option keep their cached warm start
    return {
        "base": base,
        "tiny": asdict(cfg.model.tiny) if cfg.model.name_or_path == "tiny" else None,
        "env": redact(cfg.env),
        "data": _file_digest(cfg.data.train_path),
        "sft": sft,
        "dtype": cfg.model.dtype,
        # hinted SFT examples are built with the hint provider: a new template is a new warm start
        "hints": redact(to_dict(cfg.hints.provider)) if cfg.sft.hint_fraction > 0 else None,
    }


def resolve_policy(cfg: TrainConfig, env: Any = None) -> str:
    """The path/id the RL policy is loaded from: base policy, plus the cached SFT warm start if enabled."""
    env = env if env is not None else build_env(cfg)
    base = base_policy_path(cfg, env)
    if not cfg.sft.enabled:
        return base
    key = sft_cache_key(cfg, base)
    if not cfg.sft.cache:
        out = Path(cfg.output_dir) / "sft"
        sft_train(cfg, base, env, out)
        return str(out)
    target = cache_dir_for(cfg.cache_dir, "sft", key)
    build_cached(target, lambda tmp: sft_train(cfg, base, env, tmp), meta=key)
    return str(target)


def load_policy_for(cfg: TrainConfig, env: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the resolved policy, loaded with ``from_pretrained``."""
    return load_policy(resolve_policy(cfg, env), dtype=cfg.model.dtype)


@_quiet_lightning()
def sft_train(
    cfg: TrainConfig, base: str, env: Any, out_dir: str | os.PathLike[str], extra_callbacks: Sequence[Any] = ()
) -> dict[str, float]:
    """Supervised warm start of ``base`` on the env's solutions; ``save_pretrained`` to ``out_dir``."""
    import lightning as L
    import torch

    from composer_plugins.training.module import SFTModule, sft_collate

    _set_threads(cfg)
    model, tok = load_policy(base, dtype=cfg.model.dtype)
    pairs = sft_pairs(env, cfg)
    s = cfg.sft
    gen = torch.Generator().manual_seed(s.seed)
    loader = torch.utils.data.DataLoader(
        pairs,
        batch_size=s.batch_size,
        shuffle=True,
        generator=gen,
        collate_fn=lambda b: sft_collate(tok, b, s.max_length),
        drop_last=True,
    )
    module = SFTModule(
        model, tok, lr=s.lr, weight_decay=s.weight_decay, warmup_steps=s.warmup_steps, total_steps=s.steps
    )
    L.seed_everything(s.seed, verbose=False)
    history: list[dict[str, float]] = []

    class _Losses(Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            loss = trainer.callback_metrics.get("sft/loss")
            if loss is not None:
                history.append({"step": int(trainer.global_step), "sft/loss": float(loss)})

    bar = _progress_bar("sft", s.progress)
    trainer = lightning_trainer(
        max_steps=s.steps,
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        precision=cfg.trainer.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=bar is not None,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        callbacks=[_Losses(), *extra_callbacks, *([bar] if bar else [])],
        num_sanity_val_steps=0,
    )
    with _quiet_lightning():
        trainer.fit(module, train_dataloaders=loader)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    final = {k: float(v) for k, v in trainer.callback_metrics.items() if hasattr(v, "item")}
    (out / "sft_metrics.json").write_text(json.dumps(final, indent=2))
    (out / "sft_history.json").write_text(json.dumps(history))
    return final


# ---------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------


def _progress_bar(phase: str, configured: bool) -> Any:
    """The one progress bar (:mod:`composer_plugins.training.progress`), or ``None`` when it is off.

    Off when the config says so or the ``--no-progress`` switch (``COMPOSER_PROGRESS=0``) is set; then
    transformers' and the Hub's own bars are silenced too.
    """
    from composer_plugins.core import progress

    if not progress.enabled(configured):
        if not progress.enabled():
            progress.silence()
        return None
    from composer_plugins.training.progress import StepProgressBar

    return StepProgressBar(phase)


def mlflow_settings(cfg: TrainConfig) -> dict[str, Any] | None:
    """``{tracking_uri, experiment, tags}`` when MLflow logging is on (``COMPOSER_MLFLOW=0`` turns it off)."""
    if os.environ.get("COMPOSER_MLFLOW", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    if not cfg.mlflow.enabled:
        return None
    from composer_plugins.training import tracking

    params = {"mlflow": {k: v for k, v in asdict(cfg.mlflow).items() if v is not None}}
    uri = tracking.tracking_uri(params)
    exp = tracking.experiment_name(params)
    tags = tracking.run_tags(seed=cfg.seed)
    tags.update(tracking.provenance_tags(config_components(cfg)))
    tags.update({str(k): str(v) for k, v in redact(cfg.mlflow.tags).items()})
    return {"tracking_uri": uri, "experiment": exp, "tags": tags}


def config_components(cfg: TrainConfig) -> dict[str, tuple[str, str]]:
    """``{slot: (kind, name)}`` of the env and the active loss channels (for provenance tags)."""
    out: dict[str, tuple[str, str]] = {}
    env = cfg.env
    if isinstance(env, Mapping):
        out["env"] = ("envs", str(env.get("name") or env.get("class_path") or "?"))
    elif isinstance(env, str):
        out["env"] = ("envs", env)
    for key, spec in cfg.losses.items():
        try:
            ch = channel_spec(key, spec)
        except ConfigError:
            continue
        if ch.active:
            out[f"losses.{key}"] = ("losses", str(ch.kwargs.get("class_path") or ch.name))
    return out


def channels_label(cfg: TrainConfig) -> str:
    """``grpo+hint_distill`` (active channel keys in config order) or ``none``."""
    on = []
    for key, spec in cfg.losses.items():
        try:
            if channel_spec(key, spec).active:
                on.append(key)
        except ConfigError:
            continue
    return "+".join(on) or "none"


def default_run_name(cfg: TrainConfig) -> str:
    """``train@<output_dir name>-s<seed> (<channels>)``: what a plain ``composer-plugins train`` run is."""
    return f"train@{Path(cfg.output_dir).name}-s{cfg.seed} ({channels_label(cfg)})"


def build_logger(cfg: TrainConfig) -> Any:
    """Lightning's ``MLFlowLogger`` for ``cfg.mlflow``, or ``False`` when MLflow is off."""
    s = mlflow_settings(cfg)
    if s is None:
        return False
    from lightning.pytorch.loggers import MLFlowLogger

    from composer_plugins.training import tracking

    return MLFlowLogger(
        experiment_name=s["experiment"],
        tracking_uri=s["tracking_uri"],
        run_name=tracking.run_name(default_run_name(cfg), given=cfg.mlflow.run_name),
        tags=s["tags"],
        log_model=cfg.mlflow.log_checkpoints,
        artifact_location=tracking.artifact_location(s["tracking_uri"]),
    )


#: Strategy names this config accepts besides Lightning's registered ones.
STRATEGY_SHORTHANDS: tuple[str, ...] = ("auto", "ddp", "fsdp")


def strategy_names() -> list[str]:
    """Every name ``trainer.strategy`` accepts (Lightning's registry + ``auto``/``ddp``/``fsdp``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return sorted({*STRATEGY_SHORTHANDS, *StrategyRegistry.available_strategies()})


def _unknown_strategy(name: str, src: Config, key: str) -> ConfigError:
    from composer_plugins.core.errors import closest

    valid = strategy_names()
    sugg = closest(name.strip().lower(), valid)
    hint = f" Did you mean: {', '.join(repr(x) for x in sugg)}?" if sugg else ""
    return src.error(key, f"unknown strategy {name!r}.{hint} Or give a class path (a.b.MyStrategy).", valid=valid)


def decoder_layer_classes(policy: Any) -> set[type]:
    """The policy's decoder-layer classes (HF ``_no_split_modules``), the units FSDP wraps one by one."""
    names = set(getattr(policy, "_no_split_modules", None) or ())
    found = {type(m) for m in policy.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(
            f"trainer.strategy=fsdp: cannot tell the decoder layers of {type(policy).__name__} "
            "(no _no_split_modules); pass {class_path: lightning.pytorch.strategies.FSDPStrategy, "
            "init_args: {auto_wrap_policy: ...}} instead"
        )
    return found


def build_strategy(cfg: TrainConfig, policy: Any = None, src: Config | None = None) -> Any:
    """The Lightning strategy named by ``trainer.strategy`` (``"auto"`` is passed through).

    ``ddp``: :class:`~lightning.pytorch.strategies.DDPStrategy` with ``trainer.dist_timeout_s``;
    ``fsdp``: :class:`~lightning.pytorch.strategies.FSDPStrategy` wrapping each decoder layer of
    ``policy`` (full state dicts in checkpoints, so a run resumes under the same strategy; on CPU the
    gloo backend); another registered name is handed to Lightning; a class path (or
    ``{class_path, init_args}``) is imported and built. Unknown names list the valid ones.
    """
    from datetime import timedelta

    src = src if src is not None else Config()
    spec = cfg.trainer.strategy
    timeout = timedelta(seconds=float(cfg.trainer.dist_timeout_s))
    if isinstance(spec, str) and "." not in spec:
        name = spec.strip().lower()
        valid = strategy_names()
        if name not in valid:
            raise _unknown_strategy(spec, src, "trainer.strategy")
        if name == "ddp":
            from lightning.pytorch.strategies import DDPStrategy

            return DDPStrategy(timeout=timeout)
        if name == "fsdp":
            return _fsdp_strategy(cfg, policy, timeout)
        return name
    if isinstance(spec, str):
        spec = {"class_path": spec}
    if isinstance(spec, Mapping) and "class_path" in spec:
        import importlib

        path = str(spec["class_path"])
        mod, _, attr = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise src.error("trainer.strategy", f"cannot import {path!r} ({e}).") from None
        return cls(**dict(spec.get("init_args") or {}))
    if isinstance(spec, Mapping):
        raise src.error("trainer.strategy", "a mapping needs class_path (and optionally init_args).")
    return spec  # an already built Strategy object


def _fsdp_strategy(cfg: TrainConfig, policy: Any, timeout: Any) -> Any:
    from lightning.pytorch.strategies import FSDPStrategy

    if policy is None:
        raise ValueError("trainer.strategy=fsdp needs the policy to find its decoder layers")
    from composer_plugins.training.ema import EMATeacher

    kw: dict[str, Any] = {
        # the EMA teacher (losses.hint_distill.teacher: ema) is a unit of its own, its layers nested units:
        # sharded as the policy is, shard for shard
        "auto_wrap_policy": decoder_layer_classes(policy) | {EMATeacher},
        "state_dict_type": "full",
        "timeout": timeout,
    }
    if cfg.trainer.accelerator == "cpu":
        # Lightning refuses the "fsdp" name without a GPU; torch's FSDP runs on CPU over gloo
        kw.update(process_group_backend="gloo")
        return _CPUFSDPStrategy(**kw)
    return FSDPStrategy(**kw)


def _cpu_fsdp_class() -> Any:
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        """FSDP over gloo on CPU ranks.

        Lightning checks for a GPU only on its own class, and hands FSDP ``device_id=None`` on CPU,
        which torch's FSDP refuses; this wraps with ``device_id=cpu`` and lets Lightning do the rest.
        """

        def _setup_model(self, model: Any) -> Any:
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel

            if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
                model = FullyShardedDataParallel(
                    module=model,
                    cpu_offload=self.cpu_offload,
                    mixed_precision=self.mixed_precision_config,
                    sharding_strategy=self.sharding_strategy,
                    device_id=torch.device("cpu"),
                    **self.kwargs,
                )
                self.kwargs.pop("auto_wrap_policy", None)
            return super()._setup_model(model)

        def _full_ctx(self) -> Any:
            # Lightning's full state dicts offload to CPU, which on CPU-resident parameters crashes
            # torch 2.13's FSDP clone of the gathered tensors (SIGSEGV); they are on the CPU already
            from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            return FSDP.state_dict_type(
                self.model,
                StateDictType.FULL_STATE_DICT,
                FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
            )

        def lightning_module_state_dict(self) -> dict[str, Any]:
            with self._full_ctx():
                return self.model.state_dict()

        def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import OptimStateKeyType

            with self._full_ctx():
                state = FSDP.optim_state_dict(self.model, optimizer)
                if self.global_rank == 0:
                    state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
                return state

    return CPUFSDPStrategy


def _CPUFSDPStrategy(**kw: Any) -> Any:  # builds the class lazily (lightning import)
    return _cpu_fsdp_class()(**kw)


def lightning_trainer(*, callbacks: Sequence[Any] = (), **kwargs: Any) -> Any:
    """The one place a ``lightning.Trainer`` is constructed (RL run, SFT, eval, the DiLoCo toy LM).

    Project defaults (no logger, no model summary, no sanity validation) under ``kwargs``, which may
    override any of them; :func:`build_trainer` is the RL run's use of it.
    """
    import lightning as L

    kw: dict[str, Any] = {"logger": False, "enable_model_summary": False, "num_sanity_val_steps": 0}
    kw.update(kwargs)
    return L.Trainer(callbacks=list(callbacks), **kw)


def build_trainer(
    cfg: TrainConfig,
    *,
    extra_callbacks: Sequence[Any] = (),
    strategy: Any = None,
    logger: Any = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> Any:
    """The Lightning ``Trainer`` of the RL phase: checkpoints, clipping, accumulation, progress bar, MLflow.

    Args:
        cfg: the training config.
        extra_callbacks: callbacks appended to the built-in ones (e.g. a DiLoCo outer-step callback).
        strategy: a Lightning strategy (default: ``trainer.strategy`` through :func:`build_strategy`).
        logger: a logger to use instead of the one built from ``cfg.mlflow`` (``False`` disables it).
        checkpoint_dir: where ``ModelCheckpoint`` writes (default ``<output_dir>/checkpoints``).
        overrides: any other ``lightning.Trainer`` keyword argument.

    Plugin callbacks named in ``trainer.callbacks`` (hook ``register_callbacks``) follow
    ``extra_callbacks``.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    t = cfg.trainer
    ckpt = (
        ModelCheckpoint(
            dirpath=str(checkpoint_dir or Path(cfg.output_dir) / "checkpoints"),
            filename="{step}",
            every_n_train_steps=t.checkpoint_every_n_steps,
            save_last=True,
            save_top_k=t.keep_checkpoints,
            monitor="step",
            mode="max",
            save_on_exception=False,
        )
        if t.checkpoint_every_n_steps > 0
        else None
    )
    callbacks: list[Any] = [c for c in (ckpt, HistoryCallback(Path(cfg.output_dir) / "history.csv")) if c]
    callbacks += list(extra_callbacks)
    if t.callbacks:
        from composer_plugins.training.callbacks import build_callbacks

        callbacks += build_callbacks(t.callbacks)
    bar = _progress_bar("train", t.enable_progress_bar)
    if bar is not None:
        callbacks.append(bar)
    val_every = t.val_every_n_steps
    kw: dict[str, Any] = {
        "max_steps": t.max_steps,
        "accelerator": t.accelerator,
        "devices": t.devices,
        "precision": t.precision,
        "accumulate_grad_batches": t.accumulate_grad_batches,
        "gradient_clip_val": t.gradient_clip_val,
        "gradient_clip_algorithm": t.gradient_clip_algorithm,
        "log_every_n_steps": t.log_every_n_steps,
        "enable_progress_bar": bar is not None,
        "enable_checkpointing": ckpt is not None,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "deterministic": t.deterministic,
        "logger": build_logger(cfg) if logger is None else logger,
        "callbacks": callbacks,
        "default_root_dir": cfg.output_dir,
        "val_check_interval": val_every * t.accumulate_grad_batches if val_every else None,
        "check_val_every_n_epoch": None if val_every else 1,
    }
    if strategy is None and cfg.trainer.strategy != "auto":
        strategy = build_strategy(cfg)
    if strategy is not None:
        kw["strategy"] = strategy
    if ckpt is not None:
        from composer_plugins.training.checkpoints import AtomicCheckpointIO

        kw["plugins"] = [AtomicCheckpointIO()]  # a kill while saving never leaves a half-written last.ckpt
    kw.update(overrides)
    return lightning_trainer(**kw)


class HistoryCallback(Callback):
    """Writes one CSV row per optimizer step (``step`` + the module's step statistics) to ``path``.

    Columns carry the same names as the MLflow metrics (``train/reward``, ``train/grpo/loss``,
    docs/metrics.md); ``step`` is the number of optimizer steps completed (1 for the first row),
    the step MLflow records the row's metrics at. On resume, rows of the interrupted run up to the
    restored step are kept.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.rows: list[dict[str, float]] = []
        self._keys: list[str] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.rows = []
        self._keys = []
        if trainer.ckpt_path and self.path.exists():
            with open(self.path) as f:
                for r in csv.DictReader(f):
                    if float(r["step"]) <= trainer.global_step:
                        row = {_history_key(k): float(v) for k, v in r.items() if v not in ("", None)}
                        row["step"] = int(row["step"])
                        self.rows.append(row)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        stats = getattr(pl_module, "last_step_stats", {}) or {}
        row: dict[str, float] = {"step": int(trainer.global_step)}
        row.update({f"train/{k}": float(v) for k, v in stats.items()})
        self.rows.append(row)
        if trainer.global_rank == 0:
            self.write(append=True)

    def write(self, append: bool = False) -> None:
        """Write the CSV (columns: union of every row's keys, ``step`` first); append when the columns are unchanged."""
        if append and self._keys and self.rows and set(self.rows[-1]) <= set(self._keys) and self.path.exists():
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self._keys).writerow(self.rows[-1])
            return
        keys: list[str] = ["step"]
        for r in self.rows:
            keys += [k for k in r if k not in keys]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        self._keys = keys


def _history_key(k: str) -> str:
    """An old unprefixed history column (``reward``, ``grpo/loss``) under its current name (``train/...``)."""
    return k if k == "step" or k.startswith(("train/", "sft/", "val/", "start/")) else f"train/{k}"


# ---------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """What :func:`run_train` returns: metrics, paths and the MLflow run id (if any)."""

    metrics: dict[str, float]
    output_dir: str
    model_dir: str
    run_id: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    start_metrics: dict[str, float] = field(default_factory=dict)
    #: False on the other ranks of a data-parallel run (only rank 0 reports: files, metrics, the CLI's output).
    is_global_zero: bool = True


@_quiet_lightning()
def run_sft(cfg: TrainConfig, src: Config | None = None) -> str:
    """Run (or reuse from cache) the SFT warm start; copy the policy to ``<output_dir>/model``."""
    import shutil

    from composer_plugins.training.inputs import check_inputs

    check_inputs(cfg, src or Config())  # files and paths first: no model is built for a run that cannot start
    env = build_env(cfg, src)
    path = resolve_policy(dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, enabled=True)), env)
    out = Path(cfg.output_dir) / "model"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("composer_meta.json", "sft_history.json"))
    metrics_file = Path(path) / "sft_metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    Path(cfg.output_dir, "metrics.json").write_text(json.dumps(metrics, indent=2))
    hist_file = Path(path) / "sft_history.json"
    history = json.loads(hist_file.read_text()) if hist_file.exists() else []
    log_sft_run(cfg, metrics, history)
    return str(out)


def log_sft_run(cfg: TrainConfig, metrics: Mapping[str, float], history: Sequence[Mapping[str, float]]) -> str | None:
    """One MLflow run for the SFT warm start (when ``mlflow`` is on): its config, final and per-step loss.

    Tagged like every pipeline stage (``dvc.stage`` from ``$DVC_STAGE``, git commit, seed); the run
    name is ``cfg.mlflow.run_name`` or ``sft-s<sft.seed>``. A cached warm start logs the history recorded when
    it was trained. Returns the run id.
    """
    settings = mlflow_settings(cfg)
    if settings is None:
        return None
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from composer_plugins.training import tracking

    client = MlflowClient(tracking_uri=settings["tracking_uri"])
    exp_id = tracking.ensure_experiment(client, settings["experiment"], settings["tracking_uri"])
    name = tracking.run_name(f"sft-s{cfg.sft.seed}", given=cfg.mlflow.run_name)
    tags = {**settings["tags"], "mlflow.runName": name}
    run = client.create_run(exp_id, tags=tags)
    conf = {"sft": asdict(cfg.sft), "model": asdict(cfg.model), "env": redact(cfg.env), "seed": cfg.seed}
    params = [Param(k, str(v)[:500]) for k, v in tracking.flatten(conf).items()]
    points = [Metric(k, float(v), 0, int(row.get("step", 0))) for row in history for k, v in row.items() if k != "step"]
    points += [Metric(k, float(v), 0, int(cfg.sft.steps)) for k, v in metrics.items()]
    for i in range(0, len(params), 100):  # MLflow's per-batch limits: 100 params, 1000 metrics
        client.log_batch(run.info.run_id, params=params[i : i + 100])
    for i in range(0, len(points), 1000):
        client.log_batch(run.info.run_id, metrics=points[i : i + 1000])
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def _val_metrics(trainer: Any) -> dict[str, float]:
    """``val/*`` metrics of the last validation (``val/accuracy``, ``val/mean_reward``, ``val/pass_at_<k>``)."""
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/") and hasattr(v, "item")}


@_quiet_lightning()
def run_train(
    cfg: TrainConfig,
    src: Config | None = None,
    *,
    resume: str | None = None,
    extra_callbacks: Sequence[Any] = (),
    strategy: Any = None,
    logger: Any = None,
    module: Any = None,
) -> RunResult:
    """RL from the resolved policy. ``resume="last"`` (or a ``.ckpt`` path) continues a run exactly.

    Writes ``<output_dir>/model`` (``save_pretrained``), ``history.csv``, ``metrics.json`` and
    ``checkpoints/``; logs params, per-channel metrics, reward, accuracy and checkpoints to MLflow.
    """
    import lightning as L

    from composer_plugins.training.checkpoints import resolve_resume
    from composer_plugins.training.inputs import check_inputs
    from composer_plugins.training.module import ComposerModule, TaskStream

    # checked before anything is built: a missing or broken input fails in a second, naming the file
    check_inputs(cfg, src or Config())
    ckpt_dir = Path(cfg.output_dir) / "checkpoints" if cfg.trainer.checkpoint_every_n_steps > 0 else None
    ckpt_path = resolve_resume(resume, ckpt_dir)
    _set_threads(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = build_env(cfg, src) if module is None else module.env
    if module is None:
        policy, tok = load_policy_for(cfg, env)
        L.seed_everything(cfg.seed, verbose=False)
        module = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src)
    else:
        L.seed_everything(cfg.seed, verbose=False)
    stream = TaskStream(
        task_drawer(env, cfg, "train"),
        cfg.rollout.prompts_per_step,
        cfg.trainer.max_steps * cfg.trainer.accumulate_grad_batches,
        seed=cfg.seed,
    )
    val = eval_batches(env, cfg)
    if strategy is None:
        strategy = build_strategy(cfg, module.policy, src)
    trainer = build_trainer(cfg, extra_callbacks=extra_callbacks, strategy=strategy, logger=logger)
    run_id = getattr(trainer.logger, "run_id", None) if trainer.logger else None
    start: dict[str, float] = {}
    with _quiet_lightning():
        if cfg.eval.at_start and ckpt_path is None and val:
            trainer.validate(module, dataloaders=val, verbose=False)
            start = {k.replace("val/", "start/"): v for k, v in _val_metrics(trainer).items()}
            if trainer.logger:
                trainer.logger.log_metrics(start, step=0)
        trainer.fit(
            module,
            train_dataloaders=stream,
            val_dataloaders=val if cfg.trainer.val_every_n_steps else None,
            ckpt_path=ckpt_path,
            weights_only=False,
        )
        final: dict[str, float] = {}
        if cfg.eval.at_end and val:
            trainer.validate(module, dataloaders=val, verbose=False)
            final = _val_metrics(trainer)
    # data parallel: every rank holds the same policy (FSDP: gathered here); rank 0 writes the files
    with module.full_params(recurse=True):
        model_dir = module.export_pretrained(out / "model") if trainer.is_global_zero else out / "model"
    hist_cb = next((c for c in trainer.callbacks if isinstance(c, HistoryCallback)), None)
    history = list(hist_cb.rows) if hist_cb else []
    metrics: dict[str, float] = {**start, **final}
    if history:
        last = history[-1]
        metrics.update({k: v for k, v in last.items() if k != "step"})
        # train/reward is the last step's; this is the mean over every step of the run
        metrics["train/reward_mean_over_steps"] = sum(r.get("train/reward", 0.0) for r in history) / len(history)
    if trainer.logger:
        _log_artifacts(trainer.logger, [model_dir, out / "history.csv"])
    if trainer.is_global_zero:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if run_id:
        (out / "mlflow_run.txt").write_text(str(run_id) + "\n")
    return RunResult(
        metrics=metrics,
        output_dir=str(out),
        model_dir=str(model_dir),
        run_id=run_id,
        history=history,
        start_metrics=start,
        is_global_zero=trainer.is_global_zero,
    )


def _log_artifacts(logger: Any, paths: Sequence[Path | str]) -> None:
    exp = logger.experiment
    for p in paths:
        p = Path(p)
        if p.is_dir():
            exp.log_artifacts(logger.run_id, str(p), artifact_path=p.name)
        elif p.exists():
            exp.log_artifact(logger.run_id, str(p))


@_quiet_lightning()
def run_eval(
    cfg: TrainConfig, src: Config | None = None, *, checkpoint: str | None = None, output: str | None = None
) -> dict[str, float]:
    """Held-out evaluation of ``checkpoint`` (a Lightning ``.ckpt`` or a ``save_pretrained`` dir / hub id).

    Without ``checkpoint`` the resolved policy of ``cfg`` is evaluated (e.g. the SFT start).
    Returns (and writes to ``output`` if given) flat ``{"<env>/accuracy", "<env>/pass_at_<k>", "<env>/mean_reward"}``,
    with ``eval.hint_uplift`` also ``<env>/hint_fix_rate``, ``<env>/hint_coverage`` and the ``<env>/hint_*`` counts.
    """
    import lightning as L
    import torch

    from composer_plugins.training.inputs import check_inputs
    from composer_plugins.training.module import ComposerModule

    if checkpoint is None:
        check_inputs(cfg, src or Config())
    _set_threads(cfg)
    env = build_env(cfg, src)
    ckpt_file: str | None = None
    if checkpoint and str(checkpoint).endswith(".ckpt"):
        ckpt_file = checkpoint
        path = resolve_policy(cfg, env)
    else:
        path = checkpoint or resolve_policy(cfg, env)
    policy, tok = load_policy(path, dtype=cfg.model.dtype)
    module = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, channels=[], src=src)
    if ckpt_file:
        state = torch.load(ckpt_file, map_location="cpu", weights_only=False)["state_dict"]
        module.load_state_dict(state, strict=False)
    L.seed_everything(cfg.seed, verbose=False)
    bar = _progress_bar("eval", cfg.trainer.enable_progress_bar)
    trainer = lightning_trainer(
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=bar is not None,
        enable_model_summary=False,
        callbacks=[bar] if bar else [],
    )
    if cfg.eval.predictions:
        module.predictions = []
    trainer.validate(module, dataloaders=eval_batches(env, cfg), verbose=False)
    env_name = _env_name(cfg)
    metrics = {f"{env_name}/{k[4:]}": v for k, v in _val_metrics(trainer).items()}
    if output:
        out = Path(output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(metrics, indent=2))
        if module.predictions is not None:
            with open(out.with_suffix(".predictions.jsonl"), "w") as f:
                for row in module.predictions:
                    f.write(json.dumps(row) + "\n")
    return metrics


def _env_name(cfg: TrainConfig) -> str:
    e = cfg.env
    if isinstance(e, str):
        return e
    if isinstance(e, Mapping):
        return str(e.get("name") or str(e.get("class_path", "env")).rsplit(".", 1)[-1])
    return "env"
