"""The TAID interpolation schedule (Shing et al., "TAID: Temporally Adaptive Interpolated Distillation", ICLR 2025).

Semantics follow SakanaAI/TAID ``src/distil_losses/taid.py`` (``TAID.update_t``, commit
a0628922c16169d1fca10ddf61849e0693289cf8); the update rule and the one deliberate difference (a non-finite
loss leaves ``prev_loss`` and ``momentum`` untouched and takes ``t = min(t_end, max(t, t_target))``) are in
docs/losses.md ("Distillation"). All state lives in float32/int64 buffers, so ``state_dict()`` resumes the
schedule exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class TAIDScheduler(nn.Module):
    """Adaptive (momentum-driven) or deterministic (linear) schedule of TAID's interpolation ``t``.

    Requires ``0 ≤ t_start < 1``, ``0 < t_end ≤ 1`` and ``0 ≤ alpha ≤ 1`` (defaults: upstream's);
    ``adaptive=False`` is upstream's ``disable_adaptive``; ``total_steps`` (the steps the linear target spans)
    may also be passed to :meth:`step`.
    """

    t: Tensor
    prev_loss: Tensor
    momentum: Tensor
    num_steps: Tensor

    def __init__(
        self,
        t_start: float = 0.4,
        t_end: float = 1.0,
        alpha: float = 5e-4,
        beta: float = 0.99,
        adaptive: bool = True,
        total_steps: int | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= t_start < 1.0:
            raise ValueError(f"TAID t_start must be in [0, 1), got {t_start}")
        if not 0.0 < t_end <= 1.0:
            raise ValueError(f"TAID t_end must be in (0, 1], got {t_end}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"TAID alpha must be in [0, 1], got {alpha}")
        if total_steps is not None and total_steps <= 0:
            raise ValueError(f"TAID total_steps must be > 0, got {total_steps}")
        self.t_start = float(t_start)
        self.t_end = float(t_end)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.adaptive = bool(adaptive)
        self.total_steps = total_steps
        self.register_buffer("t", torch.tensor(self.t_start, dtype=torch.float32))
        self.register_buffer("prev_loss", torch.tensor(float("inf"), dtype=torch.float32))
        self.register_buffer("momentum", torch.zeros((), dtype=torch.float32))
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.int64))

    @property
    def value(self) -> float:
        """The current interpolation ``t`` as a Python float."""
        return float(self.t.item())

    def target(self, global_step: int, total_steps: int) -> float:
        """The linear target ``t_start + (t_end - t_start) · global_step / total_steps``."""
        return self.t_start + (self.t_end - self.t_start) * (global_step / total_steps)

    @torch.no_grad()
    def step(self, loss: Tensor | float, global_step: int | None = None, total_steps: int | None = None) -> float:
        """Update ``t`` after a loss evaluation; returns the adaptive increment (0.0 on the first call).

        ``global_step`` defaults to the number of previous ``step`` calls; ``total_steps`` to the
        value given at construction.
        """
        total = total_steps if total_steps is not None else self.total_steps
        if total is None or int(total) <= 0:
            raise ValueError(
                "TAIDScheduler needs total_steps (> 0): pass total_steps= to the scheduler / hint_distill channel, "
                "or 'total_steps' in the channel inputs"
            )
        gs = int(self.num_steps.item()) if global_step is None else int(global_step)
        self.num_steps += 1
        loss_t = torch.as_tensor(loss, dtype=torch.float32, device=self.t.device).detach().reshape(())
        if torch.isinf(self.prev_loss):
            if torch.isfinite(loss_t):
                self.prev_loss.copy_(loss_t)
            return 0.0
        t_target = self.target(gs, int(total))
        if not bool(torch.isfinite(loss_t)):
            self.t.copy_(torch.tensor(min(self.t_end, max(self.value, t_target)), dtype=torch.float32))
            return 0.0
        relative_change = (self.prev_loss - loss_t) / (self.prev_loss + 1e-15)
        self.momentum.copy_(self.beta * self.momentum + (1 - self.beta) * relative_change)
        delta_t = self.alpha * torch.sigmoid(self.momentum) * (1 - self.t)
        if self.adaptive:
            cand = self.t + delta_t
            new_t = cand if bool(cand > t_target) else torch.tensor(t_target, dtype=torch.float32)
            if self.t_end < float(new_t):
                new_t = torch.tensor(self.t_end, dtype=torch.float32)
        else:
            new_t = torch.tensor(t_target, dtype=torch.float32)
        self.t.copy_(new_t)
        self.prev_loss.copy_(loss_t)
        d = float(delta_t)
        return d if math.isfinite(d) else 0.0

    def extra_repr(self) -> str:
        return (
            f"t={self.value:.4f}, t_start={self.t_start}, t_end={self.t_end}, alpha={self.alpha}, "
            f"beta={self.beta}, adaptive={self.adaptive}, total_steps={self.total_steps}"
        )
