"""Hint self-distillation channel: the student learns, on its own tokens, what it would say with a hint.

The teacher is the *same model* run with the hint in its context, without gradient; the divergence between
the two next-token distributions is applied only where ``hint_mask`` is set (when both hidden states and
logits are present, the chunked hidden-state path is used). The input keys and the row alignment are in
docs/losses.md ("Input keys"); this channel divides both sides' logits by its temperature exactly once
(docs/losses.md, "Who divides by the temperature").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from composer_plugins.kernels.chunked import chunked_distill
from composer_plugins.kernels.divergences import STAT_NAMES, Kernel, make_kernel, with_topk
from composer_plugins.losses.base import LossChannel
from composer_plugins.losses.taid import TAIDScheduler

CRITERIA: tuple[str, ...] = ("jsd", "taid", "entropy_opd")
KERNELS: tuple[str, ...] = ("auto", "torch", "liger")
#: Whose weights run the teacher forward: the live policy, or its exponential moving average.
TEACHERS: tuple[str, ...] = ("live", "ema")


def liger_available() -> bool:
    """True when Liger-Kernel's fused linear JSD can be imported (the ``liger`` extra)."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss  # noqa: F401
    except ImportError:
        return False
    return True


class HintDistillChannel(LossChannel):
    """Hint self-distillation on the student's hinted-turn tokens (criterion jsd | taid | entropy_opd).

    The loss is the mean over ``hint_mask`` tokens of the per-token divergence. With ``taid`` the channel owns
    a :class:`TAIDScheduler` (saved in ``state_dict``) and steps it after each training forward unless
    ``auto_step=False``. ``teacher`` and ``ema_rate`` are read by the training loop, not by the loss
    (docs/training.md, "The hint teacher"); ``top_k`` is the old name of ``fkl_topk``, accepted with a
    deprecation warning. Every parameter and metric: docs/losses.md ("Channel parameters", "Top-k
    distillation with a tail bucket").
    """

    kind: ClassVar[str] = "hint"
    needs_teacher: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("hint_mask",)
    input_options: ClassVar[tuple[tuple[str, ...], ...]] = (
        ("student_hidden", "teacher_hidden", "lm_head_weight"),
        ("student_logits", "teacher_logits"),
    )

    def __init__(
        self,
        weight: float = 1.0,
        criterion: str = "jsd",
        beta: float = 0.5,
        temperature: float | None = None,
        chunk_size: int | None = None,
        t_start: float = 0.4,
        t_end: float = 1.0,
        alpha: float = 5e-4,
        taid_beta: float = 0.99,
        adaptive: bool = True,
        total_steps: int | None = None,
        auto_step: bool = True,
        entropy_threshold: float = 0.8,
        fkl_weight: float = 1.0,
        fkl_topk: int | None = None,
        grad_mode: str = "precompute",
        kernels: str = "auto",
        teacher: str = "live",
        ema_rate: float = 0.05,
        topk: int | None = None,
        is_clip: float | None = None,
        name: str | None = None,
        label: str | None = None,
        top_k: int | None = None,
    ) -> None:
        if top_k is not None:
            import warnings

            if fkl_topk is not None:
                raise ValueError("give fkl_topk only (top_k is its deprecated name)")
            warnings.warn(
                "hint_distill: top_k is deprecated, write fkl_topk (the entropy_opd forward-KL's teacher top-k); "
                "topk is the top-k + tail distillation",
                DeprecationWarning,
                stacklevel=2,
            )
            fkl_topk = top_k
        if teacher not in TEACHERS:
            raise ValueError(f"unknown hint_distill teacher {teacher!r}; valid: {', '.join(TEACHERS)}")
        if isinstance(ema_rate, bool) or not isinstance(ema_rate, int | float) or not 0.0 < ema_rate <= 1.0:
            raise ValueError(f"ema_rate must be a number in (0, 1], got {ema_rate!r} (SDPO's is 0.05)")
        if kernels not in KERNELS:
            raise ValueError(f"unknown hint_distill kernels {kernels!r}; valid: {', '.join(KERNELS)}")
        if kernels == "liger":
            if criterion != "jsd":
                raise ValueError(
                    f"hint_distill kernels='liger' fuses the jsd criterion only, not {criterion!r}; "
                    "use kernels: auto or torch"
                )
            if not liger_available():
                raise ImportError(
                    "hint_distill kernels='liger' needs Liger-Kernel: pip install 'composer-plugins[liger]'"
                )
        if grad_mode not in ("recompute", "precompute"):
            raise ValueError(f"unknown grad_mode {grad_mode!r}; valid: 'recompute', 'precompute'")
        if criterion not in CRITERIA:
            raise ValueError(f"unknown hint_distill criterion {criterion!r}; valid: {', '.join(CRITERIA)}")
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if temperature is not None and not float(temperature) > 0:
            raise ValueError(f"temperature must be > 0 (or null: the sampling temperature), got {temperature}")
        if chunk_size is not None and int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1 (or null: chosen from the vocabulary), got {chunk_size}")
        if fkl_topk is not None and fkl_topk < 1:
            raise ValueError(f"fkl_topk must be >= 1 or None, got {fkl_topk}")
        if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
            raise ValueError(
                f"topk must be an integer >= 1 (e.g. 100, as SDPO) or null for the full vocabulary, got {topk!r}"
            )
        if is_clip is not None and not float(is_clip) > 0:
            raise ValueError(f"is_clip must be > 0 (e.g. 2, as SDPO) or null to switch it off, got {is_clip!r}")
        if kernels == "liger" and topk is not None:
            raise ValueError(
                "hint_distill kernels='liger' computes the full-vocabulary jsd; topk needs the project's "
                "kernels: use kernels: auto or torch"
            )
        super().__init__(weight=weight, name=label or name or "hint_distill")
        self.criterion = criterion
        self.beta = float(beta)
        self.temperature = None if temperature is None else float(temperature)
        self.chunk_size = None if chunk_size is None else int(chunk_size)
        self.auto_step = bool(auto_step)
        self.entropy_threshold = float(entropy_threshold)
        self.fkl_weight = float(fkl_weight)
        self.fkl_topk = fkl_topk
        self.grad_mode = grad_mode
        self.kernels = kernels
        self.teacher = teacher
        self.ema_rate = float(ema_rate)
        self.topk = topk
        self.is_clip = None if is_clip is None else float(is_clip)
        self.scheduler: TAIDScheduler | None = None
        if criterion == "taid":
            self.scheduler = TAIDScheduler(
                t_start=t_start, t_end=t_end, alpha=alpha, beta=taid_beta, adaptive=adaptive, total_steps=total_steps
            )

    def distill_temperature(self, inputs: Mapping[str, Any] | None = None) -> float:
        """The temperature both sides' logits are divided by: the channel's, else ``sampling_temperature``, else 1."""
        if self.temperature is not None:
            return self.temperature
        t = self.get("sampling_temperature", inputs or {}, default=1.0)
        t = float(t.item()) if isinstance(t, Tensor) else float(t)
        if not t > 0:
            raise ValueError(f"hint_distill: sampling_temperature must be > 0, got {t}")
        return t

    def kernel(self, temperature: float | None = None) -> Kernel:
        """The per-token divergence at the current state (TAID: the current ``t``), top-k wrapped with ``topk``,
        at ``temperature`` (default: :meth:`distill_temperature` without inputs)."""
        temp = self.distill_temperature() if temperature is None else float(temperature)
        # with topk the wrapper applies the temperature to the vocabulary logits before the top-k
        tau = 1.0 if self.topk is not None else temp
        if self.criterion == "jsd":
            params: dict[str, Any] = {"beta": self.beta}
        elif self.criterion == "taid":
            assert self.scheduler is not None
            params = {"t": self.scheduler.value}
        else:
            params = {
                "entropy_threshold": self.entropy_threshold,
                "fkl_weight": self.fkl_weight,
                "top_k": self.fkl_topk,
            }
        return with_topk(make_kernel(self.criterion, temperature=tau, **params), self.topk, temp)

    def required_inputs(self) -> tuple[str, ...]:
        """``hint_mask``, plus the policy's ``logprobs`` of the sampled tokens when ``is_clip`` weighs by them
        (the policy-gradient channel asks for them too; SDPO proper runs without it)."""
        return (*self.requires, "logprobs") if self.is_clip is not None else tuple(self.requires)

    def importance_weights(self, mask: Tensor, inputs: Mapping[str, Any]) -> tuple[Tensor | None, dict[str, Any]]:
        """SDPO's distillation IS weight on the hinted tokens: ``min(exp(clamp(lp - lp_old, ±20)), is_clip)``, detached.

        ``lp_old`` is ``inference_logprobs``, else ``old_logprobs``, else ``lp`` (docs/losses.md, "IS clip").
        ``(None, {})`` when ``is_clip`` is off.
        """
        if self.is_clip is None:
            return None, {}
        g = self.get
        lp = g("logprobs", inputs)
        if lp is None:
            raise ValueError(
                f"hint_distill is_clip={self.is_clip} needs the current policy's per-token 'logprobs' of the "
                "sampled tokens in the inputs (this backend provides none); set is_clip: null"
            )
        old = g("inference_logprobs", inputs)
        if old is None:
            old = g("old_logprobs", inputs)
        rows = g("hint_rows", inputs)
        lp = lp.detach()
        old = lp if old is None else old.detach()
        if rows is not None:
            rows = torch.as_tensor(rows, device=lp.device, dtype=torch.long)
            lp, old = lp.index_select(0, rows), old.index_select(0, rows)
        if tuple(lp.shape) != tuple(mask.shape) or tuple(old.shape) != tuple(mask.shape):
            raise ValueError(
                f"hint_distill is_clip: logprobs {tuple(lp.shape)} and behaviour log-probs {tuple(old.shape)} "
                f"(after hint_rows) must match hint_mask {tuple(mask.shape)}"
            )
        dt = torch.promote_types(lp.dtype, torch.float32)
        ratio = torch.exp((lp.to(dt) - old.to(dt)).clamp(min=-20.0, max=20.0))
        w = ratio.clamp(max=self.is_clip)
        m = mask.float()
        n = m.sum().clamp(min=1.0)
        metrics = {
            "is_ratio": (ratio * m).sum() / n,
            "is_weight": (w * m).sum() / n,
            "is_clipped": ((ratio > self.is_clip).float() * m).sum() / n,
        }
        return w, metrics

    def forward(self, inputs: Mapping[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        g = self.get
        mask = g("hint_mask", inputs).bool()
        temperature = self.distill_temperature(inputs)
        kernel = self.kernel(temperature)
        want_stats = bool(STAT_NAMES[self.criterion])
        s_hidden = g("student_hidden", inputs)
        t_hidden = g("teacher_hidden", inputs)
        weight = g("lm_head_weight", inputs)
        n_tokens = mask.sum()
        metrics: dict[str, Any] = {"tokens": n_tokens.detach()}
        if self.criterion == "taid":
            assert self.scheduler is not None
            metrics["taid_t"] = self.scheduler.value
        tok_w, is_metrics = self.importance_weights(mask, inputs)
        metrics.update(is_metrics)
        uniform = tok_w is None or bool((tok_w[mask] == 1).all())
        hidden_path = s_hidden is not None and t_hidden is not None and weight is not None
        if hidden_path and uniform and self._use_liger(s_hidden):
            metrics["chunked"] = 1.0
            metrics["liger"] = 1.0
            loss = self._liger_jsd(s_hidden, t_hidden, weight, mask, g("teacher_lm_head_weight", inputs), temperature)
            stats = None
        elif hidden_path:
            metrics["chunked"] = 1.0
            res = chunked_distill(
                s_hidden,
                t_hidden,
                weight,
                kernel,
                mask,
                teacher_lm_head_weight=g("teacher_lm_head_weight", inputs),
                chunk_size=self.chunk_size,
                reduction="batchmean",
                return_stats=want_stats,
                grad_mode=self.grad_mode,
                token_weight=None if uniform else tok_w,
            )
            loss, stats = res if isinstance(res, tuple) else (res, None)
        else:
            metrics["chunked"] = 0.0
            s_logits = g("student_logits", inputs)
            t_logits = g("teacher_logits", inputs)
            if s_logits.shape != t_logits.shape or tuple(mask.shape) != tuple(s_logits.shape[:-1]):
                raise ValueError(
                    f"hint_distill: student_logits {tuple(s_logits.shape)}, teacher_logits {tuple(t_logits.shape)} "
                    f"and hint_mask {tuple(mask.shape)} must agree as (B, T, V) / (B, T)"
                )
            zs = s_logits[mask]
            zt = t_logits.detach()[mask]
            per_token = kernel.value(zs, zt)
            if not uniform:
                assert tok_w is not None
                per_token = per_token * tok_w[mask].to(per_token.dtype)
            loss = per_token.sum() / max(per_token.shape[0], 1)
            stats = None
            if want_stats:
                with torch.no_grad():
                    stats = kernel.stats(zs.detach(), zt)
        if int(n_tokens) == 0:
            metrics["empty"] = 1.0
            return loss, metrics
        metrics["empty"] = 0.0
        n_global = g("hint_tokens_in_batch", inputs)
        if n_global is not None:  # data parallel: the mean over every rank's hinted tokens (÷ world size)
            loss = loss * (n_tokens.to(loss.dtype) / max(float(n_global), 1.0))
        if stats is not None and stats.shape[1]:
            means = stats.float().mean(0)
            for i, key in enumerate(STAT_NAMES[self.criterion]):
                metrics[key] = means[i]
        if self.criterion == "taid" and self.training and self.auto_step:
            assert self.scheduler is not None
            delta = self.scheduler.step(
                loss.detach(),
                global_step=_as_int(g("global_step", inputs)),
                total_steps=_as_int(g("total_steps", inputs)),
            )
            metrics["taid_delta_t"] = delta
        return loss, metrics

    def _use_liger(self, hidden: Tensor) -> bool:
        if self.criterion != "jsd" or self.kernels == "torch" or self.topk is not None:
            return False
        if self.kernels == "liger":
            return True
        return hidden.is_cuda and liger_available()

    def _liger_jsd(
        self,
        s_hidden: Tensor,
        t_hidden: Tensor,
        weight: Tensor,
        mask: Tensor,
        t_weight: Tensor | None,
        temperature: float,
    ) -> Tensor:
        """Liger's fused linear generalised JSD over the masked tokens: the same token mean as the jsd kernel.

        Liger's ``beta`` and ``temperature`` mean what TRL's ``generalized_jsd`` (and this channel)
        mean; with ``weight_hard_loss=0`` and every selected token valid, its loss is the sum of
        per-token divergences over the number of tokens (checked against the chunked kernel in
        ``tests/losses``).
        """
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        s_rows = s_hidden[mask]
        if s_rows.shape[0] == 0:
            return (s_hidden.sum() * 0.0).float()
        t_rows = t_hidden.detach()[mask]
        tw = (t_weight if t_weight is not None else weight).detach()
        fn = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0,
            weight_soft_loss=1.0,
            beta=self.beta,
            temperature=temperature,
            compiled=s_rows.is_cuda,
            chunk_size=self.chunk_size or 1024,
        )
        labels = torch.zeros(s_rows.shape[0], dtype=torch.long, device=s_rows.device)  # all valid (CE is off)
        return fn(s_rows, weight, t_rows, tw, labels)

    def extra_repr(self) -> str:
        extra = "" if self.topk is None else f", topk={self.topk}"
        extra += "" if self.is_clip is None else f", is_clip={self.is_clip}"
        return f"{super().extra_repr()}, criterion={self.criterion!r}, teacher={self.teacher!r}{extra}"


def _as_int(v: Any) -> int | None:
    if v is None:
        return None
    return int(v.item()) if isinstance(v, Tensor) else int(v)
