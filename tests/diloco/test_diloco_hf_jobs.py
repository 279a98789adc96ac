"""``--executor hf_jobs`` against a loopback stand-in for the Hub's jobs endpoints
(:class:`composer_plugins.testing.hf_jobs_hub.FakeJobsHub`), reached by the real ``huggingface_hub`` client
through ``HF_ENDPOINT``. The fake Hub runs each job's command here as a process, so the executor's submit,
poll, logs and cancel, a failed job and a job that never starts are exercised for real, and a whole
``composer-plugins diloco --executor hf_jobs`` run goes end to end (replicas meeting through moto's S3).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from serverless_support import cli, finish, logs, result, store_url

from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.diloco.executors import HFJobsExecutor, JobsConfig
from composer_plugins.diloco.launch import ENV_INDEX, ENV_STORE, ReplicaSpec
from composer_plugins.testing.hf_jobs_hub import FakeJobsHub

pytest.importorskip("huggingface_hub")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SECRET = "s3cr3t-value-never-logged"


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeJobsHub]:
    with FakeJobsHub() as h:
        yield h


@pytest.fixture
def client(hub: FakeJobsHub, monkeypatch: pytest.MonkeyPatch) -> FakeJobsHub:
    """This process's ``huggingface_hub`` pointed at the fake Hub (the test session runs with HF_HUB_OFFLINE=1)."""
    import huggingface_hub.constants

    for k, v in hub.client_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("MY_SECRET", SECRET)
    monkeypatch.setenv("MY_PLAIN", "plain-value")
    hub.release()
    return hub


def _spec(tmp_path: Path, index: int, code: str) -> ReplicaSpec:
    argv = [sys.executable, "-c", code]
    return ReplicaSpec(
        index,
        argv,
        {},
        log_path=tmp_path / f"replica{index}.log",
        job_env={ENV_INDEX: str(index), ENV_STORE: "file:///tmp/x"},
    )


def _executor(tmp_path: Path, **jobs: object) -> HFJobsExecutor:
    cfg = JobsConfig(image="python:3.12", poll_s=0.05, secrets=["MY_SECRET"], env=["MY_PLAIN"], **jobs)  # type: ignore[arg-type]
    return HFJobsExecutor(cfg, log_dir=tmp_path)


def _stage(hub: FakeJobsHub, job_id: str, stage: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while hub.jobs[job_id].stage != stage:
        assert time.monotonic() < deadline, f"job {job_id} is {hub.jobs[job_id].stage}, not {stage}"
        time.sleep(0.02)


def test_submit_poll_and_logs_of_a_job_that_completes(client, tmp_path):
    hub = client
    whoami_before = sum(r["path"] == "/api/whoami-v2" for r in hub.requests)
    ex = _executor(tmp_path)
    code = (
        "import os; print('replica', os.environ['COMPOSER_DILOCO_REPLICA_INDEX'], os.environ['MY_PLAIN'], "
        "os.environ['MY_SECRET'] == 's3cr3t-value-never-logged', 'HF_TOKEN' in os.environ)"
    )
    h = ex.start(_spec(tmp_path, 0, code))
    assert h.wait(60) == 0
    job = hub.jobs[h.job_id]
    # what was submitted: the container's python, the replica's own environment, the secret as a secret
    assert job.spec["command"][0] == "python" and job.spec["dockerImage"] == "python:3.12"
    assert job.spec["environment"] == {ENV_INDEX: "0", ENV_STORE: "file:///tmp/x", "MY_PLAIN": "plain-value"}
    assert job.spec["secrets"] == {"MY_SECRET": SECRET} and job.spec["flavor"] == "cpu-basic"
    assert job.spec["labels"]["composer-plugins"] == "diloco" and job.spec["timeoutSeconds"] == 3600
    text = (tmp_path / "replica0.log").read_text()
    # the job's logs (fetch_job_logs, SSE) in the replica's log: it saw its index, env and secret, not our token
    assert "replica 0 plain-value True False" in text, text
    assert f"HF job {h.job_id}" in text and "COMPLETED" in text and "Job started" not in text
    assert SECRET not in text
    polls = [r for r in hub.requests if r["path"] == f"/api/jobs/tester/{h.job_id}"]
    logs_read = [r for r in hub.requests if r["path"] == f"/api/jobs/tester/{h.job_id}/logs"]
    assert polls and len(logs_read) == 1
    # the namespace is asked once, when the executor is built (the Hub rate-limits whoami)
    assert sum(r["path"] == "/api/whoami-v2" for r in hub.requests) == whoami_before + 1


def test_a_failed_job_exits_non_zero_with_its_logs_and_message(client, tmp_path):
    ex = _executor(tmp_path)
    h = ex.start(_spec(tmp_path, 1, "import sys; print('boom: out of memory', flush=True); sys.exit(3)"))
    assert h.wait(60) == 1
    text = (tmp_path / "replica1.log").read_text()
    assert "boom: out of memory" in text and "ERROR (Job failed with exit code: 3)" in text, text


def test_cancel_stops_a_running_job(client, tmp_path):
    hub = client
    ex = _executor(tmp_path)
    h = ex.start(_spec(tmp_path, 0, "import time; print('training', flush=True); time.sleep(120)"))
    _stage(hub, h.job_id, "RUNNING")
    deadline = time.monotonic() + 30
    while not any(line == "training" for _, line in hub.jobs[h.job_id].lines):
        assert time.monotonic() < deadline, hub.jobs[h.job_id].lines
        time.sleep(0.02)
    pid = hub.jobs[h.job_id].proc.pid  # type: ignore[union-attr]
    assert h.poll() is None
    h.terminate()
    assert h.wait(30) == -15
    job = hub.jobs[h.job_id]
    assert job.stage == "CANCELED" and job.proc is not None and job.proc.poll() is not None
    assert any(r["path"] == f"/api/jobs/tester/{h.job_id}/cancel" for r in hub.requests)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert "training" in (tmp_path / "replica0.log").read_text()


def test_the_registered_hf_jobs_executor_keeps_the_executor_contract(client):
    """``check_executor`` over the ``hf_jobs`` entry as ``--executor hf_jobs`` builds it: replicas run as jobs on the
    loopback Hub, an exit code and the logs come back, cancel stops one, ``--warm-restarts`` is refused."""
    from composer_plugins.diloco.common import DiLoCoConfig
    from composer_plugins.testing import check_executor

    cfg = DiLoCoConfig(transport="object_store", store="file:///tmp/x", jobs={"image": "python:3.12", "poll_s": 0.05})
    ex = check_executor("hf_jobs", config=cfg)
    assert isinstance(ex, HFJobsExecutor) and ex.api.endpoint == client.endpoint


def test_a_job_that_never_starts_is_cancelled_after_start_timeout(client, tmp_path):
    hub = client
    hub.hold()
    try:
        ex = _executor(tmp_path, start_timeout_s=0.5)
        h = ex.start(_spec(tmp_path, 0, "print('must not run')"))
        assert h.wait(30) == 1
        assert "did not start within diloco.jobs.start_timeout_s=0.5s" in (h.message or "")
        _stage(hub, h.job_id, "CANCELED")
        assert hub.jobs[h.job_id].proc is None  # it never ran
        assert "SCHEDULING" in (tmp_path / "replica0.log").read_text()
    finally:
        hub.release()


def test_without_a_token_the_error_names_the_fix(client, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(ComposerPluginsError, match="HF_TOKEN") as ei:
        _executor(tmp_path)
    assert "diloco.jobs.namespace" in str(ei.value) and "hf_wrong" not in str(ei.value)


def test_cli_runs_two_replicas_as_hf_jobs_meeting_through_moto_s3(hub, moto, tmp_path):
    """``composer-plugins diloco --executor hf_jobs`` end to end: the launcher submits one job per replica to
    the fake Hub, which runs them here with only what the jobs carry (the AWS keys as job secrets)."""
    hub.release()
    env = {**hub.client_env(), **moto}
    proc = cli(
        tmp_path,
        "hf",
        "--executor",
        "hf_jobs",
        "toy.max_steps=32",
        "-S",
        "diloco.transport=object_store",
        "-S",
        f"diloco.store={store_url('s3', tmp_path, 'hf')}",
        "-S",
        "diloco.jobs.image=python:3.12",
        "-S",
        "diloco.jobs.poll_s=0.2",
        "-S",
        "diloco.jobs.env=[AWS_ENDPOINT_URL,AWS_REGION,AWS_ALLOW_HTTP]",
        "-S",
        "diloco.jobs.secrets=[AWS_ACCESS_KEY_ID,AWS_SECRET_ACCESS_KEY]",
        env=env,
    )
    out = finish(proc, tmp_path / "hf")
    assert "replica 0: exit codes [0]" in out and "replica 1: exit codes [0]" in out, out
    a, b = result(tmp_path / "hf", 0), result(tmp_path / "hf", 1)
    assert a["param_hash"] == b["param_hash"] and a["outer_step"] == b["outer_step"] == 32 // 8
    jobs = [
        j
        for j in hub.jobs.values()
        if (j.spec.get("labels") or {}).get("composer-plugins") == "diloco"
        and "diloco.jobs.image=python:3.12" in " ".join(j.spec["command"])
    ]
    assert len(jobs) == 2 and all(j.stage == "COMPLETED" for j in jobs)
    for j in jobs:
        assert set(j.spec["secrets"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        assert "AWS_SECRET_ACCESS_KEY" not in j.spec["environment"]
        assert j.spec["environment"]["COMPOSER_DILOCO_STORE"].startswith("s3://runs/")
    for i in (0, 1):  # each replica's log: the job's own output, fetched from the Hub when it ended
        text = (tmp_path / "hf" / f"replica{i}.log").read_text()
        assert f"DiLoCo replica replica{i} ({i}/2) on store s3://runs/" in text and "COMPLETED" in text, logs(
            tmp_path / "hf"
        )
        assert hub.token not in text


def test_cli_job_that_never_starts_fails_the_run_naming_the_limit(hub, tmp_path):
    hub.hold()
    try:
        proc = cli(
            tmp_path,
            "held",
            "--executor",
            "hf_jobs",
            "toy.max_steps=8",
            "-S",
            "diloco.transport=object_store",
            "-S",
            f"diloco.store={store_url('file', tmp_path, 'held')}",
            "-S",
            "diloco.jobs.image=python:3.12",
            "-S",
            "diloco.jobs.poll_s=0.1",
            "-S",
            "diloco.jobs.start_timeout_s=1",
            env=hub.client_env(),
        )
        out = finish(proc, tmp_path / "held", rc=1)
    finally:
        hub.release()
    assert "replica 0: exit codes [1]" in out and "replica 1: exit codes [1]" in out, out
    assert "did not start within diloco.jobs.start_timeout_s=1s" in (tmp_path / "held" / "replica0.log").read_text()
