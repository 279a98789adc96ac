"""The ``chain`` provider: the first hint any of several providers gives, and which one gave it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from composer_plugins.envs.hints.contract import HintProvider, HintRequest, build_hint_provider, reads_groups


class ChainHintProvider(HintProvider):
    """The first non-empty hint of several providers (names, config dicts or objects), tried in order.

    The order is the mixing rule: ``[demonstration (fallback: none), step_check]`` gives a demonstration
    where a sibling succeeded and step_check's located mistake otherwise; with step_check first (it hints
    every failure) the demonstration would never be used. :meth:`kinds` names the member that gave each
    hint, so a run logs each kind's share of the rows (``hint/fraction/<kind>``).
    """

    name = "chain"

    def __init__(self, providers: Sequence[Any]) -> None:
        if not providers:
            raise ValueError("chain needs at least one provider")
        self.providers = [build_hint_provider(p) for p in providers]
        self.reads_groups = any(reads_groups(p) for p in self.providers)  # type: ignore[misc]
        self._kinds: list[str | None] = []

    def hint(self, request: HintRequest) -> str | None:
        return self.hints([request])[0]

    def hints(self, requests: Sequence[HintRequest]) -> list[str | None]:
        out: list[str | None] = [None] * len(requests)
        kinds: list[str | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        for p in self.providers:
            if not todo:
                break
            hs = p.hints([requests[i] for i in todo])
            for i, h, k in zip(todo, hs, p.kinds(hs), strict=True):
                if h:
                    out[i], kinds[i] = h, k
            todo = [i for i in todo if not out[i]]
        self._kinds = kinds
        return out

    def kinds(self, hints: Sequence[Any]) -> list[str | None]:
        if len(self._kinds) != len(hints):
            return super().kinds(hints)
        return [k if h else None for k, h in zip(self._kinds, hints, strict=True)]
