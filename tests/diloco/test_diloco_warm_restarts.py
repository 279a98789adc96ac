"""Warm restarts (issue 42, goodput under failures): a replica the launcher starts again is forked from a server
that has already imported what a replica imports, and the run ends as without it (every replica on one hash, the
restarted one back in the rounds); the server and its children are gone when the group stops."""

from __future__ import annotations

import json
import time

import pytest

from composer_plugins import procs
from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.diloco.common import DiLoCoConfig
from composer_plugins.diloco.executors import make_executor
from composer_plugins.diloco.launch import LaunchError, LocalProcessExecutor, ReplicaGroup, replica_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_a_restarted_replica_is_forked_warm_and_the_run_ends_on_one_hash(tmp_path):
    log_dir = tmp_path / "logs"
    ov = ["diloco.sync_every=4", "diloco.transport=object_store", "diloco.round_timeout_s=20", "toy.max_steps=64"]
    argv = lambda i: replica_argv("toy", None, [*ov, f"toy.output={log_dir}/result{i}.json"])  # noqa: E731
    with ReplicaGroup(
        argv,
        2,
        log_dir=log_dir,
        grace_s=5,
        threads_per_replica=1,
        transport="object_store",
        store=f"file://{tmp_path}/store",
        max_restarts=1,
        warm_restarts=True,
    ) as g:
        deadline = time.monotonic() + 300
        while len(_records(log_dir / "replica1.sync.jsonl")) < 2:
            assert time.monotonic() < deadline, "replica 1 never synced twice"
            time.sleep(0.1)
        g.kill(1)
        res = g.wait(timeout=400)
        tag = g.tag
        assert g.executor.forked == 1
    assert res.ok and res.restarts == {0: 0, 1: 1} and res.exit_codes[1][0] == -9
    assert not procs.tagged_pids(tag)  # the fork server is gone too
    log = (log_dir / "replica1.log").read_text()
    assert "start (restart 1, forked warm)" in log and "starts from" in log.split("forked warm")[1]
    second = [r for r in _records(log_dir / "replica1.sync.jsonl") if r["restart"] == 1]
    assert second and second[-1]["committed"] and second[-1]["outer_step"] == 16
    outs = [json.loads((log_dir / f"result{i}.json").read_text()) for i in range(2)]
    assert len({o["param_hash"] for o in outs}) == 1


def test_warm_restarts_are_refused_where_they_cannot_run():
    with pytest.raises(LaunchError, match="the local executor's"):
        ReplicaGroup(["x"], 1, executor=LocalProcessExecutor(), warm_restarts=True)
    dcfg = DiLoCoConfig(transport="object_store", store="s3://b/p")
    with pytest.raises(ComposerPluginsError, match="--warm-restarts forks replicas on this host"):
        make_executor("hf_jobs", dcfg, warm_restarts=True)
    assert make_executor("local", dcfg, warm_restarts=True).warm_restarts
