"""The ``openenv`` adapter against real OpenEnv servers on loopback (uvicorn, free port).

One server is a separate process running a guess-the-number environment written against
openenv-core's ``Environment`` API; the other serves the ``gsm8k`` env through
:func:`create_openenv_app` in a thread. Both are driven through openenv-core's WebSocket client.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from composer_plugins import build
from composer_plugins.envs.base import Feedback
from composer_plugins.envs.gsm8k import GSM8KEnv
from composer_plugins.envs.hints import HintRequest, build_teacher_context

SERVER = textwrap.dedent(
    '''
    import random
    from typing import Optional

    from openenv.core import Action, Environment, Observation, State, create_app


    class GuessAction(Action):
        message: str


    class GuessObservation(Observation):
        prompt: str = ""
        feedback: Optional[str] = None


    class GuessEnv(Environment):
        """Guess a number in 1..20; the feedback says higher or lower."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self.target = 0
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kwargs):
            self.target = random.Random(seed).randint(1, 20)
            self._state = State(episode_id=episode_id, step_count=0)
            return GuessObservation(prompt="Guess my number between 1 and 20.", done=False, reward=None)

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            digits = "".join(c for c in action.message if c.isdigit())
            if not digits:
                return GuessObservation(prompt="Say a number.", feedback="error: no number in your reply",
                                        done=False, reward=0.0)
            guess = int(digits)
            if guess == self.target:
                return GuessObservation(prompt="", feedback=None, done=True, reward=1.0)
            hint = "higher" if guess < self.target else "lower"
            done = self._state.step_count >= 6
            return GuessObservation(prompt=f"No. Go {hint}.", feedback=f"{guess} is wrong: go {hint}",
                                    done=done, reward=0.0)

        @property
        def state(self):
            return self._state


    app = create_app(GuessEnv, GuessAction, GuessObservation)
    '''
)


def target_for(seed: int) -> int:
    return random.Random(seed).randint(1, 20)


@pytest.fixture(scope="module")
def guess_server(tmp_path_factory):
    """``python -m uvicorn guess_server:app`` on 127.0.0.1 and a free port (read from uvicorn's log)."""
    d = tmp_path_factory.mktemp("openenv_server")
    (d / "guess_server.py").write_text(SERVER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "guess_server:app", "--host", "127.0.0.1", "--port", "0"],
        cwd=d,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    import composer_plugins.envs.openenv_env  # noqa: F401  (heavy import, overlapped with the server's start-up)

    url = None
    deadline = time.monotonic() + 120
    lines = []
    while url is None and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
        if m:
            url = m.group(1)
    if url is None:
        proc.kill()
        pytest.fail("the OpenEnv server did not start:\n" + "".join(lines))
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_health_and_registry(guess_server):
    assert httpx.get(guess_server + "/health", timeout=10).json()["status"] == "healthy"
    env = build("envs", "openenv", base_url=guess_server)
    assert env.name == "openenv"
    env.close()


def test_multi_turn_episode_with_feedback_and_hints(guess_server):
    env = build("envs", "openenv", base_url=guess_server, max_turns=8)
    try:
        obs = env.reset(seed=3)
        assert obs.text == "Guess my number between 1 and 20." and not obs.done
        lo, hi, result = 1, 20, None
        for _ in range(6):
            guess = (lo + hi) // 2
            result = env.step(f"I guess {guess}")
            observation, reward, done, info = result
            fb = info["feedback"]
            assert isinstance(fb, Feedback)
            if done:
                break
            assert fb.kind == "wrong_answer" and "go " in fb.message and reward == 0.0
            assert observation.text.startswith("No. Go ")
            if "higher" in fb.message:
                lo = guess + 1
            else:
                hi = guess - 1
            hint = build("hints", "template").hint(HintRequest(feedback=fb))
            ctx = build_teacher_context(observation.messages[:-1], hint)
            assert ctx[-1]["role"] == "user" and "Hint:" in ctx[-1]["content"]
        assert result is not None and result.done and result.reward == 1.0
        assert result.info["feedback"].ok
        bad = env.reset(seed=3)
        assert bad.text
        err = env.step("no digits here").info["feedback"]
        assert err.kind == "tool_error" and "no number" in err.message
    finally:
        env.close()


def test_single_turn_reward_replays_the_task_seed(guess_server):
    env = build("envs", "openenv", base_url=guess_server)
    try:
        tasks = env.sample_tasks(4, seed=7)
        assert len({t["reset_kwargs"]["seed"] for t in tasks}) == 4
        answers = [str(target_for(t["reset_kwargs"]["seed"])) for t in tasks]
        completions = [answers[0], answers[1], "21", "zero"]
        rewards = env.reward([t["prompt"] for t in tasks], completions, reset_kwargs=[t["reset_kwargs"] for t in tasks])
        assert rewards == [1.0, 1.0, 0.0, 0.0]
        ds = env.dataset(2, seed=1)  # reset_kwargs travel as JSON strings in a datasets.Dataset
        row = ds[0]
        assert env.reward([row["prompt"]], [str(target_for(1 * 100003))], reset_kwargs=[row["reset_kwargs"]]) == [1.0]
    finally:
        env.close()


def test_composer_env_served_as_openenv_round_trip():
    from composer_plugins.envs.openenv_env import OpenEnvEnv, create_openenv_app, serve

    with serve(create_openenv_app("gsm8k", difficulty=0)) as srv:
        assert srv.host == "127.0.0.1" and srv.port > 0
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        remote = OpenEnvEnv(srv.url)
        local = GSM8KEnv(difficulty=0)
        try:
            tasks = remote.sample_tasks(3, seed=2)
            gold = [local.reset(seed=t["reset_kwargs"]["seed"]).task for t in tasks]
            assert [t["prompt"] for t in tasks] == [g["prompt"] for g in gold]
            completions = [gold[0]["target"], "#### 1000", gold[2]["target"]]
            rewards = remote.reward(
                [t["prompt"] for t in tasks], completions, reset_kwargs=[t["reset_kwargs"] for t in tasks]
            )
            assert rewards == [1.0, 0.0, 1.0]
            fb = remote.feedback(tasks[1]["prompt"], "#### 1000", **tasks[1])
            assert fb.kind == "wrong_answer" and "1000" in fb.message
        finally:
            remote.close()
