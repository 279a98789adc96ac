"""Issue 19, against the real loopback server: key fragments, pasted keys, phantom spend,
the lease after a crash, bad replay input, and a failed replay failing the command."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.core.io import atomic_write_text
from composer_plugins.teachers.base import TeacherError
from composer_plugins.teachers.cache import ReplayCache
from composer_plugins.teachers.engine import ReplayEngine, RetryPolicy
from composer_plugins.testing.teacher_data import write_sample_traces

KEY_ENV = "CP_TEACHERS_TEST_KEY"  # same as conftest.py
SECRET = "sk-test-SUPERSECRET-7f3a9c"
REPO = Path(__file__).resolve().parents[2]
#: a 44-character key, like the one the issue saw cut to 28 characters
LONG_KEY = "sk-proj-Zq8XbT3kWm9Lp2Rv7Ns4Hd6Fy1Jc5Ga0Ue8Q"
LONG_ENV = "CP_TEACHERS_LONG_KEY"
FAST_RETRY = {"max_retries": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.02}


def _cli():
    from composer_plugins.core.cli import load_commands

    return load_commands()


def fragments(key: str, n: int = 8) -> set[str]:
    return {key[i : i + n] for i in range(len(key) - n + 1)}


def leaks(text: str, key: str) -> list[str]:
    """The 8-character pieces of ``key`` found in ``text``."""
    return sorted(f for f in fragments(key) if f in text)


def _teacher(srv, model: str, **kw) -> dict:
    t = {
        "name": "openai",
        "id": model,
        "model": model,
        "base_url": srv.base_url,
        "api_key_env": KEY_ENV,
        "prompt_usd_per_token": 1e-6,
        "completion_usd_per_token": 4e-6,
        "max_tokens": 32,
        "max_concurrency": 4,
        "timeout_s": 5.0,
    }
    t.update(kw)
    return t


def _config(tmp_path: Path, srv, teachers: list[dict], n: int = 10, **over) -> Path:
    traces = write_sample_traces(tmp_path / "traces.jsonl", n=n, wrong_every=2)
    cfg = {
        "traces": [str(traces)],
        "teachers": teachers,
        "consensus": {"k": 1},
        "cache": {"path": str(tmp_path / "cache" / "replay.sqlite")},
        "retry": dict(FAST_RETRY),
        "normalize": {"enabled": False},
        "output": {
            "pairs": str(tmp_path / "out" / "pairs.jsonl"),
            "summary": str(tmp_path / "out" / "summary.json"),
        },
        "progress": False,
    }
    cfg.update(over)
    p = tmp_path / "replay.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def _post(srv, auth: str, content: str) -> bytes:
    """One raw request (to find where the server puts an echoed key in its body)."""
    body = json.dumps({"model": "probe", "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(
        srv.base_url + "/chat/completions",
        data=body,
        headers={"Authorization": auth, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        return e.read()


def _all_written(tmp_path: Path) -> str:
    out = []
    for f in tmp_path.rglob("*"):
        if f.is_file():
            out.append(f.read_bytes().decode("utf-8", "replace"))
    return "\n".join(out)


# -- 1. part of the key leaks -----------------------------------------------------------------


def test_scrub_masks_any_long_fragment_and_bearer_tokens():
    from composer_plugins.teachers.base import scrub_secret

    key = LONG_KEY
    assert scrub_secret(f"x {key} y", key) == "x **** y"
    assert scrub_secret(f"cut:{key[:28]}", key) == "cut:****"  # the head of a cut key
    assert scrub_secret(f"{key[17:]}...", key) == "****..."  # its tail
    assert scrub_secret(f"a{key[5:13]}b", key) == "a****b"  # 8 characters are enough
    assert scrub_secret(f"a{key[5:12]}!", key) == f"a{key[5:12]}!"  # 7 are not
    assert scrub_secret("Authorization: Bearer abc.def-ghi", None) == "Authorization: Bearer ****"
    assert scrub_secret("bearer  sk-x", "zzzzzzzzzzz") == "bearer  ****"
    assert scrub_secret("tiny key k3y!", "k3y!") == "tiny key ****"
    assert scrub_secret("", key) == ""


@pytest.mark.parametrize("client", ["aiohttp"])  # the one transport (httpx removed: bench_replay)
def test_key_echoed_across_the_cut_never_leaks(srv, tmp_path, monkeypatch, client):
    """A 401 echoing ``Bearer <key>`` across the 300-character cut, and a malformed 200 echoing the
    bare key across the 200-character cut: no 8-character piece of either key reaches the summary,
    the ``--json`` output or any file written."""
    monkeypatch.setenv(LONG_ENV, LONG_KEY)
    assert len(LONG_KEY) == 44
    # (a) 401 with the wrong (44-character) key: place it across character 300 of the body
    i0 = _post(srv, "Bearer " + LONG_KEY, "probe-401").decode().index(LONG_KEY)
    srv.configure(echo_pad=300 - len(LONG_KEY) // 2 - i0)
    body = _post(srv, "Bearer " + LONG_KEY, "probe-401b").decode()
    assert body.index(LONG_KEY) < 300 < body.index(LONG_KEY) + len(LONG_KEY)
    cfg = _config(tmp_path, srv, [_teacher(srv, "teacher-a", api_key_env=LONG_ENV, http_client=client)], n=4)
    res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg), "--json"])
    assert leaks(res.output, LONG_KEY) == []
    assert leaks(_all_written(tmp_path), LONG_KEY) == []
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["failures"]["by_kind"] == {"http_401": 4}
    assert "****" in summary["failures"]["examples"][0] and "HINT" in summary["failures"]["examples"][0]
    assert res.exit_code == 3, res.output  # nothing answered: the run fails (item 6)
    # (b) a malformed 200 (a leaky proxy) echoing the bare right key across character 200
    srv.configure(echo_pad=0, fault_rate=1.0, plan=["echo"] * 5)
    j0 = _post(srv, "Bearer " + SECRET, "probe-echo").decode().index(SECRET)
    srv.configure(echo_pad=200 - len(SECRET) // 2 - j0)
    body = _post(srv, "Bearer " + SECRET, "probe-echo2").decode()
    assert body.index(SECRET) < 200 < body.index(SECRET) + len(SECRET)
    cfg = _config(tmp_path, srv, [_teacher(srv, "teacher-b", http_client=client)], n=4)
    res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg), "--json"])
    assert leaks(res.output, SECRET) == []
    assert leaks(_all_written(tmp_path), SECRET) == []
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["failures"]["by_kind"] == {"malformed": 4}
    assert "****" in summary["failures"]["examples"][0]
    assert res.exit_code == 3, res.output


# -- 2. a pasted key is printed back ------------------------------------------------------------


def test_pasted_key_in_api_key_env_is_refused_without_echo(srv, tmp_path):
    hf_token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"  # an identifier, like real HF tokens
    assert hf_token.isidentifier()
    cfg = _config(tmp_path, srv, [_teacher(srv, "teacher-a", api_key_env=hf_token)])
    lines = cfg.read_text().splitlines()
    line = next(i for i, t in enumerate(lines, 1) if t.strip().startswith("api_key_env:"))
    res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg)])
    assert res.exit_code == 2, res.output
    assert f"replay.yaml:{line}: teachers.0.api_key_env:" in res.output
    assert "NAME of an environment variable" in res.output and "not shown" in res.output
    assert leaks(res.output, hf_token) == []
    assert srv.stats()["requests"] == 0
    with pytest.raises(TeacherError) as ei:
        from composer_plugins.teachers.openai_compat import OpenAITeacher

        OpenAITeacher("m", api_key_env=hf_token)
    assert leaks(str(ei.value), hf_token) == [] and ei.value.field == "api_key_env"
    # ordinary variable names are still fine
    for name in ("OPENROUTER_API_KEY", "HF_TOKEN", "CP_TEACHERS_TEST_KEY", "together_api_key"):
        OpenAITeacher("m", api_key_env=name)


# -- 3. phantom spend from a URL typo -----------------------------------------------------------


def test_base_url_without_scheme_is_a_located_config_error(srv, tmp_path):
    bare = srv.base_url.removeprefix("http://")
    cfg = _config(tmp_path, srv, [_teacher(srv, "teacher-a", base_url=bare)], budget={"max_usd": 0.01})
    lines = cfg.read_text().splitlines()
    line = next(i for i, t in enumerate(lines, 1) if t.strip().startswith("base_url:"))
    res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg)])
    assert res.exit_code == 2, res.output
    assert f"replay.yaml:{line}: teachers.0.base_url:" in res.output
    assert bare in res.output and f"http://{bare}" in res.output  # names the URL and the fix
    assert srv.stats()["requests"] == 0
    assert not (tmp_path / "cache" / "replay.sqlite").exists()  # nothing was booked anywhere


@pytest.mark.parametrize("client", ["aiohttp"])  # the one transport (httpx removed: bench_replay)
def test_requests_never_sent_book_no_uncertain_spend(srv, make_teacher, states_factory, tmp_path, client):
    """A URL the HTTP client refuses (what an unvalidated `127.0.0.1:PORT/v1` was) fails before
    anything is sent: no uncertain spend, nothing in the ledger, and after the fix the same run id
    answers everything without --fresh-budget."""
    states = states_factory(10)
    t = make_teacher("teacher-a", http_client=client)
    ceiling = 12 * t.max_cost(states[0].messages)  # 10 calls fit, not many phantom worst cases
    t.url = t.url.removeprefix("http://")  # bypass the config check: what the old config let through
    retry = RetryPolicy(max_retries=4, backoff_base_s=0.01, backoff_max_s=0.02)
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        res = ReplayEngine([t], cache=cache, max_usd=ceiling, retry=retry, run_id="typo", progress=False).run(states)
        totals = cache.run_totals("typo")
    assert res.stats.completed == 0 and len(res.failures) == 10
    assert {f.kind for f in res.failures} == {"bad_url"}
    assert t.url in res.failures[0].message and "nothing was sent" in res.failures[0].message
    assert all(f.attempts == 1 for f in res.failures)  # not retried: it cannot work
    assert res.stats.uncertain_usd == 0 and res.stats.spent_usd == 0
    assert totals.total_usd == 0 and totals.uncertain_calls == 0
    assert srv.stats()["requests"] == 0
    fixed = make_teacher("teacher-a", http_client=client)
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        res = ReplayEngine([fixed], cache=cache, max_usd=ceiling, retry=retry, run_id="typo", progress=False).run(
            states
        )
    assert res.stats.completed == 10 and not res.failures


# -- 4. the lease after a crash -----------------------------------------------------------------


def _ledger(path: Path, run_id: str) -> dict[str, float]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute(
            "SELECT status, COALESCE(SUM(amount), 0) FROM ledger WHERE run_id = ? GROUP BY status", (run_id,)
        ).fetchall()
    finally:
        con.close()
    return {k: float(v) for k, v in rows}


def test_ledger_counts_each_call_once_while_running(srv, make_teacher, states_factory, tmp_path):
    """Sampled from another connection during a run under a tight ceiling: paid + maybe + lease
    stays under the ceiling, and the lease only covers what is in flight (plus a small spare)."""
    srv.configure(latency_s=0.03)
    states = states_factory(40)
    teachers = [make_teacher(m, max_concurrency=4) for m in ("teacher-a", "teacher-b")]
    wc = max(t.max_cost(s.messages) for t in teachers for s in states)
    ceiling = 30 * wc  # about half the job: the ceiling binds
    path = tmp_path / "c.sqlite"
    samples: list[dict[str, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            if path.exists():
                try:
                    samples.append(_ledger(path, "tight"))
                except sqlite3.OperationalError:
                    pass
            time.sleep(0.005)

    th = threading.Thread(target=sample)
    th.start()
    try:
        with ReplayCache(path) as cache:
            res = ReplayEngine(teachers, cache=cache, max_usd=ceiling, run_id="tight", progress=False).run(states)
    finally:
        done.set()
        th.join()
    assert res.stats.skipped_budget > 0 and res.stats.completed > 20
    with_lease = [s for s in samples if s.get("lease", 0) > 0]
    assert len(with_lease) > 10
    for s in samples:
        assert sum(s.values()) <= ceiling * (1 + 1e-9), s
        # 8 calls in flight at most, each counted once; the spare is a tenth of what is left
        assert s.get("lease", 0) <= 8 * wc + 0.1 * ceiling + 1e-12, s
    final = _ledger(path, "tight")
    assert "lease" not in final  # a clean exit leaves no lease
    assert final["paid"] == pytest.approx(res.stats.spent_usd)


def test_kill_9_under_a_tight_ceiling_leaves_the_ceiling_usable(srv, tmp_path):
    """kill -9 late in a run whose ceiling binds: the ledger stays under the ceiling, exceeds what
    the server really billed by at most the calls in flight, and the rerun carries on."""
    srv.configure(latency_s=0.1)
    n = 80
    teachers = [_teacher(srv, m, max_concurrency=4) for m in ("teacher-a", "teacher-b")]
    from composer_plugins.teachers.openai_compat import OpenAITeacher
    from composer_plugins.teachers.traces import load_traces

    cfg = _config(tmp_path, srv, teachers, n=n)
    states = load_traces([str(tmp_path / "traces.jsonl")])
    probe = OpenAITeacher(
        "teacher-a",
        base_url=srv.base_url,
        api_key_env=None,
        prompt_usd_per_token=1e-6,
        completion_usd_per_token=4e-6,
        max_tokens=32,
    )
    wc = max(probe.max_cost(s.messages) for s in states)
    ceiling = 40 * wc  # the job would need about 80 worst cases of real spend
    cfg = _config(tmp_path, srv, teachers, n=n, budget={"max_usd": ceiling})
    cmd = [sys.executable, "-m", "composer_plugins.core.cli", "replay", "run", "--config", str(cfg), "--no-progress"]
    env = {**os.environ, KEY_ENV: SECRET, "PYTHONPATH": str(REPO)}

    def billed_usd() -> float:
        st = srv.stats()
        return sum(pt * 1e-6 + ct * 4e-6 for _, pt, ct in st["billed"].values())

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while billed_usd() < 0.7 * ceiling:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "the replay did not make progress"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
    while srv.stats()["in_flight"] > 0:
        time.sleep(0.02)
    real = billed_usd()
    run_id = "replay:" + str(tmp_path / "out" / "pairs.jsonl")
    led = _ledger(tmp_path / "cache" / "replay.sqlite", run_id)
    total = sum(led.values())
    assert real <= total <= ceiling * (1 + 1e-9), (led, real, ceiling)
    # each call counted once: the excess is the worst case of the (at most 8) calls in flight,
    # plus a spare of at most a tenth of what was left
    assert total - real <= 8 * wc + 0.1 * (ceiling - real), (led, real)
    # the rerun carries on under the same ceiling
    out = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode in (0, 3), out.stderr  # 3: the ceiling left calls unanswered, as it should
    s = json.loads(out.stdout.strip().splitlines()[-1])
    assert s["replay"]["calls"] > 0 and s["replay"]["completed"] > 0
    assert s["replay"]["total_spent_usd"] <= ceiling * (1 + 1e-9)
    assert billed_usd() <= ceiling  # real money, across both processes


# -- 5. bad replay input --------------------------------------------------------------------------


CONFIG_TEMPLATE = """\
traces:
  - {traces}
teachers:
  - name: openai
    model: teacher-a
    base_url: {base_url}
    api_key_env: {key_env}
    max_tokens: {max_tokens}
    prompt_usd_per_token: {prompt_price}
    completion_usd_per_token: {completion_price}
    timeout_s: {timeout}
consensus: {{k: 1}}
cache: {{path: {cache}}}
output: {{pairs: {pairs}, summary: {summary}}}
normalize: {{enabled: false}}
progress: false
"""
LINE_OF = {"max_tokens": 8, "prompt_usd_per_token": 9, "completion_usd_per_token": 10, "timeout_s": 11}


def _write(tmp_path: Path, srv, **kw) -> Path:
    write_sample_traces(tmp_path / "traces.jsonl", n=3)
    vals = {
        "traces": str(tmp_path / "traces.jsonl"),
        "base_url": srv.base_url,
        "key_env": KEY_ENV,
        "max_tokens": "32",
        "prompt_price": "1.0e-6",
        "completion_price": "4.0e-6",
        "timeout": "5",
        "cache": str(tmp_path / "cache" / "c.sqlite"),
        "pairs": str(tmp_path / "out" / "pairs.jsonl"),
        "summary": str(tmp_path / "out" / "summary.json"),
    }
    vals.update(kw)
    p = tmp_path / "bad.yaml"
    p.write_text(CONFIG_TEMPLATE.format(**vals))
    return p


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("max_tokens", "lots", "max_tokens must be a whole number, got 'lots'"),
        # `2e-6` unquoted is the float (YAML 1.2, tests/core/test_core_config.py); quoted it is text
        (
            "completion_price",
            "'2e-6'",
            "It is quoted, so YAML reads it as text. HINT: write completion_usd_per_token: 2e-6",
        ),
        ("prompt_price", "-1.0e-6", "prompt_usd_per_token must be >= 0"),
        ("timeout", "-1", "timeout_s must be > 0, got -1"),
    ],
)
def test_bad_teacher_values_are_located_errors_with_the_fix(srv, tmp_path, field, value, expect):
    name = {"completion_price": "completion_usd_per_token", "prompt_price": "prompt_usd_per_token"}.get(field, field)
    name = "timeout_s" if name == "timeout" else name
    cfg = _write(tmp_path, srv, **{field: value})
    res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg)])
    assert res.exit_code == 2, res.output
    assert f"bad.yaml:{LINE_OF[name]}: teachers.0.{name}:" in res.output, res.output
    assert expect in res.output and "HINT" in res.output
    assert "not supported between" not in res.output
    assert srv.stats()["requests"] == 0


@pytest.mark.parametrize("which", ["cache", "pairs", "summary"])
def test_paths_running_into_a_regular_file_are_refused_before_any_call(srv, tmp_path, which):
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file\n")
    cfg = _write(tmp_path, srv, **{which: str(blocker / "sub" / f"{which}.out")})
    res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg)])
    assert res.exit_code == 2, res.output
    key = {"cache": "cache.path", "pairs": "output.pairs", "summary": "output.summary"}[which]
    assert "bad.yaml:" in res.output and f"{key}:" in res.output, res.output
    assert f"{blocker} is a regular file" in res.output and "HINT" in res.output
    assert not isinstance(res.exception, FileExistsError | NotADirectoryError)
    assert srv.stats()["requests"] == 0  # refused before anything was paid


def test_a_write_that_fails_late_is_an_error_not_a_traceback(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    with pytest.raises(ComposerPluginsError, match="is a regular file"):
        atomic_write_text(blocker / "out.jsonl", "{}\n")
    from composer_plugins.teachers.cache import CacheError

    with pytest.raises(CacheError, match="is a regular file"):
        ReplayCache(blocker / "c.sqlite")


# -- 6. a failed replay fails the stage --------------------------------------------------------------


def test_outage_fails_the_command_and_the_threshold_is_honoured(srv, tmp_path):
    outage = ["503"] * 100  # every attempt of a faulty request fails (the plan outlasts the retries)
    srv.configure(fault_rate=1.0, plan=outage)
    cfg = _config(tmp_path, srv, [_teacher(srv, "teacher-a"), _teacher(srv, "teacher-b")], n=10)
    for extra in ([], ["--json"]):
        res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg), *extra])
        assert res.exit_code == 3, res.output
        assert "20 of 20 teacher calls got no answer" in res.output and "max_unanswered" in res.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["ok"] is False and summary["failures"]["unanswered"] == 20
    # a partial outage under a documented threshold passes; over it, fails
    srv.reset()
    srv.configure(fault_rate=0.3, plan=outage)
    res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg), "--json", "max_unanswered=0.9"])
    assert res.exit_code == 0, res.output
    frac = json.loads(res.output)["failures"]["unanswered_fraction"]
    assert 0 < frac < 0.9
    res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg), "--json", f"max_unanswered={frac / 2}"])
    assert res.exit_code == 3, res.output
    res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg), "max_unanswered=2"])
    assert res.exit_code == 2 and "max_unanswered: must be a fraction between 0 and 1" in res.output
    # once the provider is back, the rerun answers the rest and succeeds
    srv.configure(fault_rate=0.0)
    res = CliRunner().invoke(_cli(), ["replay", "run", "--config", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ok"] is True
