"""The ``trl`` backend: ``trl.GRPOTrainer`` whose loss is the composed loss channels.

:class:`ComposerGRPOTrainer` keeps everything of TRL's ``GRPOTrainer`` up to the loss — dataset
and sampler, generation (transformers or vLLM), reward functions, group advantages, old/reference
log-probs, logging — and computes the loss in ``compute_loss`` (the ``Trainer``'s public hook) with
:class:`~composer_plugins.losses.base.ChannelComposer` over our channels. After TRL scores a generation
batch, the one experience maker (:class:`~composer_plugins.training.step.experience.ExperienceMaker`) makes its
read-only :class:`~composer_plugins.training.step.record.StepRecord` from TRL's own fields (advantages, old/reference
log-probs, the recorded rewards), adds the hinted contexts and starts teacher scoring; each micro-batch is the
record's rows (``select``, by a row index TRL shuffles and splits with the batch), and its loss is the one
step computer's (:class:`~composer_plugins.training.step.experience.StepComputer`), as in the native module:

* the policy channel reads TRL's per-token log-probs (computed by TRL's own fused-head path),
  ``old_per_token_logps``, ``ref_per_token_logps``, the advantages and TRL's token normaliser, so
  with only the policy channel live the loss equals TRL's own ``GRPOTrainer`` loss for every
  ``loss_type`` (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``, and ``gspo`` =
  ``importance_sampling_level="sequence"``);
* hint self-distillation: after TRL scores a generation batch, completions below
  ``hint_threshold`` get a hint from the hint provider; the same policy (or its EMA copy with
  ``hint_distill``'s ``teacher: ema``, updated by a ``TrainerCallback`` after each optimizer step),
  conditioned on the hinted prompt, scores the student's tokens without gradient, and the
  ``hint_distill`` channel distils it into the student on those tokens (from hidden states, the LM
  head in chunks, both sides at TRL's sampling temperature, as the native path);
* replay: ``pairs_per_step`` preference pairs per micro-batch are scored by the policy (with grad) for the
  ``replay_dpo`` / ``replay_simpo`` channels, against the pairs' reference log-probs under the starting policy,
  cached once when the trainer is built (no reference copy is kept for them, as in the native path).

The rewards the hints are chosen by are recorded by wrapping the reward functions (TRL's public
reward-function surface; with a reward model among them the record has no rewards, and hint channels are
refused). TRL offers no public hook that adds per-row fields to a generation batch, so one private method is
still overridden: ``_generate_and_score_completions`` (it makes the record and adds its row index);
``compute_loss`` reads TRL's per-token log-probs with the private
``_get_per_token_logps_and_entropies``. :func:`check_trl_surface` checks both signatures when the
trainer is built and fails with the fix when TRL changes them (docs/backends.md).

Gradient accumulation follows TRL: the composed loss is divided by the accumulation steps, and
``dapo``/``cispo`` get TRL's global token count (per micro-batch) as ``num_items_in_batch``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from trl import GRPOConfig, GRPOTrainer

from composer_plugins.backends.surface import (
    PAIR_INPUTS,
    PAIR_REF_KEYS,
    Backend,
    ChannelComposer,
    ConfigError,
    LossChannel,
    Rollout,
    StepMeta,
    StepRecord,
    cache_pair_references,
    refuse_own_sampling,
    sample_pairs,
)
from composer_plugins.backends.surface import functional as LF

#: TRL loss types the composed trainer reproduces: our policy loss types but ``gspo`` (TRL's ``grpo`` at
#: sequence level, ``importance_sampling_level="sequence"``).
SUPPORTED_LOSS_TYPES: tuple[str, ...] = tuple(t for t in LF.POLICY_LOSS_TYPES if t != "gspo")
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def policy_channel_from_args(args: GRPOConfig, weight: float = 1.0, name: str = "policy") -> LossChannel:
    """Our policy channel configured exactly like TRL's loss for ``args`` (loss type, clip range, β, IS level)."""
    from composer_plugins.backends.surface import build

    lt = args.loss_type
    if lt not in SUPPORTED_LOSS_TYPES:
        raise ConfigError(
            f"loss_type {lt!r} has no composer-plugins channel", key="loss_type", valid=list(SUPPORTED_LOSS_TYPES)
        )
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    return build(
        "losses",
        lt,
        weight=weight,
        name=name,
        epsilon_low=args.epsilon,
        epsilon_high=eps_high,
        importance_sampling_level=args.importance_sampling_level,
        beta=args.beta,
        use_bias_correction_kl=args.use_bias_correction_kl,
        max_completion_length=args.max_completion_length,
        delta=args.delta,
    )


class ComposerGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose loss is the sum of composer-plugins loss channels.

    Args:
        model, reward_funcs, args, ...: as ``trl.GRPOTrainer`` (every positional/keyword argument is passed on).
        channels: loss channels — built channels, registry specs (``"hint_distill"``,
            ``{"name": "replay_dpo", "weight": 0.1}``) or a :class:`ChannelComposer`. The spec
            ``"policy"`` (the default, alone) is :func:`policy_channel_from_args` (TRL's own loss).
        hint_provider: a hint provider (``hints(feedbacks, prompts, completions, tasks)`` or
            ``hint(feedback, prompt=, completion=, task=)``), such a callable, or a ``hints`` registry
            spec; required when a live channel needs a teacher.
        hint_env: the env whose ``feedback(prompt, completion, **task)`` the provider reads (optional).
        hint_threshold: completions whose total reward is below it get a hint.
        max_hinted_per_step: at most this many hinted completions per generation batch.
        max_hint_length: teacher-context tokens kept (from the right).
        hint_teacher_margin: log ``hint/teacher_margin`` (``hints.teacher_margin``; one more LM-head pass).
        pairs: preference pairs (``prompt``, ``chosen``, ``rejected``) or a JSONL path, for replay channels.
        pairs_per_step: pairs scored per micro-batch.
        pair_prompt_length: prompt tokens kept per pair (the native path's ``rollout.max_prompt_length``).
        pair_max_length: completion tokens kept per pair side.
        chat_template: how conversational prompts become text for the hinted teacher and the replay pairs
            (``model.chat_template``: ``auto``, ``none`` or a Jinja file;
            :mod:`composer_plugins.training.rollout.chat`);
            TRL renders the student's prompts itself with the tokenizer's template, which is the same text.
    """

    def __init__(
        self,
        *args: Any,
        channels: Sequence[Any] | ChannelComposer | None = None,
        hint_provider: Any = None,
        hint_env: Any = None,
        hint_threshold: float = 1.0,
        max_hinted_per_step: int | None = None,
        max_hint_length: int = 256,
        hint_teacher_margin: bool = False,
        pairs: Sequence[Mapping[str, str]] | str | None = None,
        pairs_per_step: int = 4,
        pair_prompt_length: int = 192,
        pair_max_length: int = 128,
        chat_template: str = "auto",
        **kwargs: Any,
    ) -> None:
        check_trl_surface()
        self._rewards = _RewardRecorder()
        if "reward_funcs" in kwargs:
            kwargs["reward_funcs"] = self._rewards.wrap_all(kwargs["reward_funcs"])
        elif len(args) > 1:
            args = (args[0], self._rewards.wrap_all(args[1]), *args[2:])
        super().__init__(*args, **kwargs)
        self._check_supported()
        self.composer = self._build_composer(channels).to(self.accelerator.device)
        live = self.composer.active
        for c in live:  # dr_grpo normalises by the *configured* completion length in TRL, not the batch's width
            if getattr(c, "loss_type", None) == "dr_grpo" and getattr(c, "max_completion_length", 0) is None:
                c.max_completion_length = self.args.max_completion_length
        self.needs_teacher = self.composer.needs_teacher
        self.needs_pairs = bool(set(PAIR_INPUTS) & set(self.composer.required_inputs()))
        if self.needs_teacher and hint_provider is None:
            raise ConfigError("a hint-distillation channel is live but no hint_provider was given", key="hint_provider")
        if self.needs_teacher and self._rewards.unrecorded:
            raise ConfigError(
                f"hint rows are chosen by the reward functions' rewards; {self._rewards.unrecorded} "
                "(a reward model) is not a callable whose rewards can be read — give callable reward "
                "functions with a hint-distillation channel",
                key="reward_funcs",
            )
        self.hint_threshold = float(hint_threshold)
        self.max_hint_length = int(max_hint_length)
        self.hint_teacher_margin = bool(hint_teacher_margin)
        self.chat_mode = str(chat_template)  # not `chat_template`: TRL keeps its Jinja override under that name
        from composer_plugins.backends.surface import load_pairs, render_pairs

        if isinstance(pairs, str):
            pairs = load_pairs(pairs)
        # the pairs' prompts as the policy reads them (chat templates applied)
        self.pairs: list[Mapping[str, str]] = render_pairs(pairs or [], self.processing_class, self.chat_mode)
        if self.needs_pairs and not self.pairs:
            raise ConfigError("a replay channel is live but no preference pairs were given", key="pairs")
        self.pairs_per_step = int(pairs_per_step)
        self.pair_prompt_length = int(pair_prompt_length)
        self.pair_max_length = int(pair_max_length)
        self._loss_calls = 0
        self.ema_teacher = self._build_ema_teacher(live)
        # teacher_distill: external teachers score each generation batch's completions (in the background,
        # while the assembler computes the student's hidden states); the record carries their futures
        from composer_plugins.backends.surface import (
            ExperienceMaker,
            StepComputer,
            build_teacher_scoring,
            teacher_channels,
        )

        self.teacher_scoring = build_teacher_scoring(teacher_channels(live), self.processing_class)
        #: The one experience maker (TRL computes the advantages and log-probs; the maker adds the rest).
        self.experience = ExperienceMaker(
            tokenizer=self.processing_class,
            env=hint_env,
            hint_provider=hint_provider if self.needs_teacher else None,
            teacher_scoring=self.teacher_scoring,
            temperature=self.temperature,
            success_threshold=self.hint_threshold,
            max_hinted=max_hinted_per_step,
            chat_template=self.chat_mode,
        )
        self.hint_provider = self.experience.hint_provider
        if set(PAIR_REF_KEYS) & set(self.composer.required_inputs()) and self.pairs:
            # the pairs' reference log-probs under the starting policy, cached once: no reference copy is kept
            policy = self.step_policy(self.accelerator.unwrap_model(self.model))
            self.pairs = cache_pair_references(policy, self.pairs)
        #: The one step computer (TRL gives its own token normaliser: no data-parallel normalisers here).
        self.stepper = StepComputer(self.composer, self.step_policy(self.model), data_parallel=False)
        #: The record of the last generation batch, per mode (an eval batch never replaces a buffered train one).
        self._records: dict[str, StepRecord] = {}

    def _build_ema_teacher(self, live: Sequence[Any]) -> Any:
        """The frozen EMA copy of the policy when a hint channel asks for ``teacher: ema`` (else ``None``), its
        weights in the compute dtype (``bf16``/``fp16``: half an fp32 copy), as the native path's."""
        from torch import nn
        from transformers import TrainerCallback

        from composer_plugins.backends.surface import EMATeacher, ema_pairs, ema_update, teacher_from

        try:
            teacher, rate = teacher_from(live)
        except ValueError as e:
            raise ConfigError(str(e), key="channels") from None
        if teacher != "ema" or not self.needs_teacher:
            return None
        policy = self.accelerator.unwrap_model(self.model)
        dtype = "bfloat16" if self.args.bf16 else "float16" if self.args.fp16 else None
        ema = EMATeacher(self._frozen_copy(policy), rate, copy_policy=False, dtype=dtype)
        holder = nn.ModuleDict({"ema": ema, "policy": policy})  # both copies, matched by parameter name
        pairs = ema_pairs(holder, "ema.policy", "policy")

        class _UpdateEMA(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                ema_update(pairs, rate, salt=state.global_step)  # once per optimizer step, after accumulation

        self.add_callback(_UpdateEMA())
        return ema

    # -- setup ---------------------------------------------------------------------------
    def _check_supported(self) -> None:
        a = self.args
        if a.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ConfigError(
                f"loss_type {a.loss_type!r} is not reproduced by the composed trainer",
                key="loss_type",
                valid=list(SUPPORTED_LOSS_TYPES),
            )
        unsupported = {
            "top_entropy_quantile": a.top_entropy_quantile < 1.0,
            "off_policy_mask_threshold": a.off_policy_mask_threshold is not None,
            "entropy_coef": bool(self._entropy_bonus_enabled),
            "router_aux_loss_coef": bool(self.aux_loss_enabled),
        }
        for key, bad in unsupported.items():
            if bad:
                raise ConfigError(
                    "is not supported by ComposerGRPOTrainer (the composed loss would silently drop it); "
                    "use the default for this option or add a loss channel that implements it",
                    key=key,
                )

    def _build_composer(self, channels: Sequence[Any] | ChannelComposer | None) -> ChannelComposer:
        if isinstance(channels, ChannelComposer):
            return channels
        specs = list(channels) if channels is not None else ["policy"]
        built: list[Any] = []
        for s in specs:
            if s == "policy":
                built.append(policy_channel_from_args(self.args))
            elif isinstance(s, Mapping) and s.get("name") == "policy":
                kw = {k: v for k, v in s.items() if k != "name"}
                built.append(policy_channel_from_args(self.args, **kw))
            else:
                built.append(s)
        return ChannelComposer.from_specs(built)

    @staticmethod
    def _frozen_copy(model: Any) -> Any:
        """An independent, frozen copy of ``model`` (weights copied; TRL's forward patch not shared)."""
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_config(model.config, dtype=next(model.parameters()).dtype)
        ref.load_state_dict(model.state_dict())
        ref.to(next(model.parameters()).device).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # -- generation batch: its read-only step record (the one private override) ----------------------------
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        self._rewards.outputs.clear()
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        self._records[mode] = self._make_record(inputs, out)
        # the row index of each row: TRL shuffles and splits it with the batch; compute_loss selects those rows
        out["record_rows"] = torch.arange(out["completion_ids"].shape[0], device=out["completion_ids"].device)
        return out

    def _make_record(self, inputs: list[dict[str, Any]], out: Mapping[str, Any]) -> StepRecord:
        """This process's rows of the generation batch as the experience maker's record (TRL's own fields)."""
        tok = self.processing_class
        p_ids, p_mask = out["prompt_ids"], out["prompt_mask"]
        ids, c_mask = out["completion_ids"], out["completion_mask"]
        mask = c_mask if "tool_mask" not in out else c_mask * out["tool_mask"]
        n = int(ids.shape[0])
        texts = tok.batch_decode(
            [r[m.bool()].tolist() for r, m in zip(ids, c_mask, strict=True)], skip_special_tokens=True
        )
        prompts = tok.batch_decode(
            [r[m.bool()].tolist() for r, m in zip(p_ids, p_mask, strict=True)], skip_special_tokens=True
        )
        # with a reward model among the reward functions the rewards cannot be read: the record has none
        rewards = None if self._rewards.unrecorded else self._rewards.total(n, self.reward_weights)
        # row i answers inputs[i] (TRL repeats each prompt G times in its dataset rows)
        ro = Rollout(p_ids, p_mask, ids, mask, texts, prompts, torch.arange(n, device=ids.device), self.num_generations)
        groups = None
        if self.needs_teacher and rewards is not None:
            groups = self._sibling_groups(texts, rewards) if self.experience.reads_groups else [None] * n
        return self.experience.make(
            inputs,
            ro,
            rewards,
            advantages=out["advantages"],
            old_logprobs=out.get("old_per_token_logps"),
            ref_logprobs=out.get("ref_per_token_logps"),
            groups=groups,
        )

    def _sibling_groups(self, texts: list[str], rewards: Tensor) -> list[Any]:
        """Each row's rollout group, for a provider that reads it: TRL lays a generation batch out as G
        consecutive rows per prompt across every process, so the group's texts and rewards are gathered."""
        from composer_plugins.backends.surface import rollout_groups

        every, all_rewards = list(texts), rewards
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            every = gather_object(list(texts))
            all_rewards = self.accelerator.gather(rewards.to(self.accelerator.device)).cpu()
        start = self.accelerator.process_index * len(texts)
        groups = rollout_groups(every, all_rewards, self.num_generations, self.hint_threshold)
        return groups[start : start + len(texts)]

    def step_policy(self, model: Any) -> Any:
        """The models and settings the assembler builds channel inputs with (as the native module's)."""
        from composer_plugins.backends.surface import StepPolicy

        return StepPolicy(
            model=model,
            tokenizer=self.processing_class,
            teacher=self.ema_teacher,
            reference=self.ref_model,
            temperature=self.temperature,
            max_context_length=self.max_hint_length,
            teacher_margin=self.hint_teacher_margin,
            pair_prompt_length=self.pair_prompt_length,
            pair_max_length=self.pair_max_length,
            teacher_scoring=self.teacher_scoring,
        )

    # -- the loss (the Trainer's public hook) ------------------------------------------------------
    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Tensor:
        """The composed loss of one micro-batch: its step record, the assembled channel inputs, the composer."""
        if return_outputs:
            raise ValueError("ComposerGRPOTrainer does not return outputs from compute_loss")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        mm = {k: inputs.get(k) for k in _MULTIMODAL_KEYS}  # passed exactly as TRL passes them
        per_token_logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True, **mm
        )
        mode = "train" if self.model.training else "eval"
        # TRL's dapo/cispo normaliser, per micro-batch (the composed loss is divided by the accumulation below).
        n_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            n_items = n_items / self.args.steps_per_generation
        record = self._records[mode].select(inputs["record_rows"])
        pairs = sample_pairs(self.pairs, self.pairs_per_step, self.args.seed * 1_000_003 + self._loss_calls)
        meta = StepMeta(self.state.global_step, self.state.max_steps, tuple(pairs) if self.needs_pairs else ())
        given: dict[str, Any] = {"logprobs": per_token_logps, "num_items_in_batch": n_items}
        if self.use_vllm and self.vllm_importance_sampling_correction:
            given["importance_sampling_ratio"] = inputs["importance_sampling_ratio"]
        loss, stats = self.stepper.loss(record, meta, given=given, policy=self.step_policy(model))
        if mode == "train":
            loss = loss / self.current_gradient_accumulation_steps
        self._loss_calls += 1
        m = self._metrics[mode]
        ent = (entropies * mask).sum() / mask.sum().clamp(min=1.0)
        m["entropy"].append(float(self.accelerator.gather(ent.detach()).mean()))
        for k, v in stats.items():
            if k != "loss" and v == v:
                m[f"composer/{k}"].append(v)
        return loss


class _RewardRecorder:
    """The reward functions, wrapped so that what each returns for a generation batch is kept.

    TRL calls reward functions with its documented keyword arguments; the wrapper passes them on and
    keeps the output (``None`` -> NaN), keeping the function's name (TRL's logs use it).
    """

    def __init__(self) -> None:
        self.outputs: dict[int, list[float]] = {}
        self.count = 0
        self.unrecorded: list[str] = []

    def wrap_all(self, funcs: Any) -> Any:
        many = isinstance(funcs, list | tuple)
        wrapped = [self.wrap(i, f) for i, f in enumerate(funcs if many else [funcs])]
        self.count = len(wrapped)
        return wrapped if many else wrapped[0]

    def wrap(self, i: int, fn: Any) -> Any:
        from torch import nn
        from trl.trainer.utils import is_async_callable

        if isinstance(fn, str | nn.Module) or not callable(fn):
            self.unrecorded.append(fn if isinstance(fn, str) else type(fn).__name__)
            return fn

        def keep(out: Any) -> Any:
            self.outputs[i] = [float("nan") if r is None else float(r) for r in out]
            return out

        if is_async_callable(fn):

            async def recorded_async(*a: Any, **kw: Any) -> Any:
                return keep(await fn(*a, **kw))

            rec: Any = recorded_async
        else:

            def recorded(*a: Any, **kw: Any) -> Any:
                return keep(fn(*a, **kw))

            rec = recorded
        rec.__name__ = rec.__qualname__ = getattr(fn, "__name__", type(fn).__name__)
        rec.__wrapped__ = fn
        return rec

    def total(self, n: int, weights: Tensor) -> Tensor:
        """``(n,)`` weighted sum over the reward functions (NaN where every function returned ``None``)."""
        cols = torch.full((n, max(1, self.count)), float("nan"))
        for i, out in self.outputs.items():
            cols[:, i] = torch.tensor(out[:n], dtype=torch.float32)
        w = weights.detach().float().cpu()[: cols.shape[1]].unsqueeze(0)
        total = (cols * w).nansum(dim=1)
        total[torch.isnan(cols).all(dim=1)] = float("nan")  # device-ok: cols and total are made on the CPU here
        return total


#: The private TRL methods the trainer overrides or calls, with the parameters it relies on (TRL 1.16).
TRL_PRIVATE_SURFACE: dict[str, tuple[str, ...]] = {
    "_generate_and_score_completions": ("self", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
    ),
}


def check_trl_surface(trainer_cls: type = GRPOTrainer) -> None:
    """Raise a clear error when TRL's private methods this trainer relies on changed their signature."""
    import inspect

    import trl

    for name, want in TRL_PRIVATE_SURFACE.items():
        fn = getattr(trainer_cls, name, None)
        have = tuple(inspect.signature(fn).parameters) if fn is not None else ()
        if have[: len(want)] != want:
            found = "missing" if fn is None else "(" + ", ".join(have) + ")"
            raise RuntimeError(
                f"TRL {trl.__version__}: GRPOTrainer.{name} is {found}, "
                f"but ComposerGRPOTrainer relies on ({', '.join(want)}) (tested with trl>=1.16,<1.17) — install "
                "`pip install 'trl>=1.16,<1.17'`, or update composer_plugins_trl.backend (see docs/backends.md, "
                "'TRL: the private method it still overrides')."
            )


# ----------------------------------------------------------------------------------------------
# the backend
# ----------------------------------------------------------------------------------------------
def env_reward_func(env: Any, task_keys: Sequence[str]) -> Callable[..., list[float | None]]:
    """A TRL reward function calling ``env.reward(prompts, completions, **task)`` with the dataset's task columns."""
    keys = list(task_keys)

    def env_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        task = {k: kwargs[k] for k in keys if k in kwargs}
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return list(env.reward(list(prompts), texts, **task))

    env_reward.__name__ = f"{type(env).__name__.lower()}_reward"
    return env_reward


def trl_prompts(tasks: Sequence[Mapping[str, Any]], tokenizer: Any, config: Any) -> list[dict[str, Any]]:
    """The tasks with the prompts TRL is given: conversations stay conversations (TRL applies the tokenizer's
    chat template, the text :func:`composer_plugins.training.rollout.chat.task_prompt` makes), except where TRL
    cannot template them as the config says (``model.chat_template: none``, or a tokenizer without a
    template): those are rendered here, by the one function the native path uses."""
    from composer_plugins.backends.surface import task_conversation, task_prompt

    mode = config.model.chat_template
    plain = mode == "none" or not getattr(tokenizer, "chat_template", None)
    out = []
    for t in tasks:
        t = dict(t)
        if plain and task_conversation(t) is not None:
            t["prompt"] = task_prompt(t, tokenizer, mode)
        out.append(t)
    return out


class TRLBackend(Backend):
    """Train the config's channels with :class:`ComposerGRPOTrainer` (TRL generation, rewards, advantages).

    The dataset is ``max_steps × prompts_per_step`` seeded tasks of the config's env; the reward
    function is the env's ``reward``; the ``GRPOConfig`` comes from the config (policy channel ->
    ``loss_type``/clip range/β, rollout -> sampling, optim -> learning rate). Extra ``GRPOConfig``
    fields can be given as ``grpo_args``.
    """

    name = "trl"
    upstream = "trl>=1.16,<1.17"
    runs_here = "ComposerGRPOTrainer training steps on the tiny model (all channels), loss parity with GRPOTrainer"
    needs_gpu = "nothing (vLLM generation, use_vllm=True, needs a GPU)"
    support: ClassVar[dict[str, Any]] = {"trl": None}

    def __init__(
        self,
        config: Any = None,
        overrides: Sequence[str] = (),
        *,
        output_dir: str | None = None,
        max_steps: int | None = None,
        grpo_args: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(config, overrides, output_dir=output_dir, max_steps=max_steps)
        refuse_own_sampling(self.config, self.src, "the trl backend (GRPOTrainer's own generation)")
        self.grpo_args = dict(grpo_args or {})

    def grpo_config(self, policy: Any) -> GRPOConfig:
        """The ``GRPOConfig`` equivalent of the config, consistent with the built policy channel."""
        c = self.config
        G = c.rollout.num_generations
        lt = getattr(policy, "loss_type", "dapo")
        adv = dict(c.rollout.advantage_kwargs)
        if adv.get("estimator", "grpo") != "grpo" or set(adv) - {"estimator", "scale"}:
            msg = "TRL's GRPOTrainer computes GRPO advantages; only 'scale' (group|batch|none) maps to scale_rewards"
            raise self.src.error("rollout.advantage_kwargs", msg, valid=["scale"])
        kw: dict[str, Any] = dict(
            output_dir=str(self.output_dir / "trl"),
            per_device_train_batch_size=c.rollout.prompts_per_step * G,
            num_generations=G,
            max_completion_length=c.rollout.max_new_tokens,
            temperature=c.rollout.temperature,
            top_p=c.rollout.top_p,
            top_k=c.rollout.top_k,
            learning_rate=c.optim.lr,
            weight_decay=c.optim.weight_decay,
            max_steps=c.trainer.max_steps,
            gradient_accumulation_steps=c.trainer.accumulate_grad_batches,
            max_grad_norm=c.trainer.gradient_clip_val or 0.0,
            seed=c.seed,
            data_seed=c.seed,
            use_cpu=c.trainer.accelerator == "cpu",
            bf16=c.trainer.precision.startswith("bf16"),
            fp16=False,
            gradient_checkpointing=c.compute.gradient_checkpointing == "layer",
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=not c.trainer.enable_progress_bar,
            lr_scheduler_type="constant",
            loss_type="grpo" if lt == "gspo" else lt,
            epsilon=getattr(policy, "epsilon_low", 0.2),
            epsilon_high=getattr(policy, "epsilon_high", None),
            beta=getattr(policy, "beta", 0.0),
            importance_sampling_level="sequence" if lt == "gspo" else "token",
            scale_rewards=adv.get("scale", "group"),
        )
        kw.update(self.grpo_args)
        return GRPOConfig(**kw)

    def train(self) -> Any:
        """Run ``ComposerGRPOTrainer.train()``; returns a :class:`~composer_plugins.training.runs.run.RunResult`."""
        from datasets import Dataset

        from composer_plugins.backends.surface import StepComponents, build_env, load_policy_for, task_drawer

        c = self.config
        if c.trainer.num_threads:
            torch.set_num_threads(c.trainer.num_threads)
        env = build_env(c, self.src)
        model, tok = load_policy_for(c, env)
        tasks = task_drawer(env, c, "train")(c.trainer.max_steps * c.rollout.prompts_per_step, c.seed)
        if not tasks or "prompt" not in tasks[0]:
            raise ConfigError("the env's tasks need a 'prompt' field for TRL", key="env")
        task_keys = [k for k in tasks[0] if k != "prompt"]
        dataset = Dataset.from_list([{k: t.get(k) for k in ["prompt", *task_keys]} for t in trl_prompts(tasks, tok, c)])
        # the channels, hint provider and pairs from the one path from config; the trainer binds the models itself
        parts = StepComponents.from_config(c, self.src, policy=model, tokenizer=tok, env=env, own_models=False)
        composer = parts.composer
        policy = next((ch for ch in composer.channels if getattr(ch, "loss_type", None) in LF.POLICY_LOSS_TYPES), None)
        args = self.grpo_config(policy)
        t0 = time.perf_counter()
        trainer = ComposerGRPOTrainer(
            model=model,
            reward_funcs=[env_reward_func(env, task_keys)],
            args=args,
            train_dataset=dataset,
            processing_class=tok,
            channels=composer,
            hint_provider=parts.hint_provider,
            hint_env=env,
            hint_threshold=c.rollout.success_threshold,
            max_hinted_per_step=c.hints.max_hinted_per_step,
            max_hint_length=c.hints.max_context_length,
            hint_teacher_margin=c.hints.teacher_margin,
            pairs=parts.pairs or None,
            pairs_per_step=c.replay.pairs_per_step,
            pair_prompt_length=c.rollout.max_prompt_length,
            pair_max_length=c.replay.max_completion_length,
            chat_template=c.model.chat_template,
        )
        trainer.train()
        history = []
        for rec in trainer.state.log_history:
            if "step" in rec and "loss" in rec:
                row = {"step": float(rec["step"])}
                row.update({k: float(v) for k, v in rec.items() if isinstance(v, int | float) and k != "step"})
                history.append(row)
        return self.write_outputs(history, {"train_seconds": time.perf_counter() - t0}, trainer.model, tok)


__all__ = [
    "SUPPORTED_LOSS_TYPES",
    "ComposerGRPOTrainer",
    "TRLBackend",
    "env_reward_func",
    "policy_channel_from_args",
    "trl_prompts",
]
