"""The EMA self-teacher: a frozen exponential moving average of the policy's weights (SDPO's teacher).

:class:`EMATeacher` is a second instance of the policy held as a submodule, so it is checkpointed, moved and
sharded by FSDP (as a unit of its own) with no extra code. Why a module rather than ``functional_call``: see
docs/training.md "The hint teacher: live or EMA".
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from composer_plugins.models.logprobs import completion_hidden, lm_head_weight

#: What FSDP inserts into the parameter names of wrapped modules.
_FSDP_PREFIX = "_fsdp_wrapped_module."


class EMATeacher(nn.Module):
    """A frozen copy of ``policy`` whose weights follow the policy by ``teacher ← (1 − rate)·teacher + rate·policy``.

    Args:
        policy: the policy at train start (deep-copied; the copy's parameters are frozen).
        rate: the EMA rate in (0, 1] (1.0: the teacher is the policy of the last optimizer step).
        copy_policy: False to adopt ``policy`` itself (an independent copy the caller made).
        dtype: the teacher's weights' dtype (or its name; the run's compute dtype, e.g. ``bfloat16`` under
            ``bf16-mixed``: half the memory of an fp32 copy); ``None``: the policy's.
    """

    def __init__(
        self, policy: nn.Module, rate: float, *, copy_policy: bool = True, dtype: torch.dtype | str | None = None
    ) -> None:
        super().__init__()
        if not 0.0 < float(rate) <= 1.0:
            raise ValueError(f"ema_rate must be in (0, 1], got {rate!r}")
        self.rate = float(rate)
        self.policy = copy.deepcopy(policy) if copy_policy else policy
        for p in self.policy.parameters() if dtype is not None else ():  # buffers (rotary frequencies) stay
            p.data = p.data.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        for p in self.policy.parameters():
            p.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> EMATeacher:
        """Always eval mode (no dropout in the teacher), whatever the trainer sets on the parent module."""
        return super().train(False)

    @torch.no_grad()
    def forward(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
        completion_attention_mask: Tensor | None = None,
        micro_batch_size: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Teacher hidden states on the completion tokens and the teacher's LM head weight (detached).

        Under FSDP the head is copied: FSDP frees the gathered parameters after the forward.
        """
        ids = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        kw = {"completion_attention_mask": completion_attention_mask, "micro_batch_size": micro_batch_size}
        hidden = completion_hidden(self.policy, *ids, **kw)
        head = lm_head_weight(self.policy).detach()
        sharded = any(getattr(p, "_fsdp_flattened", False) for p in self.parameters())  # FSDP's, or its units'
        return hidden, head.clone() if sharded else head


def ema_pairs(model: nn.Module, teacher_key: str, policy_key: str) -> list[tuple[Tensor, Tensor]]:
    """``(teacher parameter, policy parameter)`` pairs of ``model``, matched by name.

    ``model`` is the module that holds both (or the FSDP-wrapped one: FSDP's name prefixes are
    dropped, and with ``use_orig_params`` each parameter is this rank's shard of it, so the pairs are
    shard to shard). Tied weights appear once, so none is updated twice. ``teacher_key`` and
    ``policy_key`` are the attribute paths of the two copies, e.g. ``"ema_teacher.policy"`` and ``"policy"``.
    """
    named = {n.replace(_FSDP_PREFIX, ""): p for n, p in model.named_parameters()}
    t_pre, p_pre = teacher_key + ".", policy_key + "."
    pairs = []
    for name, t in named.items():
        if not name.startswith(t_pre):
            continue
        src = named.get(p_pre + name[len(t_pre) :])
        if src is None or src.shape != t.shape:
            got = None if src is None else tuple(src.shape)
            raise RuntimeError(
                f"EMA teacher parameter {name} has no policy counterpart of shape {tuple(t.shape)} "
                f"({p_pre + name[len(t_pre) :]}: {got}); the teacher must be a copy of the policy, sharded as it is"
            )
        pairs.append((t, src))
    if not pairs:
        raise RuntimeError(f"no parameters under {teacher_key!r} in {type(model).__name__}")
    return pairs


@torch.no_grad()
def ema_update(pairs: Iterable[tuple[Tensor, Tensor]], rate: float, salt: int = 0) -> None:
    """``teacher ← (1 − rate)·teacher + rate·policy`` in place, for every pair (a no-op copy at rate 1).

    A bf16 teacher is updated in fp32 and rounded back stochastically (:func:`_dithered_bf16`; ``salt``, e.g. the
    optimizer step, varies the rounding from one update to the next), so updates below half a bf16 step are not lost.
    """
    teachers, sources = [], []
    for t, s in pairs:
        if t.numel() and t.dtype == torch.bfloat16 != s.dtype:  # a bf16 teacher: fp32 math, one tensor at a time
            t.copy_(_dithered_bf16(t.float().lerp_(s.detach().float(), float(rate)), s.detach(), salt))
        elif t.numel() and t.dtype != s.dtype:
            t.lerp_(s.detach().to(t.dtype), float(rate))
        elif t.numel():
            teachers.append(t)
            sources.append(s.detach())
    if not teachers:
        return
    if rate == 1.0:
        torch._foreach_copy_(teachers, sources)
    else:
        torch._foreach_lerp_(teachers, sources, float(rate))


#: murmur3's 32-bit finaliser: (shift, multiplier) rounds.
_MIX = ((16, 0x85EBCA6B), (13, 0xC2B2AE35))


def _dithered_bf16(x: Tensor, src: Tensor, salt: int = 0) -> Tensor:
    """``x`` (fp32) rounded to bf16 stochastically: unbiased, so updates below half a bf16 step still accumulate.

    The 16 dropped bits get a pseudo-random carry hashed from the value, the policy's bits (``src``) and ``salt``:
    no RNG stream is consumed and a resumed run rounds exactly as the uninterrupted one did.
    """
    bits = x.view(torch.int32)
    k = salt & 0xFFFFFFFF
    for shift, mul in _MIX:  # the salt mixed first: consecutive salts must not give correlated carries
        k = ((k ^ (k >> shift)) * mul) & 0xFFFFFFFF
    h = bits ^ src.float().view(torch.int32).bitwise_left_shift(16) ^ (k - (1 << 32) * (k >> 31))
    for shift, mul in _MIX:  # as int32 (wrapping products; logical shifts by masking)
        h = (h ^ h.bitwise_right_shift(shift).bitwise_and((1 << (32 - shift)) - 1)) * (mul - (1 << 32))
    noise = (h ^ h.bitwise_right_shift(16)).bitwise_and(0xFFFF)
    return (bits + noise).bitwise_and(-65536).view(torch.float32).to(torch.bfloat16)


def compute_dtype(precision: str) -> str | None:
    """What a Lightning ``precision`` computes in: ``bfloat16`` (``bf16-*``), ``float16`` (``16-*``), else ``None``."""
    p = str(precision)
    return "bfloat16" if p.startswith("bf16") else "float16" if p.startswith("16") else None


def teacher_from(channels: Iterable[Any]) -> tuple[str, float]:
    """The ``(teacher, ema_rate)`` setting of the live teacher-needing channels (``("live", 0)`` if none set it).

    Two hint channels that ask for different teachers are refused: one teacher forward serves them all.
    """
    found: set[tuple[str, float]] = set()
    for c in channels:
        if getattr(c, "needs_teacher", False) and getattr(c, "weight", 1.0) != 0.0:
            kind = str(getattr(c, "teacher", "live"))
            found.add((kind, float(getattr(c, "ema_rate", 0.0)) if kind == "ema" else 0.0))
    if len(found) > 1:
        raise ValueError(
            f"the hint channels ask for different teachers {sorted(found)}; give them the same teacher and ema_rate"
        )
    return found.pop() if found else ("live", 0.0)
