"""The ``prime_rl`` backend: a PRIME-RL custom loss composed from our channels.

PRIME-RL replaces its ``rl`` loss component with a user function when the trainer config says::

    [trainer.loss]
    type = "custom"
    import_path = "composer_plugins_prime_rl.loss_fn"

    [trainer.loss.kwargs]
    policy = "dppo"        # PRIME-RL's default loss; or dapo / cispo / gspo
    hint_weight = 0.0      # > 0: hint self-distillation on ref_logprobs (see below)

The interface is implemented from PRIME-RL's published source, ``src/prime_rl/trainer/rl/loss.py``
of https://github.com/PrimeIntellect-ai/prime-rl at commit
``559b44772e471d1538537b8805cc77f3824a5e64`` (2026-08-21): the loss is called **per sample** as
``loss_fn(inputs: LossInputs, **kwargs) -> LossOutputs`` with ``LossInputs(trainer_logprobs,
inference_logprobs, ref_logprobs, advantages, loss_mask, loss_weights)`` (1-D per-token tensors;
``loss_weights`` ``None`` means 1.0) and must return the *summed* token loss of that sample;
PRIME-RL adds the samples up and divides by the global count of loss tokens (``rl_scale``).
Older PRIME-RL versions (before commit ``0be5ac4``) named the reference stream
``teacher_logprobs`` and had no ``loss_weights``; both layouts are accepted.

When ``prime_rl`` is importable, :data:`LossInputs` / :data:`LossOutputs` are PRIME-RL's own
classes; otherwise they are structurally identical stand-ins (prime-rl is not on PyPI and needs
Python 3.12), which is what the tests use.

Channels: the policy channel is always on — ``policy="dppo"`` is
:func:`~composer_plugins.losses.functional.dppo_kl_loss`, PRIME-RL's default DPPO+KL loss (with
the extra channels off, this function returns exactly PRIME-RL's default loss); ``dapo`` /
``cispo`` / ``gspo`` use :func:`~composer_plugins.losses.functional.policy_loss` with the
inference log-probs as the old policy. ``hint_weight > 0`` adds hint self-distillation where the
sample carries ``ref_logprobs`` (the live policy scoring the sample conditioned on its hint):
``hint_weight · Σ_t KL̂(π‖π_hint)`` with the ``hint_estimator`` of
:func:`~composer_plugins.losses.functional.kl_estimate`. ``mode="local"`` feeds that stream (and the
teacher stream of ``teacher_weight``); a PRIME-RL run at the commit above never does (its ``opsd``/``opd``
algorithms send those samples to its own ``ref_kl`` loss), so ``mode="prime-rl"`` refuses both channels
(:mod:`composer_plugins.backends.support`). PRIME-RL hands
the loss only sampled-token log-probs, so the full-vocabulary divergences (JSD, TAID) of the
native hint channel cannot run here, and the replay-DPO channel (which needs chosen/rejected pairs)
has no place in a per-sample contract.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from composer_plugins.backends.surface import (
    CLIP_OPTIONS,
    LIMITS,
    POLICY_KINDS,
    REFUSED,
    RUNS,
    Backend,
    Cell,
    ComposerPluginsError,
    ConfigError,
    refuse_own_sampling,
    support,
)
from composer_plugins.backends.surface import functional as F

#: The PRIME-RL commit the per-sample contract was read from.
PRIME_RL_COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"
#: Import path to put in ``[trainer.loss] import_path``.
IMPORT_PATH = "composer_plugins_prime_rl.loss_fn"
#: Policy losses usable per sample (their aggregate is a token sum, which PRIME-RL normalises).
POLICIES: tuple[str, ...] = ("dppo", "dapo", "cispo", "gspo")

# -- the channel x mode cells this backend declares (composer_plugins.backends.support) ----------
_SUM = (
    "the sample's token sum ÷ PRIME-RL's loss-token count; of the channel's options only the clip range is "
    "carried (`beta`, `delta`, `rows` ... are refused); one policy channel per run"
)
_UPSTREAM_REF = (
    "at PRIME-RL 559b447 a sample carries `ref_logprobs` only under `orchestrator.algo` `opsd`/`opd`, which "
    "route the sampled tokens to PRIME-RL's own `ref_kl` loss, never to the custom loss; run it with "
    "mode='local' (sampled-token form), or with PRIME-RL's own `{algo}` algorithm (its loss, not this channel)"
)
_POLICY_REFUSED = Cell(
    REFUSED,
    "its normaliser (per-sequence mean, local batch tokens or B × max length) does not fit PRIME-RL's "
    f"per-sample token sum ÷ global token count; use {', '.join(f'`{t}`' for t in POLICIES)} here",
)
_COMMON: dict[str, Cell] = {
    **{f"policy:{t}": _POLICY_REFUSED for t in POLICY_KINDS if t not in POLICIES},
    "policy:dppo": Cell(RUNS, "PRIME-RL's default loss (DPPO+KL), exactly", CLIP_OPTIONS | {"adv_tau", "kl_tau"}),
    "policy:dapo": Cell(LIMITS, _SUM, CLIP_OPTIONS),
    "policy:cispo": Cell(LIMITS, _SUM, CLIP_OPTIONS),
    "policy:gspo": Cell(LIMITS, "sequence-level ratio, but not GSPO's per-sequence mean: " + _SUM, CLIP_OPTIONS),
    "pairs": Cell(REFUSED, "PRIME-RL's per-sample log-prob contract carries no chosen/rejected pairs"),
}
SUPPORT_LOCAL: dict[str, Cell] = {
    **_COMMON,
    "hint": Cell(
        LIMITS,
        "a sampled-token KL estimate (`k3`) against the policy scoring the hinted context (PRIME-RL's `opsd` "
        "stream), not the channel's full-vocabulary divergence (its options other than `teacher` and `ema_rate` "
        "are refused); not together with `teacher_distill`",
        frozenset({"teacher", "ema_rate"}),
    ),
    "teacher": Cell(
        LIMITS,
        "one teacher; each token a two-way distribution (the sampled token, the rest) from the teacher's "
        "log-prob of the sampled token, not its top-k (options other than `teachers`, `divergence`, `beta` and "
        "`deadline_s` are refused); not together with `hint_distill`",
        frozenset({"teachers", "divergence", "beta", "deadline_s"}),
    ),
}
SUPPORT_UPSTREAM: dict[str, Cell] = {
    **_COMMON,
    "hint": Cell(REFUSED, _UPSTREAM_REF.format(algo="opsd")),
    "teacher": Cell(REFUSED, _UPSTREAM_REF.format(algo="opd")),
}


@dataclass
class _StandInLossInputs:
    """Stand-in for ``prime_rl.trainer.rl.loss.LossInputs`` (same fields, order and defaults)."""

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor
    loss_weights: Tensor | None = field(default=None)


@dataclass
class _StandInLossOutputs:
    """Stand-in for ``prime_rl.trainer.rl.loss.LossOutputs``."""

    loss: Tensor
    metrics: dict[str, Tensor]


def _upstream_classes() -> tuple[type, type, bool]:
    if importlib.util.find_spec("prime_rl") is not None:
        try:
            from prime_rl.trainer.rl.loss import LossInputs as _LI
            from prime_rl.trainer.rl.loss import LossOutputs as _LO

            return _LI, _LO, True
        except Exception:  # prime_rl present but its trainer deps are not (e.g. no GPU stack)
            pass
    return _StandInLossInputs, _StandInLossOutputs, False


LossInputs, LossOutputs, USING_PRIME_RL = _upstream_classes()


def _tensor_metrics(metrics: Mapping[str, Any], device: torch.device) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for k, v in metrics.items():
        if isinstance(v, Tensor):
            t = v.detach()
            out[k] = t if t.dim() == 0 and t.dtype == torch.float32 else t.float().reshape(())
        else:
            out[k] = torch.tensor(float(v), device=device)
    return out


def loss_fn(
    inputs: Any,
    policy: str = "dppo",
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    hint_weight: float = 0.0,
    hint_estimator: str = "k3",
    teacher_weight: float = 0.0,
    teacher_divergence: str = "reverse_kl",
    teacher_beta: float = 0.5,
) -> Any:
    """Our composed loss for one PRIME-RL sample (see the module docstring for the contract).

    Args:
        inputs: a ``LossInputs`` (current layout, or the older one with ``teacher_logprobs``).
        policy: ``dppo`` (PRIME-RL's default loss), ``dapo``, ``cispo`` or ``gspo``.
        dppo_mask_low, dppo_mask_high, adv_tau, kl_tau: PRIME-RL's ``DefaultLossConfig`` knobs (``dppo``).
        epsilon_low, epsilon_high: clip range of ``dapo``/``gspo`` (``cispo`` caps the ratio at ``epsilon_high``).
        hint_weight: weight of the hint self-distillation term (0 = off).
        hint_estimator: ``k1``, ``k2`` or ``k3`` (per-token KL estimate from sampled-token log-probs).
        teacher_weight: weight of the ``teacher_distill`` term (0 = off): on-policy distillation from the
            sample's teacher stream (``teacher_logprobs``, else ``ref_logprobs``: the log-probs PRIME-RL's
            teacher gave the sampled tokens), each token a two-way distribution (the token, the rest):
            ``teacher_weight · Σ_t D(π‖teacher)`` (``kernels.teacher_topk.sampled_token_divergence``).
        teacher_divergence, teacher_beta: ``reverse_kl`` (default), ``forward_kl`` or ``jsd`` with its ``beta``.

    Returns:
        ``LossOutputs(loss, metrics)``: ``loss`` is the sample's summed token loss.
    """
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}", key="trainer.loss.kwargs.policy", valid=list(POLICIES))
    trainer = inputs.trainer_logprobs
    inference = inputs.inference_logprobs
    mask = inputs.loss_mask.bool()
    weights = getattr(inputs, "loss_weights", None)
    ref = getattr(inputs, "ref_logprobs", None)
    if ref is None:
        ref = getattr(inputs, "teacher_logprobs", None)
    adv = inputs.advantages
    if adv is None:  # distillation-only samples ship no advantages
        adv = torch.zeros_like(trainer)
    adv = adv.to(trainer.dtype)

    if policy == "dppo":
        out = F.dppo_kl_loss(
            trainer,
            inference,
            adv,
            mask,
            dppo_mask_low=dppo_mask_low,
            dppo_mask_high=dppo_mask_high,
            adv_tau=adv_tau,
            kl_tau=kl_tau,
            loss_weights=weights,
        )
        loss, metrics = out.loss, dict(out.metrics)
    else:
        # One sample as a batch of one; "dapo" aggregation with num_items_in_batch=1 is the token sum.
        out = F.policy_loss(
            trainer.unsqueeze(0),
            inference.unsqueeze(0),
            adv.unsqueeze(0),
            mask.unsqueeze(0),
            loss_type="cispo" if policy == "cispo" else "dapo",
            epsilon_low=epsilon_low,
            epsilon_high=epsilon_high,
            importance_sampling_level="sequence" if policy == "gspo" else "token",
            num_items_in_batch=1.0,
            importance_sampling_ratio=None if weights is None else weights.unsqueeze(0).to(trainer.dtype),
        )
        loss, metrics = out.loss, dict(out.metrics)

    if hint_weight:
        if ref is not None:
            kl = F.kl_estimate(trainer, ref.to(trainer.dtype), hint_estimator)  # type: ignore[arg-type]
            per_token = kl * mask.to(trainer.dtype)
            if weights is not None:
                per_token = per_token * weights
            hint = per_token.sum()
            loss = loss + hint_weight * hint
            metrics["hint/kl"] = hint.detach() / mask.sum().clamp(min=1)
            metrics["hint/skipped"] = 0.0
        else:
            metrics["hint/skipped"] = 1.0
    if teacher_weight:
        teacher = getattr(inputs, "teacher_logprobs", None)
        if teacher is None:
            teacher = getattr(inputs, "ref_logprobs", None)
        if teacher is not None:
            from composer_plugins.backends.surface import (
                TeacherTopKKernel,
                sampled_token_divergence,
                sampled_token_scored,
            )

            kernel = TeacherTopKKernel(teacher_divergence, teacher_beta)
            scored = mask.bool() & sampled_token_scored(teacher)
            per_token = sampled_token_divergence(trainer, teacher, kernel).to(trainer.dtype) * scored.to(trainer.dtype)
            if weights is not None:
                per_token = per_token * weights
            term = per_token.sum()
            loss = loss + teacher_weight * term
            metrics["teacher_distill/divergence"] = term.detach() / scored.sum().clamp(min=1)
            metrics["teacher_distill/nonfinite"] = (mask.bool() & ~sampled_token_scored(teacher)).sum().float()
            metrics["teacher_distill/skipped"] = 0.0
        else:
            metrics["teacher_distill/skipped"] = 1.0
    return LossOutputs(loss=loss, metrics=_tensor_metrics(metrics, trainer.device))


# ----------------------------------------------------------------------------------------------
# PRIME-RL's aggregation, for running the loss outside PRIME-RL (tests, local mode)
# ----------------------------------------------------------------------------------------------
def aggregate(
    samples: Sequence[Any], fn: Any = loss_fn, rl_scale: int | None = None, **kwargs: Any
) -> tuple[Tensor, dict[str, Tensor]]:
    """PRIME-RL's ``rl`` component: ``Σ_samples fn(sample).loss / rl_scale``, metrics stacked per sample.

    ``rl_scale`` defaults to the number of loss tokens in ``samples`` (PRIME-RL all-reduces it
    over ranks). Restates the ``rl`` branch of ``compute_loss`` in PRIME-RL's ``loss.py``.
    """
    if not samples:
        raise ValueError("no samples")
    scale = rl_scale if rl_scale is not None else int(sum(int(s.loss_mask.sum()) for s in samples))
    total = samples[0].trainer_logprobs.sum() * 0.0
    collected: dict[str, list[Tensor]] = {}
    for s in samples:
        res = fn(s, **kwargs)
        total = total + res.loss
        for k, v in res.metrics.items():
            collected.setdefault(k, []).append(v)
    metrics = {k: torch.stack(v) if v[0].dim() == 0 else torch.cat(v) for k, v in collected.items()}
    return total / max(scale, 1), metrics


def samples_from_batch(
    trainer_logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None = None,
    cls: type | None = None,
) -> list[Any]:
    """Split ``(B, T)`` tensors into per-sample ``LossInputs`` (padding dropped, as PRIME-RL's packing does)."""
    cls = cls or LossInputs
    out = []
    for i in range(trainer_logprobs.shape[0]):
        on = mask[i].nonzero().flatten()
        sl = slice(0, int(on[-1]) + 1 if on.numel() else 0)
        adv = advantages[i] if advantages.dim() == 2 else advantages[i].expand(trainer_logprobs.shape[1])
        kw = {
            "trainer_logprobs": trainer_logprobs[i, sl],
            "inference_logprobs": inference_logprobs[i, sl],
            "advantages": adv[sl],
            "loss_mask": mask[i, sl].bool(),
        }
        names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        ref = ref_logprobs[i, sl] if ref_logprobs is not None else None
        if "teacher_logprobs" in names:
            kw["teacher_logprobs"] = ref
        else:
            kw["ref_logprobs"] = ref
        out.append(cls(**kw))
    return out


# ----------------------------------------------------------------------------------------------
# the backend
# ----------------------------------------------------------------------------------------------
class PrimeRLBackend(Backend):
    """Run our channels with PRIME-RL's loss contract.

    ``mode="prime-rl"`` writes a PRIME-RL TOML (:meth:`toml`) and runs ``rl @ <toml>`` (needs
    prime-rl installed, vLLM and GPUs). ``mode="local"`` runs the same per-sample ``loss_fn`` in
    this process on CPU: HF ``generate`` plays the inference server (its log-probs are the
    ``inference_logprobs``), the config's env scores, group advantages are broadcast per token,
    failed samples are re-scored under the policy conditioned on the hint provider's hint
    (``ref_logprobs``, as PRIME-RL's ``opsd`` does), and :func:`aggregate` applies PRIME-RL's
    normalisation before a torch optimizer step.

    Loss kwargs come from the policy channel of ``config.losses`` (``loss_type``/its name picks
    ``policy``; ``dppo`` knobs pass through) and from ``hint_weight`` (the weight of an enabled hint
    channel: one whose class declares ``needs_teacher``); each channel is placed by what it declares.
    """

    name = "prime_rl"
    upstream = f"prime-rl @ git+https://github.com/PrimeIntellect-ai/prime-rl@{PRIME_RL_COMMIT}"
    runs_here = "the custom loss_fn on stand-in LossInputs, PRIME-RL's per-sample aggregation on the tiny model"
    needs_gpu = "`rl @ config.toml` (vLLM inference server + FSDP trainer; Python 3.12)"
    support: ClassVar[dict[str, Any]] = {"prime_rl:local": SUPPORT_LOCAL, "prime_rl:prime-rl": SUPPORT_UPSTREAM}

    def __init__(
        self,
        config: Any = None,
        overrides: Sequence[str] = (),
        *,
        output_dir: str | None = None,
        mode: str = "local",
        max_steps: int | None = None,
        model_name: str | None = None,
    ) -> None:
        super().__init__(config, overrides, output_dir=output_dir, max_steps=max_steps)
        if mode not in ("local", "prime-rl"):
            raise ConfigError(f"unknown mode {mode!r}", key="mode", valid=["local", "prime-rl"])
        self.mode = mode
        if mode == "prime-rl":
            refuse_own_sampling(self.config, self.src, "the prime_rl backend with mode='prime-rl' (its vLLM server)")
        self.model_name = model_name
        self.loss_kwargs = self._loss_kwargs()

    def _loss_kwargs(self) -> dict[str, Any]:
        """The loss kwargs of the enabled channels, each placed by what its class declares (never by its name):
        the channel reading the group advantages is the policy, the one needing a hinted teacher is the opsd
        stream, the one reading teachers' scores the teacher stream; any other is refused, located."""
        from composer_plugins.backends.surface import declared_channels

        support.check_channels(
            f"prime_rl:{self.mode}", self.config, self.src, type(self).support
        )  # refused here, never dropped later
        kwargs: dict[str, Any] = {}
        policies = []
        for ch in declared_channels(self.config, self.src):
            key, weight, kw = ch.key, ch.weight, ch.kwargs
            kind = ch.loss_type or ch.name
            if ch.is_policy and kind in POLICIES:
                policies.append(key)
                kwargs["policy"] = kind
                for k in ("dppo_mask_low", "dppo_mask_high", "adv_tau", "kl_tau", "epsilon_low", "epsilon_high"):
                    if k in kw:
                        kwargs[k] = kw[k]
            elif ch.needs_teacher:
                from composer_plugins.backends.surface import TEACHERS

                kwargs["hint_weight"] = float(weight)
                teacher, rate = kw.get("teacher", "live"), kw.get("ema_rate", 0.05)
                if teacher not in TEACHERS:
                    raise self.src.error(f"losses.{key}.teacher", f"unknown teacher {teacher!r}.", valid=TEACHERS)
                if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 < rate <= 1.0:
                    raise self.src.error(f"losses.{key}.ema_rate", f"must be a number in (0, 1], got {rate!r}.")
            elif ch.reads_teacher_scores:
                # PRIME-RL scores the sampled tokens with its own teacher: one stream, one teacher
                kwargs["teacher_weight"] = float(weight)
                kwargs["teacher_divergence"] = str(kw.get("divergence", "reverse_kl"))
                kwargs["teacher_beta"] = float(kw.get("beta", 0.5))
                if len(kw.get("teachers") or ()) > 1 or kw.get("min_agree"):
                    raise self.src.error(
                        f"losses.{key}",
                        "PRIME-RL hands the loss one teacher stream (its teacher's log-prob of each sampled "
                        "token): one teacher, no min_agree; run several teachers with the lightning backend.",
                    )
            else:
                raise self.src.error(
                    f"losses.{key}",
                    f"channel {ch.name!r} cannot run inside PRIME-RL's per-sample loss contract (it reads "
                    f"{', '.join(sorted(ch.inputs)) or 'nothing'}: full logits or preference pairs); disable it "
                    "for the prime_rl backend.",
                    valid=[*POLICIES, "a hint channel (needs_teacher)", "a channel reading teacher_scores"],
                )
        if kwargs.get("hint_weight") and kwargs.get("teacher_weight"):
            raise self.src.error(
                "losses",
                "hint_distill and teacher_distill would both read PRIME-RL's one reference/teacher stream; "
                "keep one of them live for the prime_rl backend.",
            )
        if len(policies) != 1:
            msg = (
                f"the prime_rl backend needs exactly one policy channel ({', '.join(POLICIES)}), found {len(policies)}"
            )
            raise self.src.error("losses", msg, valid=list(POLICIES))
        return kwargs

    # -- PRIME-RL run --------------------------------------------------------------------
    def toml(self) -> str:
        """A PRIME-RL ``rl`` config selecting our loss (model, batch, sampling and optimizer from the config)."""
        support.check_channels(
            "prime_rl:prime-rl", self.config, self.src, type(self).support
        )  # the TOML is the upstream run
        c = self.config
        model = self.model_name or c.model.name_or_path
        kw = "\n".join(f"{k} = {_toml_value(v)}" for k, v in self.loss_kwargs.items())
        return (
            f"# Generated by composer-plugins (backend prime_rl); PRIME-RL commit {PRIME_RL_COMMIT[:7]}.\n"
            f"max_steps = {c.trainer.max_steps}\n\n[model]\nname = {_toml_value(model)}\n\n"
            f"[orchestrator]\nbatch_size = {c.rollout.prompts_per_step * c.rollout.num_generations}\n"
            f"group_size = {c.rollout.num_generations}\n\n[orchestrator.train.sampling]\n"
            f"max_completion_tokens = {c.rollout.max_new_tokens}\ntemperature = {c.rollout.temperature}\n\n"
            f'[trainer.optim]\nlr = {c.optim.lr}\n\n[trainer.loss]\ntype = "custom"\n'
            f'import_path = "{IMPORT_PATH}"\n\n[trainer.loss.kwargs]\n{kw}\n'
        )

    def train(self) -> Any:
        """Train (see the class docstring); returns a :class:`~composer_plugins.training.runs.run.RunResult`."""
        if self.mode == "prime-rl":
            exe = shutil.which("rl")
            if importlib.util.find_spec("prime_rl") is None or exe is None:
                raise ComposerPluginsError(
                    "mode='prime-rl' needs prime-rl installed (Python 3.12, GPUs); see docs/backends.md#prime_rl. "
                    "Use mode='local' on this machine."
                )
            self.output_dir.mkdir(parents=True, exist_ok=True)
            path = self.output_dir / "prime_rl.toml"
            path.write_text(self.toml())
            subprocess.run([exe, "@", str(path)], check=True)
            return self.write_outputs([], {"prime_rl/exit_code": 0.0})
        return self._train_local()

    def _train_local(self) -> Any:
        from composer_plugins.backends.surface import Needs, assemble_inputs
        from composer_plugins.backends.surface import rollout as R

        # the config's channels give the hint provider, the EMA teacher (``teacher: ema``) and the teacher scorers
        run = R.LocalRun(self.config, self.src)
        policy = run.parts.step_policy()
        hinted, scoring = bool(self.loss_kwargs.get("hint_weight")), run.parts.teacher_scoring
        # PRIME-RL's loss reads the trainer's log-probs (with grad), the inference engine's and the opsd reference
        # (or, with a teacher channel, the teacher's log-prob of each sampled token: PRIME-RL's teacher_logprobs)
        ref_name = "hint_teacher_logprobs" if hinted else ("teacher_logprobs" if scoring else None)
        needs = Needs("logprobs", "inference_logprobs", *((ref_name,) if ref_name else ()))

        def loss_of(record: Any, step: int) -> tuple[Tensor, dict[str, Tensor]]:
            inputs, _ = assemble_inputs(record, needs, policy)
            inference = inputs["inference_logprobs"]
            adv = record.advantages.unsqueeze(-1).expand_as(inference)
            ref = inputs.get(ref_name) if ref_name else None
            samples = samples_from_batch(inputs["logprobs"], inference, adv, record.completion_mask, ref)
            loss, metrics = aggregate(samples, loss_fn, **self.loss_kwargs)
            return loss, {k: v.float().mean() for k, v in metrics.items() if v.numel()}

        return self.run_local(run, loss_of)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


__all__ = [
    "IMPORT_PATH",
    "POLICIES",
    "PRIME_RL_COMMIT",
    "USING_PRIME_RL",
    "LossInputs",
    "LossOutputs",
    "PrimeRLBackend",
    "aggregate",
    "loss_fn",
    "samples_from_batch",
]
