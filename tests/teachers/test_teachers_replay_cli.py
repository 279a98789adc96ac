"""`composer-plugins replay run`: end to end, config errors, and kill -9 mid-run then resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from composer_plugins.core.errors import ConfigError
from composer_plugins.teachers.cache import ReplayCache
from composer_plugins.teachers.pairs import PAIR_FIELDS, validate_pair
from composer_plugins.teachers.runner import parse_config, run_from_file
from composer_plugins.testing.teacher_data import write_sample_traces

KEY_ENV = "CP_TEACHERS_TEST_KEY"  # same as conftest.py
SECRET = "sk-test-SUPERSECRET-7f3a9c"
REPO = Path(__file__).resolve().parents[2]


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
    }
    t.update(kw)
    return t


def _config(tmp_path: Path, srv, traces: Path, **over) -> Path:
    cfg = {
        "traces": [{"path": str(traces), "format": "auto"}],
        "teachers": [
            _teacher(srv, "teacher-a"),
            _teacher(srv, "teacher-b"),
            _teacher(srv, "c-wrong"),
            {"name": "oracle"},
        ],
        "consensus": {"k": 3},
        "budget": {"max_usd": 1.0},
        "cache": {"path": str(tmp_path / "cache" / "replay.sqlite")},
        "retry": {"max_retries": 4, "backoff_base_s": 0.01, "backoff_max_s": 0.05},
        "output": {
            "pairs": str(tmp_path / "out" / "pairs.jsonl"),
            "raw_pairs": str(tmp_path / "out" / "raw_pairs.jsonl"),
            "responses": str(tmp_path / "out" / "responses.jsonl"),
            "summary": str(tmp_path / "out" / "summary.json"),
        },
        "progress": False,
    }
    for k, v in over.items():
        cfg[k] = v
    p = tmp_path / "replay.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def test_replay_run_end_to_end_with_data_juicer(srv, tmp_path):
    from composer_plugins.core.cli import load_commands

    traces = write_sample_traces(tmp_path / "traces.jsonl", n=10, wrong_every=2)
    cfg = _config(tmp_path, srv, traces)
    res = CliRunner().invoke(load_commands(), ["replay", "run", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "pairs 5" in res.output and "data-juicer kept 5/5" in res.output
    pairs = [json.loads(x) for x in (tmp_path / "out" / "pairs.jsonl").read_text().splitlines()]
    assert len(pairs) == 5
    for p in pairs:
        assert validate_pair(p) == [] and set(PAIR_FIELDS) <= set(p)
        assert p["teachers"] == ["teacher-a", "teacher-b", "oracle"] and p["k"] == 3
        assert p["chosen"] == f"#### {p['metadata']['answer']}" and p["rejected"] != p["chosen"]
        assert p["messages"][0]["role"] == "system" and p["prompt"].startswith("<|system|>")
        assert p["prompt"].endswith("<|assistant|>\n")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["replay"]["completed"] == 40 and summary["pairs"]["pairs"] == 5
    assert summary["replay"]["total_spent_usd"] <= 1.0
    assert len((tmp_path / "out" / "responses.jsonl").read_text().splitlines()) == 10
    # warm rerun: no HTTP call, identical output
    before = srv.stats()["requests"]
    first = (tmp_path / "out" / "pairs.jsonl").read_text()
    res = CliRunner().invoke(
        load_commands(), ["replay", "run", "--config", str(cfg), "--json", "normalize.enabled=false"]
    )
    assert res.exit_code == 0, res.output
    s2 = json.loads(res.output)
    assert srv.stats()["requests"] == before
    assert s2["replay"]["cache_hits"] == 30 and s2["replay"]["calls"] == 10  # only the (free) oracle ran
    assert (tmp_path / "out" / "pairs.jsonl").read_text() == first
    # the key appears nowhere: output, files written
    assert SECRET not in res.output
    for f in list((tmp_path / "out").iterdir()) + list((tmp_path / "cache").iterdir()):
        assert SECRET.encode() not in f.read_bytes(), f


def test_config_errors_name_file_line_and_key(srv, tmp_path):
    traces = write_sample_traces(tmp_path / "traces.jsonl", n=2)
    cfg = _config(tmp_path, srv, traces)
    text = cfg.read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("consensus:", "consensus:\n  kk: 2"))
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: consensus.kk: unknown key.*Did you mean: 'k'"):
        run_from_file(bad)
    bad.write_text(text.replace("name: oracle", "name: oracel"))
    with pytest.raises(ConfigError, match=r"(?s)bad.yaml:\d+: teachers.3.name: .*Did you mean: 'oracle'"):
        run_from_file(bad)
    bad.write_text(text.replace("max_tokens: 32", "max_tokenz: 32", 1))
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: teachers.0.max_tokenz: unknown .*Did you mean: 'max_tokens'"):
        run_from_file(bad)
    from composer_plugins.core.config import load_config

    with pytest.raises(ConfigError, match="consensus.k: k=9 but only 4 teacher"):
        parse_config(load_config(cfg, ["consensus.k=9"]))


def _billed(srv) -> dict[str, int]:
    return {k: v[0] for k, v in srv.stats()["billed"].items()}


def test_kill_9_mid_run_then_resume_pays_only_missing_calls(srv, tmp_path):
    srv.configure(latency_s=0.05)
    n = 90
    traces = write_sample_traces(tmp_path / "traces.jsonl", n=n, wrong_every=3)
    cfg = _config(
        tmp_path,
        srv,
        traces,
        teachers=[_teacher(srv, "teacher-a", max_concurrency=2), _teacher(srv, "teacher-b", max_concurrency=2)],
        consensus={"k": 2},
        normalize={"enabled": False},
        budget={"max_usd": 5.0},
    )
    cmd = [sys.executable, "-m", "composer_plugins.core.cli", "replay", "run", "--config", str(cfg), "--no-progress"]
    env = {**os.environ, KEY_ENV: SECRET, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while srv.stats()["billed_calls"] < 30:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "the replay did not make progress"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    # requests the dead client had in flight still finish (and bill) on the server: let them land
    while srv.stats()["in_flight"] > 0:
        time.sleep(0.02)
    billed_1 = _billed(srv)
    with ReplayCache(tmp_path / "cache" / "replay.sqlite") as cache:
        cached = len(cache)
        run_id = "replay:" + str(tmp_path / "out" / "pairs.jsonl")
        ledger = cache.run_totals(run_id)
    total = 2 * n
    assert 0 < cached < total, "the run was not killed mid-way"
    assert ledger.paid_calls == cached  # a response and its ledger entry commit together
    # answers lost to the kill: at most 2 x max_concurrency per teacher (in flight + awaiting their commit)
    assert cached <= sum(billed_1.values()) <= cached + 8
    assert ledger.uncertain_calls == 1  # the dead process's spend lease
    # rerun to completion
    out = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    billed_2 = _billed(srv)
    new = {k: billed_2[k] - billed_1.get(k, 0) for k in billed_2 if billed_2[k] > billed_1.get(k, 0)}
    # pays only for the calls whose answers never landed in the cache
    assert sum(new.values()) == total - cached == summary["replay"]["completed"]
    assert all(v == 1 for v in new.values())
    assert summary["replay"]["cache_hits"] == cached
    # nothing lost; paid twice only for answers the killed process never committed
    assert len(billed_2) == total
    assert sum(1 for v in billed_2.values() if v > 1) == sum(billed_1.values()) - cached <= 8
    # the ceiling spans both processes
    assert summary["replay"]["prior_spent_usd"] == pytest.approx(ledger.paid_usd)
    assert summary["replay"]["prior_uncertain_usd"] == pytest.approx(ledger.uncertain_usd)
    assert ledger.uncertain_usd > 0  # the dead process's lease counts as spent
    assert summary["replay"]["total_spent_usd"] <= 5.0
    pairs = (tmp_path / "out" / "pairs.jsonl").read_text().splitlines()
    assert len(pairs) == n // 3 + (1 if n % 3 else 0)
    assert SECRET not in out.stdout + out.stderr


def _oracle_config(tmp_path: Path, traces: Path) -> Path:
    """A replay config with the free ``oracle`` teacher only (no server)."""
    cfg = {
        "traces": [str(traces)],
        "teachers": [{"name": "oracle"}],
        "consensus": {"k": 1, "compare": "final_answer"},
        "cache": {"enabled": False},
        "output": {"pairs": str(tmp_path / "out" / "pairs.jsonl")},
        "normalize": {"enabled": False},
        "progress": False,
    }
    p = tmp_path / "replay.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


NO_STUDENT_STEP = [
    {"id": "empty", "messages": []},
    {"id": "question-only", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
    {"id": "assistant-first", "messages": [{"role": "assistant", "content": "Hello."}]},
]


def test_replay_run_on_traces_without_a_student_step_names_the_lines_and_stops(tmp_path):
    from composer_plugins.core.cli import load_commands

    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps(c) + "\n" for c in NO_STUDENT_STEP))
    cfg = _oracle_config(tmp_path, traces)
    res = CliRunner().invoke(load_commands(), ["replay", "run", "--config", str(cfg)])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"Error: {traces}:1: traces.0: no conversation holds a student step"), res.output
    assert f"{traces}:2, {traces}:3" in res.output and "—" in res.output
    assert f"point traces.0 ({cfg}:2)" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "out").exists()


def test_replay_run_warns_with_the_count_when_some_conversations_have_no_student_step(tmp_path):
    from composer_plugins.core.cli import load_commands

    traces = write_sample_traces(tmp_path / "traces.jsonl", n=4, wrong_every=2)
    with traces.open("a") as f:
        for c in NO_STUDENT_STEP[:2]:
            f.write(json.dumps(c) + "\n")
    cfg = _oracle_config(tmp_path, traces)
    res = CliRunner().invoke(load_commands(), ["replay", "run", "--config", str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["states"] == 4
    assert res.stderr.startswith("warning: 2 conversation(s) hold no student step"), res.stderr
    assert f"skipped: {traces}:5, {traces}:6" in res.stderr
    assert len((tmp_path / "out" / "pairs.jsonl").read_text().splitlines()) == 2
