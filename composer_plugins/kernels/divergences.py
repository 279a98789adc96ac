"""Per-token distillation divergences over a block of rows, with closed-form gradients.

Each kernel maps student logits ``zs`` ``(n, V)`` and teacher logits ``zt`` ``(n, V)`` to a
per-token loss ``(n,)`` (float32, or float64 for float64 inputs). Two implementations:

* :meth:`Kernel.value` — plain tensor code, differentiable with respect to ``zs`` by autograd;
  the materialised reference path uses it.
* :meth:`Kernel.compute` — the chunked path's implementation: the same values and, optionally,
  ``grad_out[:, None] · dloss/dzs`` in closed form, computed **in place** in the buffers of ``zs``
  and ``zt`` (which it consumes) with row-wise dot products instead of product temporaries, so a
  chunk costs ~3–4 ``(n, V)`` buffers instead of the ~12 autograd keeps alive.

The two are checked against each other (values and gradients) in ``tests/losses``.
The teacher side is never differentiated: kernels treat ``zt`` as a constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

#: Names of the per-token statistics a kernel reports (columns of ``stats``).
STAT_NAMES: dict[str, tuple[str, ...]] = {
    "jsd": (),
    "taid": (),
    "entropy_opd": ("teacher_entropy", "high_entropy", "reverse_kl", "forward_kl"),
}

Computed = tuple[Tensor, Tensor | None, Tensor | None]


def _up(z: Tensor) -> Tensor:
    """Upcast half-precision logits to float32 (float32/float64 are kept)."""
    return z if z.dtype in (torch.float32, torch.float64) else z.float()


def _scaled(z: Tensor, temperature: float) -> Tensor:
    z = _up(z)
    return z / temperature if temperature != 1.0 else z


def _log_softmax_(z: Tensor, temperature: float = 1.0) -> Tensor:
    """In-place ``log_softmax(z / temperature)`` (``z`` must be owned by the caller)."""
    if temperature != 1.0:
        z.div_(temperature)
    return z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))


def _log_softmax_probs_(z: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """In-place ``log_softmax(z / temperature)`` and its probabilities, with one ``exp`` per element.

    ``(log-probs in z's buffer, probabilities in a new buffer)``; ``z`` must be owned by the caller.
    """
    if temperature != 1.0:
        z.div_(temperature)
    mx = z.amax(-1, keepdim=True)
    z.sub_(torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)))
    p = z.exp()
    total = p.sum(-1, keepdim=True)
    p.div_(total)
    return z.sub_(total.log_()), p


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for 2-D inputs without materialising the product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(a.shape[0])


def _scale_grad_(g: Tensor, grad_out: Tensor, dtype: torch.dtype, tau: float) -> None:
    """``g *= grad_out[:, None] / tau`` in place (the chain rule through the temperature)."""
    scale = grad_out.to(dtype).unsqueeze(-1)
    g.mul_(scale / tau if tau != 1.0 else scale)


def _no_stats(val: Tensor, with_stats: bool) -> Tensor | None:
    """The ``(n, 0)`` stats of a kernel that reports none (``None`` when not asked for)."""
    return val.new_zeros((val.shape[0], 0)) if with_stats else None


def _own(z: Tensor) -> Tensor:
    """A float32/64 tensor the kernel may overwrite (copies only when it must)."""
    d = z.detach()
    up = _up(d)
    return up if up is not d else d.clone()  # detach() shares storage: copy unless the upcast already did


class Kernel:
    """A per-token divergence. Subclasses implement ``value`` and ``compute``."""

    name: str = ""

    def value(self, zs: Tensor, zt: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def stats(self, zs: Tensor, zt: Tensor) -> Tensor:
        """Per-token statistics ``(n, k)`` reported as metrics (k may be 0)."""
        return zs.new_zeros((zs.shape[0], 0), dtype=_up(zs).dtype)

    def compute(self, zs: Tensor, zt: Tensor, grad_out: Tensor | None = None, with_stats: bool = False) -> Computed:
        """``(value, grad or None, stats or None)``; may overwrite ``zs`` and ``zt``.

        Generic fallback through autograd; subclasses override it with closed forms.
        """
        st = self.stats(zs, zt) if with_stats else None
        if grad_out is None:
            with torch.no_grad():
                return self.value(zs, zt), None, st
        with torch.enable_grad():
            z = _up(zs.detach()).requires_grad_(True)
            v = self.value(z, zt.detach())
            (g,) = torch.autograd.grad(v, z, grad_out.to(v.dtype))
        return v.detach(), g, st

    def value_and_grad(self, zs: Tensor, zt: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token loss and ``grad_out[:, None] · dloss/dzs`` (inputs left untouched)."""
        v, g, _ = self.compute(_own(zs), _own(zt), grad_out)
        assert g is not None
        return v, g


@dataclass
class JSDKernel(Kernel):
    """Generalised JSD of Agarwal et al. (GKD, Eq. 1), TRL ``GKDTrainer.generalized_jsd_loss`` semantics.

    ``beta == 0``: forward KL(teacher‖student); ``beta == 1``: reverse KL(student‖teacher);
    otherwise ``beta·KL(teacher‖M) + (1-beta)·KL(student‖M)`` with ``M = (1-beta)·student + beta·teacher``.
    """

    beta: float = 0.5
    temperature: float = 1.0
    name: str = "jsd"

    def value(self, zs: Tensor, zt: Tensor) -> Tensor:
        s = torch.log_softmax(_scaled(zs, self.temperature), dim=-1)
        t = torch.log_softmax(_scaled(zt, self.temperature), dim=-1)
        b = self.beta
        if b == 0:
            return (t.exp() * (t - s)).sum(-1)
        if b == 1:
            return (s.exp() * (s - t)).sum(-1)
        m = torch.logaddexp(s + math.log1p(-b), t + math.log(b))
        return b * (t.exp() * (t - m)).sum(-1) + (1 - b) * (s.exp() * (s - m)).sum(-1)

    def compute(self, zs: Tensor, zt: Tensor, grad_out: Tensor | None = None, with_stats: bool = False) -> Computed:
        tau, b = self.temperature, self.beta
        if 0 < b < 1:
            return self._compute_mixed(zs, zt, grad_out, with_stats)
        s = _log_softmax_(_up(zs), tau)
        t = _log_softmax_(_up(zt), tau)
        g: Tensor | None = None
        if b == 0:
            q = t.exp()
            val = _rowdot(q, t.sub_(s))  # Σ q (t - s)
            if grad_out is not None:
                g = s.exp_().sub_(q)  # d/dz KL(q‖p) = p - q
        elif b == 1:
            p = s.exp()
            d = s.sub_(t)  # s - t
            val = _rowdot(p, d)
            if grad_out is not None:
                g = d.sub_(val.unsqueeze(-1)).mul_(p)  # p (d - <p, d>)
        if g is not None and grad_out is not None:
            _scale_grad_(g, grad_out, val.dtype, tau)
        return val, g, _no_stats(val, with_stats)

    def _compute_mixed(self, zs: Tensor, zt: Tensor, grad_out: Tensor | None, with_stats: bool) -> Computed:
        """``0 < beta < 1`` with three transcendentals per element: one exp per side, one log for M.

        ``log M = log((1-b) p + b q)`` (the logaddexp of the log-probs would cost an exp and a log1p
        more). Where both p and q underflow, M is floored at the smallest normal float: those
        entries carry p = q = 0 into every sum below.
        """
        tau, b = self.temperature, self.beta
        s, p = _log_softmax_probs_(_up(zs), tau)
        t, q = _log_softmax_probs_(_up(zt), tau)
        m = torch.mul(q, b).add_(p, alpha=1 - b).clamp_min_(torch.finfo(p.dtype).tiny).log_()
        kt = _rowdot(q, t.sub_(m))  # Σ q (t - m)
        del q, t
        sm = s.sub_(m)  # s - m
        del m
        ks = _rowdot(p, sm)
        val = b * kt + (1 - b) * ks
        g: Tensor | None = None
        if grad_out is not None:
            # dL/dp = (1-b)(s - m)  =>  dL/dz = (1-b) p ((s-m) - <p, s-m>), times grad_out / tau
            scale = grad_out.to(val.dtype).unsqueeze(-1) * ((1 - b) / tau)
            g = sm.sub_(ks.unsqueeze(-1)).mul_(p).mul_(scale)
        return val, g, _no_stats(val, with_stats)


@dataclass
class TAIDKernel(Kernel):
    """TAID (Shing et al., ICLR 2025; SakanaAI/TAID ``src/distil_losses/taid.py``) at interpolation ``t``.

    Target ``p_t = softmax((1-t)·stopgrad(zs) + t·zt)``; loss ``-Σ_v p_t(v) log q(v)`` with
    ``q = softmax(zs)``, where terms at infinite student logits are dropped (upstream's
    ``forward_kl``, after DistiLLM). This is the cross-entropy form of KL(p_t‖q): it differs
    from the KL by ``H(p_t)``, which has no gradient with respect to the student. Both sides' logits are
    divided by ``temperature`` first.
    """

    t: float = 0.4
    temperature: float = 1.0
    name: str = "taid"

    def value(self, zs: Tensor, zt: Tensor) -> Tensor:
        t, tau = self.t, self.temperature
        mixed = (1 - t) * _scaled(_up(zs.detach()), tau) + t * _scaled(_up(zt), tau)
        p = torch.softmax(mixed, dim=-1, dtype=mixed.dtype)
        logq = torch.log_softmax(_scaled(_up(zs), tau), dim=-1)
        prod = torch.masked_fill(p * logq, torch.isinf(zs), 0)
        return -prod.sum(-1)

    def compute(self, zs: Tensor, zt: Tensor, grad_out: Tensor | None = None, with_stats: bool = False) -> Computed:
        t, tau = self.t, self.temperature
        zs, zt = _up(zs), _up(zt)
        if tau != 1.0:  # both buffers are ours to overwrite
            zs, zt = zs.div_(tau), zt.div_(tau)
        inf = torch.isinf(zs)
        if not bool(inf.any()):
            inf = None
        # target p_t, in zt's buffer
        p = zt.mul_(t).add_(zs, alpha=1 - t)
        p = _log_softmax_(p).exp_()
        logq = _log_softmax_(zs)
        if inf is not None:
            p.masked_fill_(inf, 0.0)
            logq_safe = logq.masked_fill(inf, 0.0)
            val = -_rowdot(p, logq_safe)
            del logq_safe
        else:
            val = -_rowdot(p, logq)
        g: Tensor | None = None
        if grad_out is not None:
            # d/dz_i [-Σ_j p_j log q_j] = q_i Σ_j p_j - p_i   (p_j zeroed where the term is dropped)
            g = logq.exp_().mul_(p.sum(-1, keepdim=True)).sub_(p)
            _scale_grad_(g, grad_out, val.dtype, tau)
        return val, g, _no_stats(val, with_stats)


@dataclass
class EntropyOPDKernel(Kernel):
    """Entropy-aware on-policy distillation (Jin et al., 2026, arXiv:2603.07079).

    Per token: ``KL(student‖teacher) + fkl_weight · 1[H(teacher) > entropy_threshold] · KL(teacher‖student)``
    where the entropy is the teacher's at the distillation temperature. With ``top_k`` the forward KL
    is taken over the teacher's top-k tokens with the teacher renormalised over them; ``None`` uses the
    full vocabulary (exact).
    """

    entropy_threshold: float = 0.8
    fkl_weight: float = 1.0
    top_k: int | None = None
    temperature: float = 1.0
    name: str = "entropy_opd"

    def _parts(self, zs: Tensor, zt: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        s = torch.log_softmax(_scaled(zs, self.temperature), dim=-1)
        t = torch.log_softmax(_scaled(zt, self.temperature), dim=-1)
        q = t.exp()
        ent = -(q * t).sum(-1)
        high = (ent > self.entropy_threshold).to(ent.dtype)
        rkl = (s.exp() * (s - t)).sum(-1)
        if self.top_k is None:
            fkl = (q * (t - s)).sum(-1)
        else:
            k = min(int(self.top_k), t.shape[-1])
            tk, idx = t.topk(k, dim=-1)
            tk = tk - torch.logsumexp(tk, dim=-1, keepdim=True)
            fkl = (tk.exp() * (tk - s.gather(-1, idx))).sum(-1)
        return rkl, fkl, ent, high

    def value(self, zs: Tensor, zt: Tensor) -> Tensor:
        rkl, fkl, _, high = self._parts(zs, zt)
        return rkl + self.fkl_weight * high * fkl

    def stats(self, zs: Tensor, zt: Tensor) -> Tensor:
        rkl, fkl, ent, high = self._parts(zs, zt)
        return torch.stack([ent, high, rkl, fkl], dim=-1)

    def compute(self, zs: Tensor, zt: Tensor, grad_out: Tensor | None = None, with_stats: bool = False) -> Computed:
        tau = self.temperature
        s = _log_softmax_(_up(zs), tau)
        t = _log_softmax_(_up(zt), tau)
        q = t.exp()
        p = s.exp()
        qt = _rowdot(q, t)
        ent = -qt
        high = (ent > self.entropy_threshold).to(ent.dtype)
        gate = high * self.fkl_weight
        rkl = _rowdot(p, s) - _rowdot(p, t)
        qk = idx = None
        if self.top_k is None:
            fkl = qt - _rowdot(q, s)
        else:
            k = min(int(self.top_k), t.shape[-1])
            tk, idx = t.topk(k, dim=-1)
            tk = tk - torch.logsumexp(tk, dim=-1, keepdim=True)
            qk = tk.exp()
            fkl = (qk * (tk - s.gather(-1, idx))).sum(-1)
        val = rkl + gate * fkl
        g: Tensor | None = None
        if grad_out is not None:
            g = s.sub_(t).sub_(rkl.unsqueeze(-1)).mul_(p)  # reverse KL: p (d - <p, d>), d = s - t
            del t
            if qk is None:
                g.add_(p.sub_(q).mul_(gate.unsqueeze(-1)))  # forward KL: p - q
            else:
                assert idx is not None
                g.add_(p.mul_(gate.unsqueeze(-1)))  # top-k forward KL: p - q̃ (q̃ zero off the top-k)
                g.scatter_add_(-1, idx, -qk * gate.unsqueeze(-1))
            _scale_grad_(g, grad_out, val.dtype, tau)
        st = torch.stack([ent, high, rkl, fkl], dim=-1) if with_stats else None
        return val, g, st


def make_kernel(criterion: str, **params: float | int | None) -> Kernel:
    """Build the kernel for ``criterion`` in ``{"jsd", "taid", "entropy_opd"}``."""
    kernels = {"jsd": JSDKernel, "taid": TAIDKernel, "entropy_opd": EntropyOPDKernel}
    if criterion not in kernels:
        raise ValueError(f"unknown distillation criterion {criterion!r}; valid: 'jsd', 'taid', 'entropy_opd'")
    return kernels[criterion](**params)  # type: ignore[arg-type]


#: Top-k mass above ``exp(-TAIL_FLOOR)`` counts as the whole distribution: the tail bucket is then
#: ``1 - exp(-TAIL_FLOOR) ≈ 1e-7`` (as SDPO clamps it), never ``log 0``.
TAIL_FLOOR = 1e-7


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends (Mächler's two branches)."""
    near = x > -math.log(2.0)
    return torch.where(
        near, torch.log(-torch.expm1(x.clamp(min=-math.log(2.0)))), torch.log1p(-torch.exp(x.clamp(max=-math.log(2.0))))
    )


def _tail(top: Tensor) -> tuple[Tensor, Tensor]:
    """``(log tail (n, 1), active (n, 1))`` for top-k log-probs ``top`` ``(n, k)``.

    ``tail = log(1 - Σ exp(top))`` computed as ``log1mexp(logsumexp(top))``; where the top-k mass
    rounds above ``1 - TAIL_FLOOR`` the sum is clamped there (``active`` is False: no gradient
    flows through the clamp).
    """
    lse = torch.logsumexp(top, dim=-1, keepdim=True)
    active = lse < -TAIL_FLOOR
    return _log1mexp(lse.clamp(max=-TAIL_FLOOR)), active


def _fold_tail(g_top: Tensor, g_tail: Tensor, b: Tensor, tail: Tensor, active: Tensor) -> Tensor:
    """Gradient on the top-k log-probs ``b`` once the tail bucket's dependence on them is folded in.

    ``tail = log(1 - Σ exp(b))`` so ``d tail / d b_i = -exp(b_i - tail)``; where the tail was floored
    (``active`` False) it has no gradient. Leaves ``b`` untouched.
    """
    return g_top - g_tail * (b - tail).exp() * active.to(g_top.dtype)


def _buckets_to_logits(logp: Tensor, idx: Tensor, h: Tensor, tau: float) -> Tensor:
    """``dL/dz`` from the gradient ``h`` on the gathered log-probs ``logp[idx]``: ``(scatter(h) - (Σh)·p) / τ``.

    ``logp`` is the ``(n, V)`` log-softmax of ``z/τ``; its buffer is consumed (it becomes the gradient).
    """
    g = logp.exp_().mul_(-h.sum(-1, keepdim=True))  # -(Σ h) softmax(z/τ)
    g.scatter_add_(-1, idx, h)
    if tau != 1.0:
        g.div_(tau)
    return g


@dataclass
class TopKTailKernel(Kernel):
    """``base`` on the ``(k+1)``-way distributions: the student's top-``k`` tokens plus one tail bucket.

    The ``k`` ids are the **student's** largest logits (SDPO), not differentiated; the ``base`` criterion
    (built with temperature 1) is evaluated on the ``(n, k+1)`` bucket log-probabilities as if they were
    logits (already normalised, so its softmax is the identity). The buckets, the tail and the closed-form
    gradient: docs/losses.md ("Top-k distillation with a tail bucket"); ``compute`` needs one ``(n, V)``
    buffer (the student logits', reused) plus ``(n, k+1)`` ones.
    """

    base: Kernel
    k: int = 100
    temperature: float = 1.0

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.base.name

    def _buckets(self, zs: Tensor, zt: Tensor) -> tuple[Tensor, Tensor]:
        s = torch.log_softmax(_scaled(zs, self.temperature), dim=-1)
        t = torch.log_softmax(_scaled(zt, self.temperature), dim=-1)
        idx = s.detach().topk(min(self.k, s.shape[-1]), dim=-1).indices
        bs, bt = s.gather(-1, idx), t.gather(-1, idx)
        if self.k >= s.shape[-1]:
            return bs, bt
        ts, act = _tail(bs)
        ts = torch.where(act, ts, ts.detach())
        return torch.cat([bs, ts], -1), torch.cat([bt, _tail(bt)[0]], -1)

    def value(self, zs: Tensor, zt: Tensor) -> Tensor:
        bs, bt = self._buckets(zs, zt.detach())
        return self.base.value(bs, bt)

    def stats(self, zs: Tensor, zt: Tensor) -> Tensor:
        with torch.no_grad():
            bs, bt = self._buckets(zs, zt)
        return self.base.stats(bs, bt)

    def compute(self, zs: Tensor, zt: Tensor, grad_out: Tensor | None = None, with_stats: bool = False) -> Computed:
        tau = self.temperature
        zs, zt = _up(zs), _up(zt)
        if tau != 1.0:
            zs.div_(tau)
            zt.div_(tau)
        V = zs.shape[-1]
        k = min(self.k, V)
        top, idx = zs.topk(k, dim=-1)
        lse = torch.logsumexp(zs, dim=-1, keepdim=True)
        bs = top.sub_(lse)
        bt = zt.gather(-1, idx).sub_(torch.logsumexp(zt, dim=-1, keepdim=True))
        del zt
        tail = k < V
        if tail:
            ts, act = _tail(bs)
            ls, lt = torch.cat([bs, ts], -1), torch.cat([bt, _tail(bt)[0]], -1)
        else:
            ls, lt = bs.clone(), bt
        val, gb, st = self.base.compute(ls, lt, grad_out, with_stats)  # consumes ls, lt
        g: Tensor | None = None
        if grad_out is not None:
            assert gb is not None
            h = gb[:, :k]
            if tail:
                h = _fold_tail(h, gb[:, k:], bs, ts, act)
            g = _buckets_to_logits(zs.sub_(lse), idx, h, tau)
        return val, g, st


def with_topk(kernel: Kernel, k: int | None, temperature: float = 1.0) -> Kernel:
    """``kernel`` itself when ``k`` is None, else :class:`TopKTailKernel` around it.

    ``kernel`` must have been built at temperature 1: the wrapper divides the full-vocabulary
    logits by ``temperature`` before the top-k and the tail are taken.
    """
    if k is None:
        return kernel
    if int(k) < 1:
        raise ValueError(f"topk must be >= 1 (or None for the full vocabulary), got {k}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return TopKTailKernel(base=kernel, k=int(k), temperature=float(temperature))


# -- the teacher's top-k: ids given by the teacher(s), not taken from the student ------------------
#: Divergences of the ``teacher_distill`` channel and the generalised-JSD ``beta`` each one is.
TEACHER_DIVERGENCES: dict[str, float | None] = {"reverse_kl": 1.0, "forward_kl": 0.0, "jsd": None}

#: A teacher log-prob below this (``log 1e-30``) is read as this: a token the teacher ranked in its
#: top-k with probability 0 would otherwise make the reverse KL infinite.
TEACHER_LOGPROB_FLOOR = math.log(1e-30)  # -69.0776


def bucket_divergence(ls: Tensor, lt: Tensor, valid: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """Per-row divergence of two distributions given as bucket log-probs, and its gradient in ``ls``.

    ``ls``, ``lt``: ``(n, m)`` student / teacher log-probs of the same buckets; ``valid``: ``(n, m)``
    buckets that exist (the others count as absent on both sides); ``beta`` as :class:`JSDKernel`. The
    gradient is taken with respect to the log-probs themselves (a term ``c·p`` may be added or dropped: it
    vanishes once the tail is folded in and the gradient is carried back to the logits). Differentiable by
    autograd too.
    """
    zero = torch.zeros((), dtype=ls.dtype, device=ls.device)
    s = torch.where(valid, ls, zero)
    t = torch.where(valid, lt, zero)
    p = torch.where(valid, s.exp(), zero)
    if beta == 1.0:
        d = s - t
        return (p * d).sum(-1), p * d
    q = torch.where(valid, t.exp(), zero)
    if beta == 0.0:
        return (q * (t - s)).sum(-1), -q
    m = torch.where(valid, torch.logaddexp(s + math.log1p(-beta), t + math.log(beta)), zero)
    val = beta * (q * (t - m)).sum(-1) + (1 - beta) * (p * (s - m)).sum(-1)
    return val, (1 - beta) * p * (s - m)


@dataclass
class TeacherTopKKernel:
    """A divergence between the student's distribution and a teacher's given on **the teacher's** top-k ids.

    Per token the teacher side is ``ids`` ``(n, k)`` (``valid`` marks real entries; merged teachers
    give rows of different lengths) and log-probs ``lt`` ``(n, k + 1)``: those ids' and, last, its tail
    bucket's. The student's full-vocabulary ``log_softmax(z / temperature)`` is gathered at the same ids,
    plus its tail (floored as in :func:`_tail`), and :func:`bucket_divergence` is taken on the ``k + 1``-way
    distributions (docs/losses.md, "On-policy distillation from external teachers").
    """

    divergence: str = "reverse_kl"
    beta: float = 0.5
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.divergence not in TEACHER_DIVERGENCES:
            raise ValueError(
                f"unknown teacher_distill divergence {self.divergence!r}; valid: {', '.join(TEACHER_DIVERGENCES)}"
            )
        if not 0.0 <= float(self.beta) <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {self.beta}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def jsd_beta(self) -> float:
        """The generalised-JSD ``beta`` of :attr:`divergence`."""
        fixed = TEACHER_DIVERGENCES[self.divergence]
        return float(self.beta) if fixed is None else fixed

    def _student(self, logp: Tensor, ids: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(top-k log-probs b, tail, tail active, row has a tail)`` of the student at the teacher's ids."""
        b = logp.gather(-1, ids)
        ts, act = _tail(torch.where(valid, b, torch.full_like(b, -math.inf)))
        has_tail = valid.sum(-1, keepdim=True) < logp.shape[-1]
        return b, ts, act, has_tail

    def value(self, zs: Tensor, ids: Tensor, lt: Tensor, valid: Tensor) -> Tensor:
        """Per-token divergence, differentiable in ``zs`` by autograd (the plain reference path)."""
        logp = torch.log_softmax(_scaled(zs, self.temperature), dim=-1)
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        b, ts, act, has_tail = self._student(logp, safe, valid)
        ts = torch.where(act, ts, ts.detach())
        ls = torch.cat([b, ts], -1)
        vb = torch.cat([valid, has_tail], -1)
        return bucket_divergence(ls, _up(lt).clamp(min=TEACHER_LOGPROB_FLOOR), vb, self.jsd_beta)[0]

    def compute(
        self, zs: Tensor, ids: Tensor, lt: Tensor, valid: Tensor, grad_out: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """``(value, grad_out[:, None]·dvalue/dzs or None, stats)``; consumes ``zs``'s buffer.

        ``stats`` ``(n, 2)``: the student's and the teacher's probability mass on the ids (the
        coverage of the top-k), detached.
        """
        tau = self.temperature
        zs = _up(zs)
        if tau != 1.0:
            zs.div_(tau)
        logp = zs.sub_(torch.logsumexp(zs, dim=-1, keepdim=True))
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        b, ts, act, has_tail = self._student(logp, safe, valid)
        k = b.shape[-1]
        ls = torch.cat([b, ts], -1)
        vb = torch.cat([valid, has_tail], -1)
        lt = _up(lt).to(ls.dtype).clamp(min=TEACHER_LOGPROB_FLOOR)
        val, gb = bucket_divergence(ls, lt, vb, self.jsd_beta)
        neg = torch.full_like(b, -math.inf)
        stats = torch.stack(
            [
                torch.logsumexp(torch.where(valid, b, neg), -1).exp(),
                torch.logsumexp(torch.where(valid, lt[:, :k], neg), -1).exp(),
            ],
            -1,
        )
        if grad_out is None:
            return val, None, stats
        gb = gb * grad_out.to(gb.dtype).unsqueeze(-1)
        h = _fold_tail(gb[:, :k], gb[:, k:], b, ts, act & has_tail)
        h = torch.where(valid, h, torch.zeros_like(h))
        return val, _buckets_to_logits(logp, safe, h, tau), stats
