"""The one hint-provider contract: a request per row with its rollout group, the base class, older shapes adapted."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from composer_plugins.envs.base import Feedback


@dataclass(frozen=True)
class SiblingGroup:
    """One row's view of its rollout group: the ``G`` completions sampled for the same prompt.

    Its fields (this row's ``index`` in ``completions`` and ``rewards`` ...): docs/plugins.md,
    "register_hint_providers".
    """

    completions: tuple[Any, ...]
    rewards: tuple[float, ...]
    index: int
    success_threshold: float = 1.0

    def __post_init__(self) -> None:
        if len(self.completions) != len(self.rewards):
            raise ValueError(f"a group has {len(self.completions)} completions but {len(self.rewards)} rewards")
        if not 0 <= self.index < len(self.completions):
            raise IndexError(f"row index {self.index} is outside its group of {len(self.completions)}")

    @property
    def completion(self) -> Any:
        """This row's own completion."""
        return self.completions[self.index]

    @property
    def reward(self) -> float:
        """This row's own reward."""
        return self.rewards[self.index]

    def successful_siblings(self, threshold: float | None = None) -> list[int]:
        """Indices of the *other* completions whose reward is at least ``threshold`` (default: the group's).

        Never this row's own index: a teacher conditioned on the row's own success would only
        teach the student to copy itself.
        """
        thr = self.success_threshold if threshold is None else threshold
        return [j for j, r in enumerate(self.rewards) if j != self.index and r is not None and float(r) >= thr]


def sibling_groups(
    completions: Sequence[Any], rewards: Sequence[float], group_size: int, success_threshold: float = 1.0
) -> list[SiblingGroup]:
    """One :class:`SiblingGroup` per row of a rollout whose rows ``i`` form groups ``i // group_size``."""
    n = len(completions)
    if len(rewards) != n:
        raise ValueError(f"{n} completions but {len(rewards)} rewards")
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rows do not split into groups of {group_size}")
    out: list[SiblingGroup] = []
    for start in range(0, n, group_size):
        comps = tuple(completions[start : start + group_size])
        rs = tuple(float(r) for r in rewards[start : start + group_size])
        out.extend(SiblingGroup(comps, rs, j, float(success_threshold)) for j in range(group_size))
    return out


@dataclass(frozen=True)
class HintRequest:
    """What a hint provider is asked about one row: a failed (or any) completion and its context.

    Its fields: docs/plugins.md, "register_hint_providers"; ``group`` is ``None`` when not sampled.
    """

    prompt: Any = None
    completion: Any = None
    feedback: Feedback | None = None
    task: Mapping[str, Any] | None = None
    reward: float | None = None
    group: SiblingGroup | None = None

    @property
    def failure(self) -> Feedback | None:
        """:attr:`feedback` when it asks for a hint (:attr:`Feedback.needs_hint`), else ``None``."""
        return self.feedback if self.feedback is not None and self.feedback.needs_hint else None


class HintProvider:
    """Base class of hint providers: ``hint(request) -> str | None`` per row, ``hints(requests)`` per batch.

    ``None`` means "no hint". The contract (concurrent :meth:`hints`, ``reads_groups``): docs/plugins.md,
    "register_hint_providers".
    """

    name: ClassVar[str] = "hint"
    #: True when the provider reads :attr:`HintRequest.group`.
    reads_groups: ClassVar[bool] = False

    def hint(self, request: HintRequest) -> str | None:
        """One hint."""
        raise NotImplementedError(f"{type(self).__name__} must implement hint(request) or hints(requests)")

    async def ahint(self, request: HintRequest) -> str | None:
        """Async :meth:`hint` (the default just calls it)."""
        return self.hint(request)

    def hints(self, requests: Sequence[HintRequest]) -> list[str | None]:
        """Hints for a batch of requests, one per request."""
        return [self.hint(r) for r in requests]

    def __call__(self, request: HintRequest) -> str | None:
        return self.hint(request)

    def kinds(self, hints: Sequence[Any]) -> list[str | None]:
        """Which provider gave each of ``hints`` (this provider's last :meth:`hints` call): its name, or ``None``.

        A :class:`ChainHintProvider` names the member that answered, so a run can log each kind's share.
        """
        return [self.name if h else None for h in hints]


# -- providers not on the request contract (older shapes, duck-typed objects), adapted once when built -------
class _Adapted(HintProvider):
    """A provider behind the request contract: ``batch`` maps the list of requests to their hints."""

    def __init__(self, source: Any, batch: Callable[[list[HintRequest]], Any], reads: bool, name: str) -> None:
        self.source, self._batch, self.name = source, batch, name  # type: ignore[misc]
        self.reads_groups = reads  # type: ignore[misc]

    def hints(self, requests: Sequence[HintRequest]) -> list[str | None]:
        return list(self._batch(list(requests)))

    def hint(self, request: HintRequest) -> str | None:
        return self.hints([request])[0]


def _legacy_rows(fn: Any, source: Any) -> HintProvider:
    """A ``hint(feedback, *, prompt, completion, task[, group])`` callable behind the request contract."""
    with_group = _takes(_params(fn), "group")

    def row(r: HintRequest) -> str | None:
        group = {"group": r.group} if with_group else {}
        return fn(r.feedback, prompt=r.prompt, completion=r.completion, task=r.task, **group)  # type: ignore[no-any-return]

    return _Adapted(source, lambda requests: [row(r) for r in requests], with_group, "legacy")


def _legacy_batch(fn: Any, source: Any) -> HintProvider:
    """A ``hints(feedbacks, prompts, completions, tasks[, groups=])`` method behind the request contract."""
    with_groups = _takes(_params(fn), "groups")

    def batch(requests: list[HintRequest]) -> Any:
        cols = [[getattr(r, k) for r in requests] for k in ("feedback", "prompt", "completion", "task")]
        return fn(*cols, groups=[r.group for r in requests]) if with_groups else fn(*cols)

    return _Adapted(source, batch, with_groups, "legacy")


def _params(fn: Any) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []


def _takes(params: Sequence[inspect.Parameter], name: str) -> bool:
    return any(p.name == name and p.kind is not p.VAR_POSITIONAL for p in params) or any(
        p.kind is p.VAR_KEYWORD for p in params
    )


def _first_is(params: Sequence[inspect.Parameter], name: str) -> bool:
    return bool(params) and params[0].name == name


def as_hint_provider(obj: Any) -> HintProvider:
    """``obj`` behind the one request contract, adapted once (at build time, never per call).

    Accepted: a provider with ``hints(requests)`` / ``hint(request)`` (returned as is); the older
    shapes — an object with ``hints(feedbacks, prompts, completions, tasks[, groups=])`` or
    ``hint(feedback, *, prompt, completion, task[, group])``, or such a plain callable — wrapped.
    """
    if isinstance(obj, HintProvider):
        cls = type(obj)
        own_hints = cls.hints is not HintProvider.hints
        own_hint = cls.hint is not HintProvider.hint
        if own_hints and not _first_is(_params(obj.hints), "requests"):
            return _legacy_batch(obj.hints, obj)
        if own_hint and not own_hints and not _first_is(_params(obj.hint), "request"):
            return _legacy_rows(obj.hint, obj)
        return obj
    reads = bool(getattr(obj, "reads_groups", False))
    hints_fn = getattr(obj, "hints", None)
    if callable(hints_fn):
        if _first_is(_params(hints_fn), "requests"):
            return _Adapted(obj, hints_fn, reads, "wrapped")
        return _legacy_batch(hints_fn, obj)
    fn = getattr(obj, "hint", None) or obj
    if not callable(fn):
        raise TypeError(f"{obj!r} is not a hint provider: give an object with hints(requests) or hint(request)")
    if _first_is(_params(fn), "request"):
        return _Adapted(obj, lambda requests: [fn(r) for r in requests], reads, "wrapped")
    return _legacy_rows(fn, obj)


def reads_groups(provider: Any) -> bool:
    """Whether ``provider`` (built by :func:`build_hint_provider`) reads the rollout group."""
    return bool(getattr(provider, "reads_groups", False))


def hint_requests(
    feedbacks: Sequence[Any],
    prompts: Sequence[Any] | None = None,
    completions: Sequence[Any] | None = None,
    tasks: Sequence[Mapping[str, Any]] | None = None,
    groups: Sequence[SiblingGroup | None] | None = None,
) -> list[HintRequest]:
    """One :class:`HintRequest` per row from columns (the rows' rewards taken from their groups)."""
    n = len(feedbacks)
    for what, col in (("prompts", prompts), ("completions", completions), ("tasks", tasks), ("groups", groups)):
        if col is not None and len(col) != n:
            raise ValueError(f"{len(col)} {what} for {n} rows")
    gs = groups if groups is not None else [None] * n
    return [
        HintRequest(
            prompt=prompts[i] if prompts is not None else None,
            completion=completions[i] if completions is not None else None,
            feedback=feedbacks[i],
            task=tasks[i] if tasks is not None else None,
            reward=g.reward if g is not None else None,
            group=g,
        )
        for i, g in enumerate(gs)
    ]


def build_hint_provider(spec: Any, key: str = "hints") -> HintProvider:
    """A hint provider on the request contract from a name (``"template"``), ``{"name": ..., **kwargs}`` or an
    object (a provider, or an older-shape provider or callable, adapted once here: :func:`as_hint_provider`)."""
    if isinstance(spec, str | Mapping):
        from composer_plugins.core.config import build_component

        spec = build_component("hints", spec, key=key)
    return as_hint_provider(spec)
