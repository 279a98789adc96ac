"""The one place a config becomes everything a step needs, read top to bottom in :meth:`StepComponents.from_config`:

1. the env (registry kind ``envs``, :func:`build_env`);
2. the policy and its tokenizer (``from_pretrained``, :func:`~.policy.load_policy_for`);
3. the loss channels, each built from its parsed spec (``TrainConfig.channels``) through
   :func:`~composer_plugins.core.config.build_component` with its advantage estimator (:func:`build_channels`),
   and their :class:`~composer_plugins.losses.base.ChannelComposer`;
4. the models the live channels read: the EMA teacher, the frozen reference, the teachers' scorers;
5. the hint provider (:func:`configured_hint_provider`) and the preference pairs;
6. the one sampler (:meth:`~.experience.Sampler.from_config`) and the experience maker.

The Lightning module holds the result; the backends' local modes, Monarch's trainer actor and the TRL backend
build theirs here too. A loop without a Trainer steps through :meth:`StepComponents.optimize`, which counts the
steps it took. The run around a step (optimizer, strategy, logger, ``Trainer``) is wired by
:func:`~composer_plugins.training.lightning.trainer.build_trainer`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from composer_plugins.core.config import Config, build_component
from composer_plugins.envs.hints import as_hint_provider, build_hint_provider
from composer_plugins.losses.base import ChannelComposer
from composer_plugins.training.config.loss_specs import CHANNEL_KEYS, advantage_estimator
from composer_plugins.training.rollout.rewards import load_pairs, render_pairs
from composer_plugins.training.step.assemble import PAIR_INPUTS, StepPolicy, _channel_inputs
from composer_plugins.training.step.ema import EMATeacher, compute_dtype, ema_pairs, ema_update, teacher_from
from composer_plugins.training.step.experience import ExperienceMaker, Sampler, StepComputer
from composer_plugins.training.step.input_builders import PAIR_REF_KEYS, cache_pair_references
from composer_plugins.training.step.optim import build_optimization, optimizer_step
from composer_plugins.training.step.record import StepMeta, StepRecord, sample_pairs
from composer_plugins.training.step.teacher_scores import build_teacher_scoring

__all__ = ["StepComponents", "build_channels", "build_env", "configured_hint_provider"]

Gather = Callable[[], AbstractContextManager[Any]]


def build_env(cfg: Any, src: Config | None = None) -> Any:
    """The env named by ``cfg.env`` (registry kind ``envs``)."""
    return build_component("envs", cfg.env, key="env", cfg=src)


def configured_hint_provider(cfg: Any, src: Config | None = None) -> Any:
    """The hint provider named by ``cfg.hints.provider`` (registry kind ``hints``), on the request contract
    (:func:`composer_plugins.envs.hints.build_hint_provider` builds one from a spec or an object)."""
    if cfg.hints.provider is None:
        raise (src or Config()).error("hints.provider", "a hint-distillation channel is on but no provider is set.")
    return as_hint_provider(build_component("hints", cfg.hints.provider, key="hints.provider", cfg=src))


def build_channels(cfg: Any, src: Config | None = None) -> list[Any]:
    """The enabled loss channels of ``cfg.channels`` (disabled ones are not built at all), each named by its key
    and carrying its ``losses.<key>.advantage`` estimator as ``advantage_estimator`` (read by ``ChannelComposer``)."""
    src = src if src is not None else Config()
    out = []
    for spec in cfg.channels:
        if not spec.enabled:
            continue
        where = f"losses.{spec.key}"
        built = {"weight": spec.weight, "name": spec.key, "spec_keys": CHANNEL_KEYS}
        ch = build_component("losses", spec.component(), key=where, cfg=src, **built)
        if spec.advantage is not None:
            if "advantages" not in _channel_inputs(ch):
                raise src.error(f"{where}.advantage", "this channel reads no advantages; remove its estimator.")
            ch.advantage_estimator = advantage_estimator(spec.advantage, f"{where}.advantage", src)
        out.append(ch)
    return out


@dataclass(eq=False)
class StepComponents:
    """What one step is made of (see the module docstring); build it with :meth:`from_config`.

    ``chunk_size``: LM-head rows per chunk of the step's inputs (the Lightning module sets the kernel pick's);
    ``steps``: optimizer steps taken through :meth:`optimize`; ``last_meta``: the meta of the last :meth:`loss_on`.
    """

    cfg: Any
    policy: Any
    tokenizer: Any
    env: Any
    composer: Any
    sampler: Sampler
    experience: ExperienceMaker
    hint_provider: Any = None
    teacher_scoring: Any = None
    ema_teacher: Any = None
    reference: Any = None
    pairs: list[Mapping[str, Any]] = field(default_factory=list)
    pair_refs_due: bool = False
    chunk_size: int | None = None
    optimizer: Any = None
    scheduler: Any = None
    steps: int = 0
    last_meta: StepMeta | None = None

    def __post_init__(self) -> None:
        self.stepper = StepComputer(
            self.composer, self.step_policy, success_threshold=self.cfg.rollout.success_threshold
        )
        self._ema_pairs: Any = None

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        src: Any = None,
        *,
        policy: Any = None,
        tokenizer: Any = None,
        env: Any = None,
        channels: Sequence[Any] | None = None,
        hint_provider: Any = None,
        pairs: Sequence[Mapping[str, str]] | None = None,
        own_models: bool = True,
        **maker: Any,
    ) -> StepComponents:
        """The components ``cfg`` describes. ``policy``/``tokenizer``, ``env``, ``channels``, ``hint_provider``,
        ``pairs``: already built ones (by default built from ``cfg``: the policy with ``from_pretrained``, the rest
        from the registry). ``own_models=False``: a trainer that prepares the model-bound pieces itself (TRL: the
        policy's mode and checkpointing, the EMA and reference copies, the teacher scorers on its tokenizer).
        ``maker``: :class:`ExperienceMaker` settings to override (``advantage_kwargs=None``: the trainer's own)."""
        from composer_plugins.training.step.policy import apply_checkpointing, load_policy_for

        src = src if src is not None else Config()
        # 1-2. the env, the policy and its tokenizer (from_pretrained returns eval mode; the step trains)
        env = env if env is not None else build_env(cfg, src)
        if policy is None:
            policy, tokenizer = load_policy_for(cfg, env)
        if tokenizer is None:
            raise ValueError("pass tokenizer= together with policy=")
        if own_models:
            policy.train()
            apply_checkpointing(policy, cfg)
        # 3. the loss channels and their composer
        if not isinstance(channels, ChannelComposer):
            channels = ChannelComposer(list(channels) if channels is not None else build_channels(cfg, src))
        required = set(channels.required_inputs())
        # 4. the models the live channels read (the teachers' scorers come after the pairs, below)
        try:
            teacher, ema_rate = teacher_from(channels.active)
        except ValueError as e:
            raise src.error("losses", str(e)) from None
        ema = reference = scoring = None
        if own_models and teacher == "ema":  # in the step's compute dtype
            ema = EMATeacher(policy, ema_rate, dtype=compute_dtype(cfg.trainer.precision))
        if own_models and "ref_logprobs" in required:  # the KL's frozen reference (the pairs' need none)
            reference = copy.deepcopy(policy).eval()
            for p in reference.parameters():
                p.requires_grad_(False)
        # 5. the hint provider and the preference pairs
        if hint_provider is not None:
            hint_provider = build_hint_provider(hint_provider, key="hint_provider")
        elif channels.needs_teacher:
            hint_provider = configured_hint_provider(cfg, src)
        if required & set(PAIR_INPUTS) and pairs is None and cfg.replay.pairs_path:
            pairs = load_pairs(cfg.replay.pairs_path)
        rendered = render_pairs(pairs or [], tokenizer, cfg.model.chat_template)
        if own_models:  # the external teachers' scorers, on the policy's tokenizer
            scoring = build_teacher_scoring(channels.active, tokenizer)
        # 6. the sampler and the experience maker
        r, c = cfg.rollout, cfg.compute
        settings = {"advantage_kwargs": dict(r.advantage_kwargs), "temperature": r.temperature}
        settings.update(chunk_size=c.chunk_size, rows_per_micro_batch=c.rows_per_micro_batch)
        settings.update(success_threshold=r.success_threshold, max_hinted=cfg.hints.max_hinted_per_step)
        settings.update(chat_template=cfg.model.chat_template)
        hinting = hint_provider if channels.needs_teacher else None
        experience = ExperienceMaker(policy, tokenizer, env, hinting, reference, scoring, **(settings | maker))
        return cls(
            cfg=cfg,
            policy=policy,
            tokenizer=tokenizer,
            env=env,
            composer=channels,
            sampler=Sampler.from_config(cfg, src, env),
            experience=experience,
            hint_provider=hint_provider,
            teacher_scoring=scoring,
            ema_teacher=ema,
            reference=reference,
            pairs=rendered,
            pair_refs_due=bool(required & set(PAIR_REF_KEYS)) and bool(rendered),
            chunk_size=c.chunk_size,
        )

    @property
    def required_inputs(self) -> set[str]:
        """What the live channels read (:meth:`ChannelComposer.required_inputs`)."""
        return set(self.composer.required_inputs())

    @property
    def needs_pairs(self) -> bool:
        return bool(self.required_inputs & set(PAIR_INPUTS))

    def step_policy(self) -> StepPolicy:
        """The models and settings the assembler builds channel inputs with."""
        models = {"model": self.policy, "tokenizer": self.tokenizer, "teacher": self.ema_teacher}
        models.update(reference=self.reference, chunk_size=self.chunk_size, teacher_scoring=self.teacher_scoring)
        return StepPolicy.from_config(self.cfg, **models)

    def cache_pair_references(self, gather: Gather = nullcontext) -> None:
        """The replay pairs' reference sequence log-probs under the starting policy, kept with the pairs (once;
        ``gather``: the context that makes the whole parameters available, e.g. under FSDP)."""
        if self.pair_refs_due:
            with gather():
                self.pairs, self.pair_refs_due = cache_pair_references(self.step_policy(), self.pairs), False

    def step_meta(self, seed: int, step: int, gather: Gather = nullcontext) -> StepMeta:
        """The meta of optimizer step ``step``: the run length and ``seed``'s preference pairs."""
        self.cache_pair_references(gather)
        pairs = sample_pairs(self.pairs, self.cfg.replay.pairs_per_step, seed) if self.needs_pairs else []
        return StepMeta(step, self.cfg.trainer.max_steps, tuple(pairs))

    def loss_on(
        self, rec: StepRecord, seed: int, step: int | None = None, gather: Gather = nullcontext
    ) -> tuple[Tensor, dict[str, float]]:
        """The composed loss of the current policy on ``rec`` at optimizer step ``step`` (default: :attr:`steps`;
        ``seed`` picks the replay pairs)."""
        self.last_meta = self.step_meta(seed, self.steps if step is None else step, gather)
        return self.stepper.loss(rec, self.last_meta)

    def optimize(self, loss: Tensor) -> float:
        """The local optimizer step of a loop without a Trainer (backward, clip to ``trainer.gradient_clip_val``,
        step; the optimizer and its ``optim.scheduler`` schedule over ``trainer.max_steps`` built on first use, as
        the Lightning path's ``configure_optimizers``), the EMA teacher's update, one more step counted.
        Returns the gradient norm."""
        if self.optimizer is None:
            built = build_optimization(self.cfg.optim, self.policy.parameters(), self.cfg.trainer.max_steps)
            self.optimizer, self.scheduler = built["optimizer"], built["lr_scheduler"]["scheduler"]
        norm = optimizer_step(self.optimizer, self.policy.parameters(), loss, self.cfg.trainer.gradient_clip_val)
        self.scheduler.step()
        self.update_ema()
        self.steps += 1
        return norm

    def update_ema(self, root: Any = None, salt: int = 0) -> None:
        """``teacher ← (1 − rate)·teacher + rate·policy`` (nothing without an EMA teacher). ``root``: the module
        holding both copies as ``ema_teacher`` and ``policy`` (the Lightning module, or its FSDP root)."""
        if self.ema_teacher is None:
            return
        if self._ema_pairs is None:
            root = root if root is not None else nn.ModuleDict({"ema_teacher": self.ema_teacher, "policy": self.policy})
            self._ema_pairs = ema_pairs(root, "ema_teacher.policy", "policy")
        ema_update(self._ema_pairs, self.ema_teacher.rate, salt=salt)
