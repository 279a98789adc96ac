"""The one optimizer builder (registry kind ``optimizers``) and the learning-rate schedules.

``optim.name`` picks a registered optimizer (built-ins ``adamw``, ``adam``, ``sgd``); a factory is called as
``factory(params, **settings)`` with the ``optim`` settings its signature accepts, then ``optim.args``, so a
``torch.optim.Optimizer`` subclass registers directly. Every trainer path builds through
:func:`build_optimizer`. See docs/plugins.md ``register_optimizers``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from composer_plugins.core.config import Config
from composer_plugins.core.errors import ConfigError, UnknownPluginError
from composer_plugins.core.plugins import get_registry

#: the ``optim`` fields offered to every optimizer factory (each only if its signature takes it)
SETTINGS = ("lr", "weight_decay", "betas", "eps", "momentum")


def optimizer_names() -> list[str]:
    """The registered optimizer names."""
    return get_registry().names("optimizers")


def check_optimizer_name(name: str, src: Any = None, key: str = "optim.name") -> None:
    """Raise a located error (``key`` in ``src``'s file) naming the optimizers and the closest if unknown."""
    names = optimizer_names()
    if name not in names:
        msg = str(UnknownPluginError("optimizer", name, names))
        raise (src if src is not None else Config()).error(key, msg)


def _settings(factory: Callable[..., Any], optim: Any) -> dict[str, Any]:
    values = {k: getattr(optim, k) for k in SETTINGS if hasattr(optim, k)}
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return values
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return values
    return {k: v for k, v in values.items() if k in params}


def implementation_kwargs(factory: Callable[..., Any], fused: Any, device_type: str) -> dict[str, bool]:
    """``optim.fused``'s keyword for ``factory`` on ``device_type``: ``auto`` is ``fused=True`` on CUDA (one kernel
    per step, no parameter-sized temporary) and ``foreach=True`` elsewhere; nothing for a factory that takes neither."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if fused != "auto":
        return {"fused": bool(fused)} if "fused" in params else {}
    key = "fused" if device_type == "cuda" else "foreach"
    return {key: True} if key in params else {}


def build_optimizer(optim: Any, params: Iterable[Any]) -> Any:
    """The optimizer named by ``optim.name`` over the parameters of ``params`` that require grad.

    ``optim`` is an ``OptimSection`` (or any object with ``name`` and the :data:`SETTINGS`, and optional
    ``args`` and ``fused``: :func:`implementation_kwargs`). An unknown name raises the registry's error with the
    available names and the closest; extra ``args`` the optimizer does not take raise a :class:`ConfigError`.
    """
    entry = get_registry().get("optimizers", str(optim.name))
    trainable = [p for p in params if getattr(p, "requires_grad", True)]
    extra: Mapping[str, Any] = getattr(optim, "args", None) or {}
    device = trainable[0].device.type if trainable and hasattr(trainable[0], "device") else "cpu"
    fused = getattr(optim, "fused", "auto")
    impl = {} if {"fused", "foreach"} & set(extra) else implementation_kwargs(entry.factory, fused, device)
    kwargs = {**_settings(entry.factory, optim), **impl, **dict(extra)}
    try:
        return entry.build(trainable, **kwargs)
    except TypeError as e:
        raise ConfigError(
            f"optimizer {optim.name!r} ({entry.provider or entry.plugin}) rejected its settings: {e}",
            key="optim.args" if extra else "optim",
        ) from e


def warmup_cosine(warmup: int, total: int, final: float = 0.1) -> Callable[[int], float]:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``final`` × the peak at ``total``."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def schedule(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """The ``LambdaLR`` factor of ``optim.scheduler`` (``cosine``, ``linear`` or ``constant``)."""
    if kind == "cosine":
        return warmup_cosine(warmup, total)
    if kind == "linear":
        return lambda s: (s + 1) / max(1, warmup) if s < warmup else max(0.0, 1 - (s - warmup) / max(1, total - warmup))
    return lambda s: (s + 1) / max(1, warmup) if s < warmup else 1.0


def build_optimization(optim: Any, params: Iterable[Any], total_steps: int) -> dict[str, Any]:
    """``configure_optimizers``' answer: the optimizer and its per-step ``LambdaLR`` schedule."""
    import torch

    opt = build_optimizer(optim, params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(optim.scheduler, optim.warmup_steps, max(1, total_steps)))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def optimizer_step(optimizer: Any, params: Iterable[Any], loss: Any, clip: float | None = None) -> float:
    """The one local optimizer step: zero the gradients, ``loss.backward()``, clip the norm of ``params``
    (``clip``: ``trainer.gradient_clip_val``; ``None``/0: measured, not clipped), step; returns the norm."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    with_grad = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(with_grad, clip if clip else float("inf")) if with_grad else 0.0
    optimizer.step()
    return float(norm)
