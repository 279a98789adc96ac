"""The ``demonstration`` hint provider and the one hint contract (``HintRequest``, older shapes adapted once)."""

from __future__ import annotations

import pytest

from composer_plugins import build
from composer_plugins.core.config import build_component
from composer_plugins.core.errors import ConfigError
from composer_plugins.envs.base import Feedback
from composer_plugins.envs.hints import (
    DemonstrationHintProvider,
    HintProvider,
    HintRequest,
    SiblingGroup,
    as_hint_provider,
    build_hint_provider,
    hint_requests,
    reads_groups,
    sibling_groups,
)
from composer_plugins.training.rollout.rewards import rollout_groups, teacher_contexts

WRONG = Feedback("wrong_answer", "The final answer 3 is wrong.", {"expected": "10", "got": "3"}, 0.0)
TASK = {
    "prompt": "Question: Ben has 3 eggs. He buys 7 more eggs. How many eggs does Ben have now?\nAnswer:",
    "answer": "10",
}
GOOD_LONG = " Ben has 3 + 7 = 10 eggs now, which is the total.\n#### 10"
GOOD_SHORT = " 3 + 7 = 10.\n#### 10"


def _group(index: int = 0, rewards=(0.0, 1.0, 0.0, 1.0), threshold: float = 1.0) -> SiblingGroup:
    comps = (" Ben has 3 eggs.\n#### 3", GOOD_LONG, " #### 4", GOOD_SHORT)
    return SiblingGroup(comps, tuple(rewards), index, threshold)


def test_sibling_group_lists_successful_siblings_never_the_row_itself():
    g = _group(index=1)
    assert g.completion == GOOD_LONG and g.reward == 1.0
    assert g.successful_siblings() == [3]  # row 1 succeeded too, but is never its own sibling
    assert _group(index=0).successful_siblings() == [1, 3]
    assert _group(index=0, rewards=(0.0, 0.6, 0.0, 0.4)).successful_siblings(0.5) == [1]
    assert _group(index=0, rewards=(0.0, 0.6, 0.0, 0.4), threshold=0.4).successful_siblings() == [1, 3]
    with pytest.raises(ValueError, match="3 completions but 2 rewards"):
        SiblingGroup(("a", "b", "c"), (0.0, 1.0), 0)
    with pytest.raises(IndexError, match="outside its group"):
        SiblingGroup(("a",), (0.0,), 1)


def test_sibling_groups_split_a_rollout_into_groups_of_g():
    groups = sibling_groups(list("abcdef"), [0, 1, 1, 0, 0, 0], 3, 0.5)
    assert [g.index for g in groups] == [0, 1, 2, 0, 1, 2]
    assert groups[4].completions == ("d", "e", "f") and groups[0].successful_siblings() == [1, 2]
    assert groups[3].successful_siblings() == []
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        sibling_groups(list("abcdef"), [0] * 6, 4)
    import torch

    from_tensor = rollout_groups(list("abcd"), torch.tensor([0.0, 1.0, 1.0, 0.0]), 2, 1.0)
    assert from_tensor[0].rewards == (0.0, 1.0) and from_tensor[3].successful_siblings() == [0]


def test_demonstration_shows_a_successful_sibling_after_sdpo_templates():
    d = build("hints", "demonstration")
    assert isinstance(d, DemonstrationHintProvider) and d.success_threshold == 0.5
    h = d.hint(
        HintRequest(
            feedback=WRONG, prompt=TASK["prompt"], completion=" Ben has 3 eggs.\n#### 3", task=TASK, group=_group()
        )
    )
    assert h == f"Correct solution:\n{GOOD_LONG.strip()}\n\nCorrectly solve the original question."
    assert "Ben has 3 eggs.\n#### 3" not in h  # never the row's own (failed) attempt


def test_demonstration_picks_first_shortest_or_seeded_random_and_never_self():
    g = _group()
    assert DemonstrationHintProvider(pick="first").pick_sibling(g) == 1
    assert DemonstrationHintProvider(pick="shortest").pick_sibling(g) == 3
    picks = {DemonstrationHintProvider(pick="random", seed=s).pick_sibling(g) for s in range(20)}
    assert picks == {1, 3}  # both successful siblings get picked over seeds, nothing else
    assert DemonstrationHintProvider(pick="random", seed=5).pick_sibling(g) == DemonstrationHintProvider(
        pick="random", seed=5
    ).pick_sibling(g)
    # the only success is the row itself: no sibling, and a successful row gets no hint at all
    alone = _group(index=1, rewards=(0.0, 1.0, 0.0, 0.0))
    assert DemonstrationHintProvider().pick_sibling(alone) is None
    assert DemonstrationHintProvider().hint(HintRequest(feedback=WRONG, group=alone)) is None


def test_demonstration_threshold_own_or_the_groups():
    g = _group(rewards=(0.0, 0.6, 0.0, 0.4))
    assert DemonstrationHintProvider().pick_sibling(g) == 1  # SDPO's 0.5
    assert DemonstrationHintProvider(success_threshold=0.3, pick="shortest").pick_sibling(g) == 3
    assert DemonstrationHintProvider(success_threshold=0.7).pick_sibling(g) is None
    assert DemonstrationHintProvider(success_threshold=None).pick_sibling(g) is None  # the group's 1.0
    assert DemonstrationHintProvider(success_threshold=None).pick_sibling(_group(rewards=(0, 1, 0, 0))) == 1


def test_demonstration_fallback_and_feedback_inclusion():
    none_ok = _group(rewards=(0.0, 0.0, 0.0, 0.0))
    assert (
        DemonstrationHintProvider().hint(HintRequest(feedback=WRONG, group=none_ok)) == "The final answer 3 is wrong."
    )  # raw_error
    assert (
        DemonstrationHintProvider().hint(HintRequest(feedback=WRONG)) == "The final answer 3 is wrong."
    )  # no group at all
    assert DemonstrationHintProvider(fallback="none").hint(HintRequest(feedback=WRONG, group=none_ok)) is None
    tpl = DemonstrationHintProvider(feedback={"name": "template", "reveal_answer": True})
    assert "(the correct answer is 10)" in tpl.hint(HintRequest(feedback=WRONG, group=none_ok))
    with_fb = DemonstrationHintProvider(include_feedback=True).hint(HintRequest(feedback=WRONG, group=_group()))
    fb = "The following is feedback from your unsuccessful earlier attempt:\nThe final answer 3 is wrong."
    assert with_fb == f"Correct solution:\n{GOOD_LONG.strip()}\n\n{fb}\n\nCorrectly solve the original question."
    custom = DemonstrationHintProvider(
        template="See: {demonstration}", include_feedback=True, feedback_template="[{feedback}]"
    )
    custom = custom.hint(HintRequest(feedback=WRONG, group=_group()))
    assert custom == f"See: {GOOD_LONG.strip()}\n\n[The final answer 3 is wrong.]"
    assert (
        DemonstrationHintProvider().hint(HintRequest(feedback=Feedback("correct", "", {}, 1.0), group=_group())) is None
    )


def test_demonstration_truncates_and_strips_thinking():
    g = SiblingGroup(("#### 1", "<think>long musing</think> 3 + 7 = 10 #### 10"), (0.0, 1.0), 0)
    assert "musing" not in DemonstrationHintProvider().hint(HintRequest(feedback=WRONG, group=g))
    assert "musing" in DemonstrationHintProvider(strip_thinking=False).hint(HintRequest(feedback=WRONG, group=g))
    short = DemonstrationHintProvider(max_chars=10, template="{demonstration}").hint(
        HintRequest(feedback=WRONG, group=g)
    )
    assert short == "3 + 7 =..." and len(short) == 10


def test_demonstration_bad_options_are_located_with_the_fix():
    with pytest.raises(ConfigError, match=r"hints\.provider\.pick: .*'shortst'.*Did you mean 'shortest'"):
        build_component("hints", {"name": "demonstration", "pick": "shortst"}, key="hints.provider")
    with pytest.raises(ConfigError, match=r"hints\.provider\.fallback: .*feedback, none"):
        build_component("hints", {"name": "demonstration", "fallback": "raw"}, key="hints.provider")
    with pytest.raises(ConfigError, match=r"hints\.provider\.template: .*unknown field \{demo\}"):
        build_component("hints", {"name": "demonstration", "template": "{demo}"}, key="hints.provider")
    with pytest.raises(ConfigError, match=r"hints\.provider\.template: template must contain \{demonstration\}"):
        build_component("hints", {"name": "demonstration", "template": "Solve it. {feedback}"}, key="hints.provider")
    with pytest.raises(ConfigError, match=r"hints\.provider\.succes_threshold.*Did you mean: 'success_threshold'"):
        build_component("hints", {"name": "demonstration", "succes_threshold": 1}, key="hints.provider")


# -- the contract: one request per row; older shapes adapted once when built -------------------------


class OldStyle(HintProvider):
    """A third-party provider written against the four-argument contract (no ``group``)."""

    name = "old_style"

    def __init__(self) -> None:
        self.calls = 0

    def hint(self, feedback, *, prompt=None, completion=None, task=None):
        self.calls += 1
        return None if feedback.ok else f"Not {completion.strip()}."


class OldBatch:
    """Not a HintProvider subclass: its own four-argument batch method."""

    def hints(self, feedbacks, prompts=None, completions=None, tasks=None):
        return [f"batch {c}" for c in completions]


class OldWithGroup(HintProvider):
    """An older provider that read the group through ``group=``."""

    def hint(self, feedback, *, prompt=None, completion=None, task=None, group=None):
        return f"{len(group.successful_siblings()) if group else 'no'} siblings succeeded"


class KwargsStyle:
    def hint(self, feedback, **kw):
        return "group" if kw.get("group") is not None else "none"


class NewStyle(HintProvider):
    """A provider on the request contract that reads the group."""

    name = "new_style"
    reads_groups = True

    def hint(self, request):
        g = request.group
        return f"{len(g.successful_siblings()) if g else 'no'} siblings succeeded (reward {request.reward})"


def old_callable(feedback, prompt=None, completion=None, task=None):
    return f"callable {task['answer']}"


def test_older_providers_are_adapted_once_and_called_as_before(monkeypatch):
    import inspect

    groups = [_group(), _group(index=2)]
    comps = [" #### 3", " #### 4"]
    old = OldStyle()
    adapted = [as_hint_provider(p) for p in (old, OldBatch(), old_callable, OldWithGroup(), KwargsStyle())]
    assert all(isinstance(p, HintProvider) for p in adapted)
    assert [reads_groups(p) for p in adapted] == [False, False, False, True, True]
    # adapted once: calling them inspects no signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: pytest.fail("inspect.signature at call time"))
    reqs = hint_requests([WRONG, WRONG], None, comps, [TASK, TASK], groups)
    assert adapted[0].hints(reqs) == ["Not #### 3.", "Not #### 4."] and old.calls == 2
    assert adapted[1].hints(reqs) == ["batch  #### 3", "batch  #### 4"]
    ctx = teacher_contexts(None, adapted[2], [TASK, TASK], comps, [WRONG, WRONG], groups)
    assert ctx[0] == TASK["prompt"].replace("\nAnswer:", "\nHint: callable 10\nAnswer:")
    assert adapted[3].hints(reqs) == ["2 siblings succeeded", "2 siblings succeeded"]
    assert adapted[4].hints(reqs[:1]) == ["group"] and adapted[4].hints([HintRequest(feedback=WRONG)]) == ["none"]
    # the built-ins that do not read groups give the same hints with and without them
    for name in ("template", "raw_error"):
        p = build("hints", name)
        assert p.hints(reqs[:1]) == p.hints([HintRequest(feedback=WRONG, completion=comps[0])])


def test_a_provider_not_built_is_refused_by_the_hint_path():
    with pytest.raises(TypeError, match="build_hint_provider"):
        teacher_contexts(None, old_callable, [TASK], [" #### 3"], [WRONG])


def test_request_providers_get_each_rows_group_and_reward():
    groups = [_group(), _group(rewards=(0.0, 0.0, 0.0, 1.0))]
    new = build_hint_provider(NewStyle())
    assert new.__class__ is NewStyle and reads_groups(new) and reads_groups(build("hints", "demonstration"))
    reqs = hint_requests([WRONG] * 2, groups=groups)
    assert new.hints(reqs) == ["2 siblings succeeded (reward 0.0)", "1 siblings succeeded (reward 0.0)"]
    assert new.hints([HintRequest(feedback=WRONG)]) == ["no siblings succeeded (reward None)"]
    with pytest.raises(ValueError, match="1 groups for 2 rows"):
        hint_requests([WRONG] * 2, groups=groups[:1])
    # the chain hands each member the request; a member that reads groups makes the chain read them
    chain = build("hints", "chain", providers=[{"class_path": f"{__name__}.OldStyle"}, "demonstration"])
    assert reads_groups(chain)
    assert chain.hints(hint_requests([WRONG], None, [" #### 3"], None, groups[:1])) == ["Not #### 3."]
    chain = build("hints", "chain", providers=["demonstration", "template"])
    assert chain.hints(hint_requests([WRONG], None, [" #### 3"], None, groups[:1]))[0].startswith("Correct solution:")


def test_hints_of_kinds_the_env_could_not_judge_are_none():
    from composer_plugins.envs.base import UNJUDGED_KINDS

    for kind in sorted(UNJUDGED_KINDS):
        fb = Feedback(kind, "the sandbox failed", {}, None)
        assert not fb.needs_hint
        for name in ("template", "raw_error", "demonstration"):
            assert build("hints", name).hint(HintRequest(feedback=fb, group=_group())) is None, (name, kind)


def test_demonstration_rows_all_gives_successful_rows_a_siblings_demonstration():
    from composer_plugins.training.step.record import hint_candidates

    ok_row = _group(index=1)  # succeeded; row 3 succeeded too
    alone = _group(index=1, rewards=(0.0, 1.0, 0.0, 0.0))  # succeeded, no other success
    right = Feedback("correct", "", {}, 1.0)
    failed_only = DemonstrationHintProvider()
    every = build("hints", "demonstration", rows="all")
    assert failed_only.hint(HintRequest(feedback=right, group=ok_row)) is None
    assert every.hint(HintRequest(feedback=right, group=ok_row)) == (
        f"Correct solution:\n{GOOD_SHORT.strip()}\n\nCorrectly solve the original question."
    )
    assert every.hint(HintRequest(feedback=right, group=alone)) is None  # no sibling: nothing, not feedback
    assert every.hint(HintRequest(feedback=WRONG, group=_group())) == failed_only.hint(
        HintRequest(feedback=WRONG, group=_group())
    )
    # the rows a trainer offers: the failed ones, or every row for rows: all (then capped)
    assert hint_candidates(failed_only, [0.0, 1.0, 0.0, 1.0], 1.0) == [0, 2]
    assert hint_candidates(every, [0.0, 1.0, 0.0, 1.0], 1.0) == [0, 1, 2, 3]
    assert hint_candidates(every, [0.0, 1.0, 0.0, 1.0], 1.0, max_hinted=3) == [0, 1, 2]
    with pytest.raises(ConfigError, match=r"hints\.provider\.rows: .*'al'.*Did you mean 'all'"):
        build_component("hints", {"name": "demonstration", "rows": "al"}, key="hints.provider")


def test_teacher_contexts_with_demonstrations():
    groups = sibling_groups([" #### 3", GOOD_SHORT, " #### 2", " #### 5"], [0.0, 1.0, 0.0, 0.0], 2, 1.0)
    failed = [0, 2, 3]
    demo = build("hints", "demonstration", fallback="none")
    ctx = teacher_contexts(
        None, demo, [TASK] * 3, [groups[i].completion for i in failed], [WRONG] * 3, [groups[i] for i in failed]
    )
    assert ctx[0] is not None and "Hint: Correct solution:\n3 + 7 = 10.\n#### 10" in ctx[0]
    assert ctx[0].endswith("Correctly solve the original question.\nAnswer:")
    assert ctx[1] is None and ctx[2] is None  # the second group has no success


def test_a_provider_that_repeats_the_rows_own_completion_fails_conformance():
    from composer_plugins import hookimpl
    from composer_plugins.testing import ConformanceError, check_hint_provider, plugin_registry

    class Echo(HintProvider):
        def hint(self, request):
            g = request.group
            return None if request.feedback.ok else f"Correct solution: {g.completion if g else 'x'}"

    class Plugin:
        __name__ = "echo_hint_plugin"

        @hookimpl
        def register_hint_providers(self, register):
            register("echo_self", Echo)
            register("new_style", NewStyle)

    reg, _ = plugin_registry(Plugin())
    with pytest.raises(ConformanceError, match="repeats the row's own completion"):
        check_hint_provider("echo_self", reg)
    check_hint_provider("new_style", reg)
