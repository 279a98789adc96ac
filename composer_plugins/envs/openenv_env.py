"""``openenv``: drive any environment that speaks the OpenEnv protocol as an env plugin; and the reverse.

:class:`OpenEnvEnv` is the client (single-turn ``reward`` needs a deterministic ``reset(seed=...)``);
:class:`ComposerEnvironment` + :func:`create_openenv_app` serve any composer env as an OpenEnv server, and
:func:`serve` runs one with uvicorn on loopback. Usage: docs/envs.md, "``openenv``".
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from openenv.core import Action, Environment, GenericEnvClient, State, create_app
from openenv.core import Observation as OEObservation
from pydantic import Field

from composer_plugins.core.errors import ConfigError
from composer_plugins.envs.base import Env, Feedback, Observation, StepResult, completion_text

__all__ = [
    "ComposerEnvironment",
    "OpenEnvEnv",
    "OpenEnvServer",
    "TextAction",
    "TextObservation",
    "create_openenv_app",
    "serve",
]

_TEXT_KEYS = ("prompt", "text", "question", "message", "content", "echoed_message", "observation", "output")
_FEEDBACK_KEYS = ("feedback", "error", "message", "stderr", "output")


class TextAction(Action):
    """An OpenEnv action carrying the model's reply as text."""

    message: str = Field(..., description="The model's reply (a completion)")


class TextObservation(OEObservation):
    """An OpenEnv observation with the prompt text and the verifier's feedback."""

    prompt: str = Field(default="", description="Text shown to the policy")
    feedback: str | None = Field(default=None, description="What was wrong with the last reply")
    feedback_kind: str | None = Field(default=None, description="Feedback kind (wrong_answer, test_failure ...)")
    task_id: str | None = Field(default=None, description="The task being solved")


class ComposerEnvironment(Environment[TextAction, TextObservation, State]):
    """A composer env served as an OpenEnv :class:`~openenv.core.Environment` (one instance per session)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, env: Env | str = "gsm8k", split: str = "train", **env_kwargs: Any) -> None:
        super().__init__()
        if isinstance(env, str):
            from composer_plugins import build

            env = build("envs", env, **env_kwargs)
        self.env: Env = env
        self.split = split
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> TextObservation:
        obs = self.env.reset(task=kwargs.get("task"), seed=seed, split=kwargs.get("split", self.split))
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        return TextObservation(prompt=obs.text, task_id=obs.task.get("task_id"), done=False, reward=None)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        res = self.env.step(action.message)
        self._state.step_count += 1
        fb: Feedback = res.info["feedback"]
        return TextObservation(
            prompt=res.observation.text,
            feedback=None if fb.ok else fb.message,
            feedback_kind=fb.kind,
            task_id=res.info.get("task_id"),
            done=res.done,
            reward=res.reward,
        )

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        self.env.close()


def create_openenv_app(env: str | Callable[[], Environment] = "gsm8k", **env_kwargs: Any) -> Any:
    """An OpenEnv FastAPI app (``/ws``, ``/health``, ``/reset``, ``/step`` ...) serving a composer env."""
    factory = env if callable(env) else (lambda: ComposerEnvironment(env, **env_kwargs))
    return create_app(factory, TextAction, TextObservation, env_name=str(env) if isinstance(env, str) else None)


class OpenEnvServer:
    """A uvicorn server running in a background thread on loopback (see :func:`serve`)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 30.0) -> None:
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="openenv-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server did not start on {host}:{port}")
            time.sleep(0.02)
        self.host, self.port = self.server.servers[0].sockets[0].getsockname()[:2]

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Stop the server and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextlib.contextmanager
def serve(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[OpenEnvServer]:
    """Run an ASGI app with uvicorn on ``host`` (a free port by default) for the ``with`` block."""
    srv = OpenEnvServer(app, host, port)
    try:
        yield srv
    finally:
        srv.close()


def _render(observation: Mapping[str, Any], keys: Sequence[str]) -> str:
    for k in keys:
        v = observation.get(k)
        if isinstance(v, str) and v:
            return v
    return json.dumps(dict(observation), sort_keys=True, default=repr)


class OpenEnvEnv(Env):
    """Any OpenEnv server (WebSocket /ws protocol, via openenv-core's GenericEnvClient) as an env plugin.

    Args:
        base_url: the server (``http://host:port`` or ``ws://...``).
        action_key, action_fields, text_keys, feedback_keys, success_reward: docs/envs.md, "``openenv``".
        reset_kwargs: extra keyword arguments for every ``reset``.
        seed_offset: task ``i`` of ``sample_tasks(seed=s)`` resets with seed ``s * 100003 + i + seed_offset``.
        max_turns: turns per episode before the adapter ends it (the server may end it earlier).
    """

    name = "openenv"

    def __init__(
        self,
        base_url: str,
        *,
        action_key: str = "message",
        action_fields: Mapping[str, Any] | None = None,
        text_keys: Sequence[str] = _TEXT_KEYS,
        feedback_keys: Sequence[str] = _FEEDBACK_KEYS,
        success_reward: float = 1.0,
        reset_kwargs: Mapping[str, Any] | None = None,
        seed_offset: int = 0,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        max_turns: int = 8,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("num_workers", None)  # one WebSocket session: scoring is sequential
        super().__init__(max_turns=max_turns, num_workers=1, **kwargs)
        if not base_url or not isinstance(base_url, str):
            raise ConfigError("base_url is required (http://host:port of an OpenEnv server)", key="base_url")
        self.base_url = base_url
        self.action_key = action_key
        self.action_fields = dict(action_fields or {})
        self.text_keys = tuple(text_keys)
        self.feedback_keys = tuple(feedback_keys)
        self.success_reward = success_reward
        self.reset_kwargs = dict(reset_kwargs or {})
        self.seed_offset = seed_offset
        self._client_args = {"connect_timeout_s": connect_timeout_s, "message_timeout_s": message_timeout_s}
        self._client: Any = None
        self._session_lock = threading.RLock()
        self._turn = 0
        self._last_obs: dict[str, Any] = {}

    # -- connection ----------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        """The synchronous OpenEnv client (connected on first use)."""
        if self._client is None:
            self._client = GenericEnvClient(base_url=self.base_url, **self._client_args).sync()
            self._client.connect()
        return self._client

    def close(self) -> None:
        """Close the WebSocket session."""
        super().close()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None

    # -- episode API --------------------------------------------------------------------------
    def _reset_raw(self, **kwargs: Any) -> Any:
        with self._session_lock:
            return self.client.reset(**{**self.reset_kwargs, **kwargs})

    def _step_raw(self, text: str) -> Any:
        with self._session_lock:
            return self.client.step({**self.action_fields, self.action_key: text})

    def reset(
        self, task: Mapping[str, Any] | None = None, seed: int | None = None, split: str = "train"
    ) -> Observation:
        """Reset the remote environment (with ``task["reset_kwargs"]`` or ``seed``)."""
        kwargs = _reset_kwargs_of(task) if task is not None else ({"seed": seed} if seed is not None else {})
        res = self._reset_raw(**kwargs)
        obs = dict(res.observation or {})
        text = _render(obs, self.text_keys)
        self._turn = 0
        self._last_obs = obs
        t = dict(task or {})
        t.setdefault("prompt", text)
        t.setdefault("reset_kwargs", kwargs)
        self._episode = {"task": t, "turn": 0, "messages": [{"role": "user", "content": text}]}
        return Observation(text=text, messages=list(self._episode["messages"]), task=t, done=bool(res.done))

    def step(self, action: Any) -> StepResult:
        """Send the completion; the server's reward and done flag come back with a :class:`Feedback`."""
        if self._episode is None:
            raise RuntimeError("OpenEnvEnv.step() called before reset()")
        text = action if isinstance(action, str) else completion_text(action)
        res = self._step_raw(text)
        self._turn += 1
        obs = dict(res.observation or {})
        fb = self._feedback(obs, res.reward)
        done = bool(res.done) or self._turn >= self.max_turns
        next_text = "" if res.done else _render(obs, self.text_keys)
        ep = self._episode
        ep["messages"].append({"role": "assistant", "content": text})
        if not done:
            ep["messages"].append({"role": "user", "content": next_text})
        o = Observation(next_text, list(ep["messages"]), ep["task"], fb, done, res.reward)
        return StepResult(o, res.reward, done, {"feedback": fb, "turn": self._turn, "observation": obs})

    def _feedback(self, obs: Mapping[str, Any], reward: float | None) -> Feedback:
        details = {"observation": dict(obs), "reward": reward}
        if reward is not None and reward >= self.success_reward:
            return Feedback("correct", f"reward {reward}", details, float(reward))
        text = next((str(obs[k]) for k in self.feedback_keys if isinstance(obs.get(k), str) and obs.get(k)), "")
        looks_like_error = bool(obs.get("error")) or bool(re.match(r"\s*(error|exception|traceback)\b", text, re.I))
        kind = str(obs.get("feedback_kind") or ("tool_error" if looks_like_error else "wrong_answer"))
        if kind == "correct":
            kind = "wrong_answer"
        return Feedback(kind, text or f"reward {reward}", details, None if reward is None else float(reward))

    # -- single-turn API ------------------------------------------------------------------------
    def sample_tasks(self, n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
        """Reset ``n`` times with derived seeds; each task records its prompt and reset arguments."""
        out = []
        for i in range(n):
            kwargs = {"seed": seed * 100003 + i + self.seed_offset}
            if split != "train":
                kwargs["split"] = split
            obs = dict(self._reset_raw(**kwargs).observation or {})
            out.append(
                {
                    "task_id": f"openenv-{split}-{seed}-{i}",
                    "prompt": _render(obs, self.text_keys),
                    "reset_kwargs": kwargs,
                    "observation": obs,
                }
            )
        return out

    def _score(self, completion: str, task: Mapping[str, Any]) -> Feedback:
        kwargs = _reset_kwargs_of(task)
        if not kwargs and "prompt" not in task:
            return Feedback("unscorable", "the task has no reset_kwargs to replay", {}, None)
        with self._session_lock:
            try:
                self._reset_raw(**kwargs)
                res = self._step_raw(completion)
            except (RuntimeError, ConnectionError, TimeoutError, OSError) as e:
                return Feedback("tool_error", f"the OpenEnv server failed: {e}", {"error": str(e)}, None)
        return self._feedback(dict(res.observation or {}), res.reward)


def _reset_kwargs_of(task: Mapping[str, Any] | None) -> dict[str, Any]:
    if not task:
        return {}
    kw = task.get("reset_kwargs") or {}
    if isinstance(kw, str):
        kw = json.loads(kw)
    return dict(kw)
