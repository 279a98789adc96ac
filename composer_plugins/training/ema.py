"""The EMA self-teacher: a frozen exponential moving average of the policy's weights (SDPO's teacher).

:class:`EMATeacher` holds a second instance of the policy (the same config and architecture, its own
parameter tensors, ``requires_grad`` off, eval mode) and runs the hint teacher's forward with them.
It is a submodule of the training module, so:

* its weights are in the module's ``state_dict``: Lightning saves them in every checkpoint and a
  resume restores them exactly (DiLoCo replicas checkpoint their module, so it is per replica);
* data parallel (DDP) ignores it for gradients (nothing requires grad) and every rank applies the
  same update to the same weights, so the ranks' copies stay equal;
* under FSDP it is an FSDP unit of its own with its decoder layers nested units (the project's
  FSDP wrap policy lists :class:`EMATeacher`), so its parameters are sharded exactly as the policy's:
  each rank updates its shard from the policy's shard, and its forward gathers them as the policy's does.

Why a second module instance rather than ``torch.func.functional_call`` with a dict of EMA tensors:
the memory is the same (one more copy of the weights; buffers such as rotary frequencies are
tiny), but a module is checkpointed, moved to the device, and sharded by FSDP with no extra code,
and its forward is the decoder's ordinary forward (FSDP units gather their shards in their own
forward; ``functional_call`` cannot substitute the flat shards FSDP holds).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

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
        from composer_plugins.models.logprobs import completion_hidden, lm_head_weight

        hidden = completion_hidden(
            self.policy,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            completion_attention_mask=completion_attention_mask,
            micro_batch_size=micro_batch_size,
        )
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
def ema_update(pairs: Iterable[tuple[Tensor, Tensor]], rate: float) -> None:
    """``teacher ← (1 − rate)·teacher + rate·policy`` in place, for every pair (a no-op copy at rate 1)."""
    teachers, sources = [], []
    for t, s in pairs:
        if t.numel() and t.dtype != s.dtype:  # a teacher in the compute dtype: one tensor cast at a time
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
