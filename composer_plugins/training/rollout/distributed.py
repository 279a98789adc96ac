"""Data parallel that divides the work: which share of a step each rank draws, and global reductions.

Rank ``r`` keeps the ``r``-th contiguous share of the step's prompts (:func:`rank_share`); token-count
normalisers are all-reduced (:func:`dp_normalisers`) so each rank's loss is its share of the single-process
loss on the union batch; step statistics are reduced before logging (:func:`reduce_stats`). Everything is a
no-op without an initialised multi-rank process group. See docs/training.md "Data parallel that divides the work".
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

#: Step statistics that are counts over the step's rows (summed over ranks); the others are means.
SUM_STATS: frozenset[str] = frozenset({"completion_tokens", "hint/rows"})


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_share(items: Sequence[T], rank: int, world_size: int, *, what: str = "rollout.prompts_per_step") -> list[T]:
    """The ``rank``-th of ``world_size`` equal contiguous shares of ``items``.

    Raises ``ValueError`` naming ``what`` when ``len(items)`` is not a multiple of ``world_size``
    (unequal shares would make the ranks' losses incomparable and stall DDP's collectives).
    """
    n = len(items)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if n % world_size:
        lo = n - n % world_size
        raise ValueError(
            f"{what}={n} cannot be split evenly over {world_size} data-parallel ranks; "
            f"set it to a multiple of {world_size} (e.g. {lo or world_size} or {lo + world_size})"
        )
    k = n // world_size
    return list(items[rank * k : (rank + 1) * k])


def all_reduce(values: Sequence[float], op: str = "sum") -> list[float]:
    """``values`` reduced element-wise over ranks (``op``: ``sum`` or ``max``); float64, one collective."""
    _, size = world()
    if size == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return [float(v) for v in t.cpu().tolist()]


def _collective_device() -> Any:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dp_normalisers(completion_mask: Any, hint_tokens: float | None = None) -> dict[str, float]:
    """Batch fields that make each rank's loss its share of the union-batch loss (empty with one rank).

    ``num_items_in_batch``: the loss-token count of all ranks divided by the world size (``dapo``,
    ``cispo`` and ``dppo``'s ``tokens`` normaliser); ``max_completion_length``: the widest completion
    of any rank (``dr_grpo``'s default constant, the union batch's padded width);
    ``hint_tokens_in_batch`` (when ``hint_tokens`` is given, this rank's hinted-token count): all
    ranks' hinted tokens divided by the world size (the hint-distillation mean).
    """
    _, size = world()
    if size == 1:
        return {}
    counts = [float(completion_mask.sum().item())]
    if hint_tokens is not None:
        counts.append(float(hint_tokens))
    totals = all_reduce(counts)
    (longest,) = all_reduce([float(completion_mask.shape[1])], op="max")
    out: dict[str, float] = {"num_items_in_batch": totals[0] / size, "max_completion_length": int(longest)}
    if hint_tokens is not None:
        out["hint_tokens_in_batch"] = totals[1] / size
    return out


def all_gather_objects(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` (``[obj]`` with one rank)."""
    _, size = world()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj)
    return out


def reduce_stats(stats: Mapping[str, float]) -> dict[str, float]:
    """Step statistics of all ranks in one: :data:`SUM_STATS` summed, the rest averaged over the ranks having them."""
    every = all_gather_objects(dict(stats))
    if len(every) == 1:
        return dict(stats)
    keys = dict.fromkeys(k for s in every for k in s)
    out: dict[str, float] = {}
    for k in keys:
        vals = [float(s[k]) for s in every if k in s]
        out[k] = sum(vals) if k in SUM_STATS else sum(vals) / len(vals)
    return out


def barrier() -> None:
    """Wait for every rank (no-op with one)."""
    _, size = world()
    if size > 1:
        dist.barrier()


def fsdp_root(trainer: Any) -> Any:
    """The trainer's FSDP-wrapped root module, or ``None`` (no trainer, or another strategy)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = getattr(getattr(trainer, "strategy", None), "model", None) if trainer is not None else None
    return model if isinstance(model, FSDP) else None


def full_params(trainer: Any, recurse: bool = False) -> Any:
    """A context in which the policy's parameters are whole (FSDP: gathered; otherwise nothing to do).

    ``recurse=False`` gathers only the root unit (embeddings, LM head): the wrapped decoder layers
    gather their own on each forward, as TRL samples under FSDP. ``recurse=True`` gathers all
    (saving the weights for an inference server).
    """

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    root = fsdp_root(trainer)
    # inside the training/validation forward FSDP has already gathered the root unit's parameters
    if root is not None and getattr(getattr(root, "training_state", None), "name", "IDLE") == "IDLE":
        return FSDP.summon_full_params(root, writeback=False, recurse=recurse)
    return contextlib.nullcontext()
