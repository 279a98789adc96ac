"""The ``verl`` backend: our losses inside VeRL's own registries.

Importing this module registers, in ``verl.trainer.ppo.core_algos`` (idempotently):

* policy losses ``composer_grpo``, ``composer_bnpo``, ``composer_dr_grpo``, ``composer_dapo``,
  ``composer_cispo``, ``composer_gspo`` and ``composer_dppo`` — select one with
  ``actor_rollout_ref.actor.policy_loss.loss_mode=composer_grpo``;
* advantage estimators ``composer_grpo`` and ``composer_rloo`` — ``algorithm.adv_estimator=composer_grpo``.

Each policy loss has VeRL's ``PolicyLossFn`` signature ``(old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``. The per-token
loss is computed by our functional API (:func:`composer_plugins.losses.functional.policy_loss`,
:func:`~composer_plugins.losses.functional.dppo_kl_loss`) and aggregated with VeRL's own
``agg_loss(loss_agg_mode, **config.global_batch_info)``: every ``agg_loss`` mode is linear in the
loss matrix, so its per-token weights are read off ``agg_loss`` itself (one autograd probe) and
passed to the functional as per-token weights. With the ``loss_agg_mode`` of
:data:`MATCHING_AGG_MODE` the value equals the functional's own aggregate for that loss type.

Clip parameters come from VeRL's actor config (``clip_ratio_low``/``clip_ratio_high``; CISPO caps
the ratio at ``1 + clip_ratio_high``; DPPO masks at ``clip_ratio_low``/``clip_ratio_high``, with
``adv_tau``/``kl_tau`` read from ``policy_loss`` when present). VeRL adds its KL loss
(``use_kl_loss``) and entropy bonus itself, so the registered losses carry no KL term.

Not registered: a distillation loss for hint self-distillation. VeRL's distillation losses see
the teacher's log-prob of the sampled token only (estimator mode) or top-k log-probs consumed by
a strategy-specific logits processor, and the teacher always scores the *student's* prompt; our
hint channel needs the same policy conditioned on prompt + hint, with full logits. See
``docs/backends.md``.

VeRL loads this module in every process through the ``verl.plugins`` entry point of the
``composer-plugins-verl`` distribution (or ``VERL_USE_EXTERNAL_MODULES=composer_plugins_verl.backend``).
A full VeRL PPO run needs Ray and GPUs (:meth:`VeRLBackend.command`); on CPU,
:meth:`VeRLBackend.train` with ``mode="local"`` drives VeRL's own ``compute_advantage`` and
``ppo_loss`` (the function VeRL's engine workers call) in-process.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from composer_plugins.backends.surface import (
    CLIP_OPTIONS,
    LIMITS,
    POLICY_KINDS,
    REFUSED,
    Backend,
    Cell,
    ComposerPluginsError,
    ConfigError,
    refuse_own_sampling,
    scalar_metrics,
    support,
)
from composer_plugins.backends.surface import functional as F

#: VeRL policy-loss name -> our loss type.
POLICY_LOSSES: dict[str, str] = {f"composer_{t}": t for t in POLICY_KINDS}

# -- the channel x mode cells this backend declares (composer_plugins.backends.support) ----------
_POLICY_CELL = Cell(
    LIMITS,
    "VeRL's `ppo_loss` with the registered `composer_<type>` loss, aggregated by VeRL's `agg_loss` "
    "(`loss_agg_mode`); of the channel's options only the clip range is carried (`beta`, `delta`, `rows` ... "
    "are refused: VeRL's `use_kl_loss` and entropy settings apply); one policy channel per run",
    CLIP_OPTIONS,
)
_NO_CHANNEL = Cell(
    REFUSED,
    "VeRL's actor runs one registered policy loss on (old, new) log-probs, advantages and a response mask; "
    "it has no hinted teacher, external teacher scores, preference pairs or channel object to feed",
)
SUPPORT_LOCAL: dict[str, Cell] = {
    **{f"policy:{t}": _POLICY_CELL for t in POLICY_LOSSES.values()},
    "hint": _NO_CHANNEL,
    "teacher": _NO_CHANNEL,
    "pairs": _NO_CHANNEL,
}
SUPPORT_RAY: dict[str, Cell] = {
    **SUPPORT_LOCAL,
    "hint": Cell(
        REFUSED,
        "VeRL's distillation losses see the teacher's sampled-token or top-k log-probs of the student's own "
        "prompt; the hint channel needs the policy conditioned on prompt + hint, with full logits",
    ),
}

#: ``loss_agg_mode`` under which a VeRL loss equals our functional loss of the same type
#: (``dr_grpo``: with ``loss_scale_factor`` = max response length; ``dapo``/``cispo``: VeRL's
#: ``batch_num_tokens`` is the global token count TRL passes as ``num_items_in_batch``;
#: ``dppo``: PRIME-RL divides the token sum by the global loss-token count, = token-mean).
MATCHING_AGG_MODE: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "gspo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
    "cispo": "token-mean",
    "dppo": "token-mean",
}

#: VeRL advantage-estimator name -> our ``group_advantages`` estimator.
ADV_ESTIMATORS: dict[str, str] = {"composer_grpo": "grpo", "composer_rloo": "rloo"}

_MARK = "__composer_plugins__"


# ----------------------------------------------------------------------------------------------
# config access (ActorConfig dataclass, OmegaConf DictConfig or a plain mapping)
# ----------------------------------------------------------------------------------------------
def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if hasattr(cfg, "get"):
        try:
            v = cfg.get(key, default)
        except Exception:  # DictConfig in struct mode raises on unknown keys
            v = default
        return default if v is None else v
    return getattr(cfg, key, default)


def global_batch_info(config: Any) -> dict[str, Any]:
    """``config.global_batch_info`` as a plain dict (``{}`` when absent; then ``agg_loss`` uses local counts)."""
    info = _get(config, "global_batch_info", None)
    return dict(info) if info else {}


def agg_weights(mask: Tensor, loss_agg_mode: str, batch_info: Mapping[str, Any] | None = None) -> Tensor:
    """Per-token weights ``W`` with ``agg_loss(L, mask, mode, **info) == Σ L·W`` for every ``L``.

    Every ``agg_loss`` mode is linear in the loss matrix, so ``W`` is its gradient with respect to
    the matrix, read from VeRL's own ``agg_loss`` (not a restatement of its formulas).
    """
    from verl.trainer.ppo.core_algos import agg_loss

    probe = torch.ones(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        total = agg_loss(loss_mat=probe, loss_mask=mask, loss_agg_mode=loss_agg_mode, **dict(batch_info or {}))
        (w,) = torch.autograd.grad(total, probe)
    return w.detach()


def _metric_floats(metrics: Mapping[str, Any], prefix: str) -> dict[str, float]:
    out = {}
    for k, v in scalar_metrics(metrics).items():
        if v == v:  # drop NaN (e.g. min over no sequence)
            out[f"{prefix}{k}"] = v
    return out


# ----------------------------------------------------------------------------------------------
# policy losses
# ----------------------------------------------------------------------------------------------
def composer_policy_loss(
    loss_type: str,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """Our ``loss_type`` with VeRL's ``PolicyLossFn`` contract (see the module docstring)."""
    import verl.utils.torch_functional as verl_F

    mask = response_mask.bool()
    clip = float(_get(config, "clip_ratio", 0.2))
    eps_low = float(_get(config, "clip_ratio_low", clip))
    eps_high = float(_get(config, "clip_ratio_high", clip))
    weights = agg_weights(mask, loss_agg_mode, global_batch_info(config)).to(log_prob.dtype)
    if rollout_is_weights is not None:
        weights = weights * rollout_is_weights.to(log_prob.dtype)
    adv = advantages.to(log_prob.dtype)
    if loss_type == "dppo":
        pl = _get(config, "policy_loss", None)
        out = F.dppo_kl_loss(
            log_prob,
            old_log_prob,
            adv,
            mask,
            dppo_mask_low=eps_low,
            dppo_mask_high=eps_high,
            adv_tau=float(_get(pl, "adv_tau", 1.0)),
            kl_tau=float(_get(pl, "kl_tau", 1e-3)),
            loss_weights=weights,
        )
        clipfrac = out.metrics["is_masked"]
    else:
        # "dapo" aggregation with num_items_in_batch=1 is the plain masked token sum: Σ loss·W·M = agg_loss(loss).
        out = F.policy_loss(
            log_prob,
            old_log_prob,
            adv,
            mask,
            loss_type="cispo" if loss_type == "cispo" else "dapo",
            epsilon_low=eps_low,
            epsilon_high=(1.0 + eps_high) if loss_type == "cispo" else eps_high,
            importance_sampling_level="sequence" if loss_type == "gspo" else "token",
            num_items_in_batch=1.0,
            importance_sampling_ratio=weights,
        )
        clipfrac = out.metrics.get("clip_ratio/region_mean", out.metrics.get("cispo_clip_ratio", 0.0))
    with torch.no_grad():
        ppo_kl = verl_F.masked_mean(old_log_prob - log_prob, mask)
    metrics = {
        "actor/pg_clipfrac": float(clipfrac),
        "actor/ppo_kl": float(ppo_kl),
        "actor/pg_clipfrac_lower": 0.0,
        **_metric_floats(out.metrics, f"actor/composer_{loss_type}/"),
    }
    return out.loss, metrics


def _make_policy_loss(loss_type: str) -> Callable[..., tuple[Tensor, dict[str, Any]]]:
    def loss_fn(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        return composer_policy_loss(
            loss_type, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )

    loss_fn.__name__ = f"composer_{loss_type}_policy_loss"
    loss_fn.__qualname__ = loss_fn.__name__
    loss_fn.__doc__ = (
        f"composer-plugins ``{loss_type}`` policy loss for VeRL (per-token loss from our functional API, "
        f"aggregated by VeRL's agg_loss; matches our aggregate with loss_agg_mode={MATCHING_AGG_MODE[loss_type]})."
    )
    setattr(loss_fn, _MARK, True)
    return loss_fn


POLICY_LOSS_FNS: dict[str, Callable[..., tuple[Tensor, dict[str, Any]]]] = {
    name: _make_policy_loss(lt) for name, lt in POLICY_LOSSES.items()
}


# ----------------------------------------------------------------------------------------------
# advantage estimators
# ----------------------------------------------------------------------------------------------
def _scale_from(config: Any, estimator: str) -> str:
    if estimator == "rloo":
        return "none"
    return "group" if bool(_get(config, "norm_adv_by_std_in_grpo", True)) else "none"


def composer_group_advantage(
    estimator: str,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Any] | None = None,
    config: Any = None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """Outcome advantages from :func:`~composer_plugins.losses.functional.group_advantages` (TRL semantics).

    Rows are grouped by VeRL's ``index`` (the ``uid`` of the prompt each response answers; groups
    need not be contiguous nor equal-sized). ``norm_adv_by_std_in_grpo=False`` gives Dr. GRPO's
    unscaled advantages. Returns ``(advantages, returns)``, both ``(bs, response_length)``.
    """
    scores = token_level_rewards.sum(dim=-1).float()
    if index is None:
        index = [0] * scores.shape[0]
    groups: dict[Any, list[int]] = {}
    for i, uid in enumerate(list(index)):
        groups.setdefault(uid, []).append(i)
    adv = torch.zeros_like(scores)
    scale = _scale_from(config, estimator)
    with torch.no_grad():
        for rows in groups.values():
            idx = torch.tensor(rows, device=scores.device)
            adv[idx] = F.group_advantages(scores[idx], len(rows), scale, estimator=estimator).to(adv.dtype)  # type: ignore[arg-type]
    out = adv.unsqueeze(-1) * response_mask.to(adv.dtype)
    return out, out


def _make_adv_estimator(estimator: str) -> Callable[..., tuple[Tensor, Tensor]]:
    def adv_fn(
        token_level_rewards: Tensor,
        response_mask: Tensor,
        index: Sequence[Any] | None = None,
        config: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        return composer_group_advantage(estimator, token_level_rewards, response_mask, index, config, **kwargs)

    adv_fn.__name__ = f"composer_{estimator}_advantage"
    adv_fn.__doc__ = f"composer-plugins ``{estimator}`` group advantages for VeRL (TRL semantics)."
    setattr(adv_fn, _MARK, True)
    return adv_fn


ADV_ESTIMATOR_FNS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    name: _make_adv_estimator(est) for name, est in ADV_ESTIMATORS.items()
}


# ----------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------
def register_verl_components() -> dict[str, list[str]]:
    """Register our policy losses and advantage estimators in VeRL's registries (idempotent).

    ``register_policy_loss`` silently overwrites a name, so a name already taken by *another*
    package is refused here with an error instead; ``register_adv_est`` raises on a clash itself,
    so our estimators are only registered where the name is free (or already ours).
    """
    from verl.trainer.ppo import core_algos

    for name, fn in POLICY_LOSS_FNS.items():
        existing = core_algos.POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing is not fn and not getattr(existing, _MARK, False):
            raise ComposerPluginsError(
                f"VeRL policy loss {name!r} is already registered by {getattr(existing, '__module__', '?')}; "
                "composer-plugins will not overwrite it. HINT: unregister the other one or rename it."
            )
        if existing is not fn:
            core_algos.register_policy_loss(name)(fn)
    for name, fn in ADV_ESTIMATOR_FNS.items():
        existing = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
        if existing is None:
            core_algos.register_adv_est(name)(fn)
        elif existing is not fn and not getattr(existing, _MARK, False):
            raise ComposerPluginsError(
                f"VeRL advantage estimator {name!r} is already registered by "
                f"{getattr(existing, '__module__', '?')}. HINT: pick another algorithm.adv_estimator."
            )
    return {
        "policy_losses": list(POLICY_LOSS_FNS),
        "adv_estimators": list(ADV_ESTIMATOR_FNS),
        "distillation_losses": [],
    }


REGISTERED = register_verl_components()


# ----------------------------------------------------------------------------------------------
# the backend
# ----------------------------------------------------------------------------------------------
class VeRLBackend(Backend):
    """Run the policy channel of a config with VeRL.

    ``mode="ray"`` launches ``python -m verl.trainer.main_ppo`` with the overrides of
    :meth:`overrides` (needs Ray and GPUs). ``mode="local"`` runs, in this process on CPU,
    generation with HF ``generate``, rewards from the config's env, VeRL's own
    ``compute_advantage`` with our estimator and VeRL's own ``ppo_loss`` with our policy loss
    (the function VeRL's engine workers call), and a torch optimizer step: the VeRL loss path
    without Ray, FSDP or vLLM.

    Args:
        config, overrides, output_dir: see :class:`~composer_plugins.backends.base.Backend`.
        mode: ``"local"`` or ``"ray"``.
        loss_agg_mode: VeRL aggregation (default: :data:`MATCHING_AGG_MODE` of the policy channel).
        adv_estimator: ``composer_grpo`` (default) or ``composer_rloo``.
        extra_overrides: more Hydra overrides for ``mode="ray"`` (data files, GPUs, rollout engine).
        max_steps: overrides ``trainer.max_steps``.
    """

    name = "verl"
    upstream = "verl>=0.9.1,<0.10"
    runs_here = (
        "policy losses and advantage estimators through VeRL's registries, VeRL's compute_advantage and "
        "ppo_loss on the tiny model (mode=local)"
    )
    needs_gpu = "python -m verl.trainer.main_ppo (Ray workers, FSDP/Megatron engine, vLLM/SGLang rollout)"
    support: ClassVar[dict[str, Any]] = {"verl:local": SUPPORT_LOCAL, "verl:ray": SUPPORT_RAY}

    def __init__(
        self,
        config: Any = None,
        overrides: Sequence[str] = (),
        *,
        output_dir: str | None = None,
        mode: str = "local",
        loss_agg_mode: str | None = None,
        adv_estimator: str | None = None,
        extra_overrides: Sequence[str] = (),
        max_steps: int | None = None,
    ) -> None:
        super().__init__(config, overrides, output_dir=output_dir, max_steps=max_steps)
        if mode not in ("local", "ray"):
            raise ConfigError(f"unknown mode {mode!r}", key="mode", valid=["local", "ray"])
        adv = dict(self.config.rollout.advantage_kwargs)
        if adv_estimator is None:
            adv_estimator = f"composer_{adv.get('estimator', 'grpo')}"
        if adv_estimator not in ADV_ESTIMATORS:
            raise ConfigError(
                f"unknown advantage estimator {adv_estimator!r}", key="adv_estimator", valid=list(ADV_ESTIMATORS)
            )
        self.mode = mode
        if mode == "ray":
            refuse_own_sampling(self.config, self.src, "the verl backend with mode='ray' (VeRL's rollout workers)")
        self.loss_type, self.channel_kwargs = self._policy_channel()
        self.loss_mode = f"composer_{self.loss_type}"
        self.loss_agg_mode = loss_agg_mode or MATCHING_AGG_MODE[self.loss_type]
        self.adv_estimator = adv_estimator
        self.extra_overrides = list(extra_overrides)

    def _policy_channel(self) -> tuple[str, dict[str, Any]]:
        """The policy channel of ``config.losses`` (the only channel a VeRL policy loss carries): the one whose
        class declares the group advantages and a loss VeRL's registry holds (never chosen by its name)."""
        from composer_plugins.backends.surface import declared_channels

        support.check_channels(
            f"verl:{self.mode}", self.config, self.src, type(self).support
        )  # a channel VeRL cannot run is refused
        found = []
        for ch in declared_channels(self.config, self.src):
            if ch.is_policy and (ch.loss_type or ch.name) in POLICY_LOSSES.values():
                found.append((str(ch.loss_type or ch.name), ch.kwargs))
        if len(found) != 1:
            raise self.src.error(
                "losses",
                f"the verl backend needs exactly one enabled policy channel, found {len(found)}",
                valid=list(POLICY_LOSSES.values()),
            )
        return found[0]

    # -- ray ------------------------------------------------------------------------------
    def overrides(self, model_path: str | None = None) -> list[str]:
        """Hydra overrides selecting our loss and estimator for ``verl.trainer.main_ppo``."""
        c = self.config
        G, P = c.rollout.num_generations, c.rollout.prompts_per_step
        eps_low, eps_high = clip_range(self.loss_type, self.channel_kwargs)
        ov = [
            f"algorithm.adv_estimator={self.adv_estimator}",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={self.loss_mode}",
            f"actor_rollout_ref.actor.loss_agg_mode={self.loss_agg_mode}",
            f"actor_rollout_ref.actor.clip_ratio_low={eps_low}",
            f"actor_rollout_ref.actor.clip_ratio_high={eps_high}",
            f"actor_rollout_ref.actor.optim.lr={c.optim.lr}",
            f"actor_rollout_ref.rollout.n={G}",
            f"actor_rollout_ref.rollout.temperature={c.rollout.temperature}",
            f"data.train_batch_size={P}",
            f"data.max_response_length={c.rollout.max_new_tokens}",
            f"data.max_prompt_length={c.rollout.max_prompt_length}",
            f"trainer.total_training_steps={c.trainer.max_steps}",
            f"trainer.default_local_dir={self.output_dir / 'verl'}",
        ]
        if model_path:
            ov.append(f"actor_rollout_ref.model.path={model_path}")
        if self.loss_type == "dr_grpo":
            ov.append(f"actor_rollout_ref.actor.loss_scale_factor={c.rollout.max_new_tokens}")
        return ov + self.extra_overrides

    def command(self, model_path: str | None = None) -> list[str]:
        """``python -m verl.trainer.main_ppo <overrides>`` (run it where Ray and GPUs are)."""
        return [sys.executable, "-m", "verl.trainer.main_ppo", *self.overrides(model_path)]

    # -- train ----------------------------------------------------------------------------
    def train(self) -> Any:
        """Train (see the class docstring); returns a :class:`~composer_plugins.training.runs.run.RunResult`."""
        if self.mode == "ray":
            if not torch.cuda.is_available():
                raise ComposerPluginsError(
                    "the VeRL PPO trainer (mode='ray') needs GPUs and Ray: run `"
                    + " ".join(self.command())
                    + "` on a GPU machine, or use mode='local' here."
                )
            env = {"VERL_USE_EXTERNAL_MODULES": "composer_plugins_verl.backend"}
            import os

            subprocess.run(self.command(), check=True, env={**os.environ, **env})
            return self.write_outputs([], {"verl/exit_code": 0.0})
        return self._train_local()

    def _train_local(self) -> Any:
        from composer_plugins.backends.surface import Needs, assemble_inputs
        from composer_plugins.backends.surface import rollout as R

        c = self.config
        # VeRL's loss is its own (no channel objects); it computes the advantages itself (compute_advantage), so
        # the record has none; the experience maker gives the sampling-time log-probs its ppo_loss reads
        run = R.LocalRun(c, self.src, channels=[], advantage_kwargs=None)
        policy = run.parts.step_policy()
        scale = c.rollout.max_new_tokens if self.loss_type == "dr_grpo" else None
        eps_low, eps_high = clip_range(self.loss_type, self.channel_kwargs)
        actor_cfg = make_actor_config(
            self.loss_mode,
            self.loss_agg_mode,
            {"epsilon_low": eps_low, "epsilon_high": eps_high},
            G=c.rollout.num_generations,
            loss_scale_factor=scale,
        )
        algo_cfg = make_algo_config(self.adv_estimator, self.config.rollout.advantage_kwargs)

        def loss_of(record: Any, step: int) -> tuple[Tensor, dict[str, float]]:
            inputs, _ = assemble_inputs(record, Needs("old_logprobs"), policy)  # the record's, through the assembler
            return verl_actor_step(
                run.policy,
                record,
                record.rewards.tolist(),
                actor_cfg,
                algo_cfg,
                temperature=c.rollout.temperature,
                old_log_probs=inputs["old_logprobs"],
            )

        return self.run_local(run, loss_of, old_logprobs=True)


# ----------------------------------------------------------------------------------------------
# VeRL's loss path, in-process
# ----------------------------------------------------------------------------------------------
def clip_range(loss_type: str, channel_kwargs: Mapping[str, Any] | None = None) -> tuple[float, float]:
    """VeRL ``(clip_ratio_low, clip_ratio_high)`` equivalent to our channel's settings (and defaults).

    ``cispo``'s channel ``epsilon_high`` is the absolute ratio cap (TRL), VeRL's is ``1 + clip_ratio_high``;
    ``dppo``'s masks are ``dppo_mask_low``/``dppo_mask_high``.
    """
    from composer_plugins.backends.surface import CHANNEL_EPSILONS

    kw = dict(channel_kwargs or {})
    if loss_type == "dppo":
        return float(kw.get("dppo_mask_low", 0.2)), float(kw.get("dppo_mask_high", 0.2))
    lo, hi = CHANNEL_EPSILONS[loss_type]
    lo = float(kw.get("epsilon_low", lo))
    hi = float(kw.get("epsilon_high", hi))
    return lo, (hi - 1.0 if loss_type == "cispo" else hi)


def make_actor_config(
    loss_mode: str,
    loss_agg_mode: str,
    channel_kwargs: Mapping[str, Any] | None = None,
    *,
    G: int = 1,
    loss_scale_factor: int | None = None,
) -> Any:
    """A VeRL ``ActorConfig`` selecting ``loss_mode`` (what Hydra builds from the example config)."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    kw = dict(channel_kwargs or {})
    eps_low = float(kw.get("epsilon_low", kw.get("epsilon", 0.2)))
    eps_high = float(kw.get("epsilon_high", eps_low))
    return ActorConfig(
        strategy="fsdp",
        rollout_n=G,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=eps_low,
        clip_ratio_low=eps_low,
        clip_ratio_high=eps_high,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
        use_kl_loss=False,
    )


def make_algo_config(adv_estimator: str, advantage_kwargs: Mapping[str, Any] | None = None) -> Any:
    """A VeRL ``AlgoConfig`` with our advantage estimator (``advantage_kwargs``: ``rollout.advantage_kwargs``).

    ``scale="none"`` (Dr. GRPO) maps to ``norm_adv_by_std_in_grpo=False``; ``"batch"`` has no VeRL
    equivalent for outcome estimators and is refused.
    """
    from verl.trainer.config import AlgoConfig

    scale = (advantage_kwargs or {}).get("scale", "group")
    if scale not in ("group", "none", None):
        raise ConfigError(
            f"scale {scale!r} has no VeRL equivalent", key="rollout.advantage_kwargs.scale", valid=["group", "none"]
        )
    return AlgoConfig(adv_estimator=adv_estimator, norm_adv_by_std_in_grpo=scale != "none")


def verl_batch(ro: Any, rewards: Sequence[float], old_log_probs: Tensor, adv_estimator: Any, algo_cfg: Any) -> Any:
    """The rollout as VeRL sees it: ``compute_advantage`` on a ``DataProto``, then a no-padding ``TensorDict``."""
    import numpy as np
    from tensordict import TensorDict
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    B, C = ro.completion_ids.shape
    rmask = ro.completion_mask.long()
    dev = rmask.device  # the rollout's (the policy's) device
    scores = torch.zeros(B, C, device=dev)
    last = (rmask.sum(-1) - 1).clamp(min=0)
    scores[torch.arange(B, device=dev), last] = torch.tensor([float(r) for r in rewards], device=dev)
    attn = torch.cat([ro.prompt_mask.long(), rmask], dim=1)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": scores, "response_mask": rmask},
        non_tensors={"uid": np.array([f"p{int(g)}" for g in ro.group_index.tolist()], dtype=object)},
    )
    data = compute_advantage(data, adv_estimator=adv_estimator, config=algo_cfg)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    td = TensorDict(
        {
            "prompts": ro.prompt_ids,
            "responses": ro.completion_ids,
            "input_ids": torch.cat([ro.prompt_ids, ro.completion_ids], dim=1),
            "attention_mask": attn,
            "response_mask": rmask,
            "position_ids": pos,
            "old_log_probs": old_log_probs.detach(),
            "advantages": data.batch["advantages"],
        },
        batch_size=[B],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(rmask.sum()), global_batch_size=B)
    return td


def nested_log_probs(model: Any, td: Any, temperature: float = 1.0) -> Tensor:
    """Log-probs in VeRL's no-padding layout: entry ``t`` of a sequence is ``log p(token_{t+1} | ≤ t)``."""
    from composer_plugins.backends.surface import chunked_logprobs, decoder_body, lm_head_weight

    body, head = decoder_body(model), lm_head_weight(model)
    ids = td["input_ids"]
    offsets = ids.offsets()
    values = ids.values()
    pos = td["position_ids"].values()
    parts = []
    for i in range(offsets.shape[0] - 1):
        s, e = int(offsets[i]), int(offsets[i + 1])
        seq = values[s:e].unsqueeze(0)
        hidden = body(input_ids=seq, position_ids=pos[s:e].unsqueeze(0), use_cache=False).last_hidden_state[0]
        nxt = torch.cat([values[s + 1 : e], values[s : s + 1]])  # last entry is never read
        parts.append(chunked_logprobs(hidden, head, nxt, temperature=temperature))  # LM head in chunks
    flat = torch.cat(parts)
    return torch.nested.nested_tensor_from_jagged(flat, offsets=offsets)


def verl_actor_step(
    policy: Any,
    ro: Any,
    rewards: Sequence[float],
    actor_cfg: Any,
    algo_cfg: Any,
    *,
    temperature: float = 1.0,
    old_log_probs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """One VeRL actor update's loss on a rollout: VeRL's ``compute_advantage`` + ``ppo_loss``.

    ``ro``: a rollout or a step record (its token tensors and ``group_index``). ``old_log_probs``: the
    sampling-time log-probs (the record's ``old_logprobs``); made here by the experience maker when absent.
    """
    from verl.workers.utils.losses import ppo_loss

    old = old_log_probs
    if old is None:  # the experience maker's no-grad sampling-time log-probs
        from composer_plugins.backends.surface import ExperienceMaker

        old = (
            ExperienceMaker(policy=policy, temperature=temperature)
            .make([], ro, rewards, old_logprobs=True)
            .old_logprobs
        )
    td = verl_batch(ro, rewards, old, algo_cfg.adv_estimator, algo_cfg)
    log_probs = nested_log_probs(policy, td, temperature)
    loss, metrics = ppo_loss(actor_cfg, {"log_probs": log_probs}, td)
    flat = {}
    for k, v in metrics.items():
        val = v.aggregate() if hasattr(v, "aggregate") else v
        if isinstance(val, Tensor | float | int) and not isinstance(val, bool):
            flat[k] = float(val)
    return loss, flat


__all__ = [
    "ADV_ESTIMATORS",
    "ADV_ESTIMATOR_FNS",
    "MATCHING_AGG_MODE",
    "POLICY_LOSSES",
    "POLICY_LOSS_FNS",
    "REGISTERED",
    "VeRLBackend",
    "agg_weights",
    "clip_range",
    "composer_group_advantage",
    "composer_policy_loss",
    "make_actor_config",
    "make_algo_config",
    "register_verl_components",
    "verl_actor_step",
]
