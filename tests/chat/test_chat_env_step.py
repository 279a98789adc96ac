"""The one env step-result reader (``chat.env_step.step_result``), including where the two old copies disagreed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from composer_plugins.chat.env_step import EnvStepError, step_result
from composer_plugins.envs.base import StepResult


def test_the_envs_own_step_result_and_gym_tuples():
    info = {"feedback": "close"}
    assert step_result(StepResult("obs", 1.0, False, info)) == ("obs", 1.0, False, info)
    assert step_result(("o", 0.5, True)) == ("o", 0.5, True, {})


def test_gymnasium_truncation_ends_the_episode_and_keeps_info():
    # the training copy read (obs, r, terminated, truncated, info) as done=terminated and dropped info
    assert step_result(("o", 0.0, False, True, {"k": 1})) == ("o", 0.0, True, {"k": 1})
    assert step_result(("o", 1.0, True, False, {})) == ("o", 1.0, True, {})
    assert step_result(("o", 1.0, False, False, {}))[2] is False


def test_mappings_and_objects_keep_info_and_an_unscorable_reward():
    # the recorder's copy dropped info (where the env's feedback lives) and turned None into 0.0
    assert step_result({"observation": "o", "reward": None, "done": False, "info": {"feedback": "x"}}) == (
        "o",
        None,
        False,
        {"feedback": "x"},
    )
    obj = SimpleNamespace(observation="o", reward=2.0, done=False, info={"a": 1})
    assert step_result(obj) == ("o", 2.0, False, {"a": 1})


def test_a_result_that_does_not_say_done_ends_the_episode():
    # the training copy defaulted to done=False, the recorder's to True: an unsaid "done" ends it
    assert step_result({"reward": 1.0})[2] is True
    assert step_result(SimpleNamespace(reward=1.0))[2] is True
    assert step_result(0.25) == (None, 0.25, True, {})


def test_other_shapes_are_refused_with_the_callers_error():
    with pytest.raises(EnvStepError, match="tuple of 2 items"):
        step_result(("o", 1.0))
    with pytest.raises(EnvStepError, match="of type object"):
        step_result(object())

    class MyError(Exception):
        pass

    with pytest.raises(MyError, match="bool"):
        step_result(True, error=MyError)
