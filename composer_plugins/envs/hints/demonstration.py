"""The ``demonstration`` provider: a successful sibling's completion from the same rollout group (SDPO's teacher)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import string
from collections.abc import Sequence
from typing import Any

from composer_plugins.envs.base import prompt_text
from composer_plugins.envs.hints.contract import HintProvider, HintRequest, SiblingGroup, build_hint_provider

#: SDPO's reprompting defaults (Hübotter et al. 2026), worded for the ``Hint: ...`` block of a teacher context.
DEMONSTRATION_TEMPLATE = "Correct solution:\n{demonstration}{feedback}\n\nCorrectly solve the original question."
FEEDBACK_TEMPLATE = "The following is feedback from your unsuccessful earlier attempt:\n{feedback}"

_PICKS = ("first", "shortest", "random")
_FALLBACKS = ("feedback", "none")
_ROWS = ("failed", "all")
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def _check_template(tpl: str, allowed: set[str], what: str) -> None:
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(tpl) if f}
    except ValueError as e:
        raise ValueError(f"{what} is not a valid format string: {e}") from None
    unknown = sorted(fields - allowed)
    if unknown:
        raise ValueError(f"{what} uses unknown field {{{unknown[0]}}}; available: " + ", ".join(sorted(allowed)))


def _choice(value: str, valid: Sequence[str], what: str) -> str:
    if value in valid:
        return value
    from composer_plugins.core.errors import closest

    near = closest(str(value), valid)
    dym = f" Did you mean {near[0]!r}?" if near else ""
    raise ValueError(f"{what} {value!r} is not one of {', '.join(valid)}.{dym}")


class DemonstrationHintProvider(HintProvider):
    """A successful sibling's completion from the same rollout group as the hint (SDPO's self-teacher).

    For a failed row the hint shows another completion of the same prompt that succeeded, never the row's own,
    through ``template``; when none did (or no group is given), what ``fallback`` says.

    The arguments are tabled in docs/envs.md, "Hints"; beyond that: ``pick: shortest`` breaks ties to the lowest
    index, ``pick: random`` is seeded by ``seed`` and the group's contents (the same rollout gets the same pick),
    ``max_chars`` keeps the demonstration's start, ``{feedback}`` is empty unless ``include_feedback`` (else a
    blank line and the rendered ``feedback_template``, appended when ``template`` has no ``{feedback}``), and
    with ``rows: all`` a row without a successful sibling gets the fallback only if it failed.
    """

    name = "demonstration"
    reads_groups = True

    def __init__(
        self,
        *,
        success_threshold: float | None = 0.5,
        pick: str = "first",
        seed: int = 0,
        max_chars: int = 2000,
        template: str = DEMONSTRATION_TEMPLATE,
        feedback_template: str = FEEDBACK_TEMPLATE,
        include_feedback: bool = False,
        fallback: str = "feedback",
        feedback: Any = "raw_error",
        strip_thinking: bool = True,
        rows: str = "failed",
    ) -> None:
        self.pick = _choice(pick, _PICKS, "pick")
        self.rows = _choice(rows, _ROWS, "rows")
        self.fallback = _choice(fallback, _FALLBACKS, "fallback")
        if int(max_chars) < 1:
            raise ValueError(f"max_chars must be at least 1, got {max_chars!r}")
        _check_template(template, {"demonstration", "feedback"}, "template")
        if "{demonstration}" not in template:
            raise ValueError("template must contain {demonstration}")
        _check_template(feedback_template, {"feedback"}, "feedback_template")
        self.success_threshold = None if success_threshold is None else float(success_threshold)
        self.seed = int(seed)
        self.max_chars = int(max_chars)
        self.template = template
        self.feedback_template = feedback_template
        self.include_feedback = bool(include_feedback)
        self.strip_thinking = bool(strip_thinking)
        self.feedback_provider = build_hint_provider(feedback)

    def _threshold(self, group: SiblingGroup) -> float:
        return group.success_threshold if self.success_threshold is None else self.success_threshold

    def pick_sibling(self, group: SiblingGroup) -> int | None:
        """The index of the sibling whose completion is the demonstration (``None``: no sibling succeeded)."""
        ok = group.successful_siblings(self._threshold(group))
        if not ok:
            return None
        if self.pick == "first":
            return ok[0]
        if self.pick == "shortest":
            return min(ok, key=lambda j: (len(prompt_text(group.completions[j])), j))
        key = json.dumps([self.seed, group.index, [prompt_text(c) for c in group.completions]], default=str)
        return random.Random(hashlib.sha256(key.encode()).hexdigest()).choice(ok)

    def _demonstration(self, completion: Any) -> str:
        text = prompt_text(completion)
        if self.strip_thinking:
            text = _THINK.sub("", text)
        text = text.strip()
        return text if len(text) <= self.max_chars else text[: self.max_chars - 3].rstrip() + "..."

    def hint(self, request: HintRequest) -> str | None:
        feedback, group = request.feedback, request.group
        succeeded = group is not None and group.reward >= self._threshold(group)
        if succeeded and self.rows == "failed":
            return None  # the row itself succeeded: nothing to correct
        if not succeeded and feedback is not None and not feedback.needs_hint:
            return None  # correct by the env's judgement, or not judged at all
        j = self.pick_sibling(group) if group is not None else None
        if j is None:
            if succeeded or self.fallback == "none" or feedback is None:
                return None
            return self.feedback_provider.hints([request])[0]
        fb = ""
        if self.include_feedback and feedback is not None and not succeeded:
            text = self.feedback_provider.hints([request])[0]
            fb = "\n\n" + self.feedback_template.format(feedback=text) if text else ""
        demo = self._demonstration(group.completions[j])  # type: ignore[union-attr]
        if not demo:
            return None
        text = self.template.format(demonstration=demo, feedback=fb)
        if fb and "{feedback}" not in self.template:
            text = text.rstrip() + fb
        return text.strip() or None
