"""The one reader of ``env.step(...)`` results, shared by the training rollouts and the trace recorder.

An env's ``step`` may return (``envs.base.StepResult`` is the first shape):

* a tuple ``(obs, reward, done, info)`` — Gym's old API and :class:`composer_plugins.envs.base.StepResult`;
* a tuple ``(obs, reward, terminated, truncated, info)`` — Gymnasium: the episode ends on either flag;
* a tuple ``(obs, reward, done)``;
* a mapping or an object with ``observation``, ``reward``, ``done`` and optionally ``info`` (OpenEnv);
* a bare number: the reward of a single-turn env (the episode ends).

The reward stays ``None`` when the env gives none or ``None`` (unscorable; callers count it as they
choose). A result that does not say ``done`` ends the episode, so a loop never runs on by accident.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from composer_plugins.core.errors import ComposerPluginsError


class EnvStepError(ComposerPluginsError, ValueError):
    """``env.step`` returned something that is none of the supported shapes."""


def _info(v: Any) -> dict[str, Any]:
    return dict(v) if isinstance(v, Mapping) else {}


def step_result(res: Any, error: type[Exception] = EnvStepError) -> tuple[Any, float | None, bool, dict[str, Any]]:
    """``(observation, reward, done, info)`` from any supported ``env.step`` return shape."""
    if isinstance(res, tuple):
        if len(res) == 5:
            obs, reward, terminated, truncated, info = res
            return obs, reward, bool(terminated) or bool(truncated), _info(info)
        if len(res) == 4:
            obs, reward, done, info = res
            return obs, reward, bool(done), _info(info)
        if len(res) == 3:
            obs, reward, done = res
            return obs, reward, bool(done), {}
        raise error(
            f"env.step returned a tuple of {len(res)} items; expected (obs, reward, done, info), "
            "(obs, reward, terminated, truncated, info) or (obs, reward, done)"
        )
    if isinstance(res, Mapping):
        return res.get("observation"), res.get("reward"), bool(res.get("done", True)), _info(res.get("info"))
    if isinstance(res, bool):
        raise error("env.step returned a bool; return a reward, a StepResult or (obs, reward, done, info)")
    if isinstance(res, int | float):
        return None, float(res), True, {}
    if hasattr(res, "reward") or hasattr(res, "done") or hasattr(res, "observation"):
        return (
            getattr(res, "observation", None),
            getattr(res, "reward", None),
            bool(getattr(res, "done", True)),
            _info(getattr(res, "info", None)),
        )
    raise error(
        f"cannot read an env.step result of type {type(res).__name__}; return a StepResult, "
        "(obs, reward, done, info), a mapping with observation/reward/done, or a reward"
    )
