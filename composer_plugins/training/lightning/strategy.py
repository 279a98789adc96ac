"""The Lightning strategy named by ``trainer.strategy``: DDP, FSDP (also over gloo on CPU), or a class path.

:func:`build_strategy` turns the config value into a strategy object; FSDP wraps each decoder layer
(:func:`decoder_layer_classes`) and the EMA teacher. The names the config accepts are checked when the
config is loaded (:func:`composer_plugins.training.strategy_names.strategy_names`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, OptimStateKeyType, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from composer_plugins.core.config import Config
from composer_plugins.core.registry import import_object
from composer_plugins.training.config.strategy_names import strategy_names, unknown_strategy
from composer_plugins.training.config.train import TrainConfig
from composer_plugins.training.step.ema import EMATeacher


def decoder_layer_classes(policy: Any) -> set[type]:
    """The policy's decoder-layer classes (HF ``_no_split_modules``), the units FSDP wraps one by one."""
    names = set(getattr(policy, "_no_split_modules", None) or ())
    found = {type(m) for m in policy.modules() if type(m).__name__ in names}
    if not found:
        raise ValueError(
            f"trainer.strategy=fsdp: cannot tell the decoder layers of {type(policy).__name__} "
            "(no _no_split_modules); pass {class_path: lightning.pytorch.strategies.FSDPStrategy, "
            "init_args: {auto_wrap_policy: ...}} instead"
        )
    return found


def build_strategy(cfg: TrainConfig, policy: Any = None, src: Config | None = None) -> Any:
    """The Lightning strategy named by ``trainer.strategy`` (``"auto"`` is passed through).

    ``ddp``: :class:`~lightning.pytorch.strategies.DDPStrategy` with ``trainer.dist_timeout_s``;
    ``fsdp``: :class:`~lightning.pytorch.strategies.FSDPStrategy` wrapping each decoder layer of
    ``policy`` (full state dicts in checkpoints, so a run resumes under the same strategy; on CPU the
    gloo backend); another registered name is handed to Lightning; a class path (or
    ``{class_path, init_args}``) is imported and built. Unknown names list the valid ones.
    """
    src = src if src is not None else Config()
    spec = cfg.trainer.strategy
    timeout = timedelta(seconds=float(cfg.trainer.dist_timeout_s))
    if isinstance(spec, str) and "." not in spec:
        name = spec.strip().lower()
        if name not in strategy_names():
            raise unknown_strategy(spec, src, "trainer.strategy")
        if name == "ddp":
            return DDPStrategy(timeout=timeout)
        if name == "fsdp":
            return _fsdp_strategy(cfg, policy, timeout)
        return name
    if isinstance(spec, str):
        spec = {"class_path": spec}
    if isinstance(spec, Mapping) and "class_path" in spec:
        path = str(spec["class_path"])
        try:
            cls = import_object(path)
        except (ImportError, AttributeError, ValueError) as e:
            raise src.error("trainer.strategy", f"cannot import {path!r} ({e}).") from None
        return cls(**dict(spec.get("init_args") or {}))
    if isinstance(spec, Mapping):
        raise src.error("trainer.strategy", "a mapping needs class_path (and optionally init_args).")
    return spec  # an already built Strategy object


def _fsdp_strategy(cfg: TrainConfig, policy: Any, timeout: Any) -> Any:
    if policy is None:
        raise ValueError("trainer.strategy=fsdp needs the policy to find its decoder layers")
    kw: dict[str, Any] = {
        # the EMA teacher (losses.hint_distill.teacher: ema) is a unit of its own, its layers nested units:
        # sharded as the policy is, shard for shard
        "auto_wrap_policy": decoder_layer_classes(policy) | {EMATeacher},
        "state_dict_type": "full",
        "timeout": timeout,
    }
    if cfg.trainer.accelerator == "cpu":
        # Lightning refuses the "fsdp" name without a GPU; torch's FSDP runs on CPU over gloo
        kw.update(process_group_backend="gloo")
        return CPUFSDPStrategy(**kw)
    return FSDPStrategy(**kw)


class CPUFSDPStrategy(FSDPStrategy):
    """FSDP over gloo on CPU ranks.

    Lightning checks for a GPU only on its own class, and hands FSDP ``device_id=None`` on CPU,
    which torch's FSDP refuses; this wraps with ``device_id=cpu`` and lets Lightning do the rest.
    """

    def _setup_model(self, model: Any) -> Any:
        if not any(isinstance(m, FSDP) for m in model.modules()):
            model = FSDP(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            self.kwargs.pop("auto_wrap_policy", None)
        return super()._setup_model(model)

    def _full_ctx(self) -> Any:
        # Lightning's full state dicts offload to CPU, which on CPU-resident parameters crashes
        # torch 2.13's FSDP clone of the gathered tensors (SIGSEGV); they are on the CPU already
        return FSDP.state_dict_type(
            self.model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._full_ctx():
            return self.model.state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        with self._full_ctx():
            state = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
            return state
