"""Cloud executors without the cloud: the Modal app/image/function built with the real SDK offline, and the
executor choice errors. (Hugging Face Jobs runs end to end against a loopback Hub: test_diloco_hf_jobs.py.)"""

from __future__ import annotations

import pytest

from composer_plugins.core.errors import ComposerPluginsError, ConfigError
from composer_plugins.diloco.common import DiLoCoConfig
from composer_plugins.diloco.executors import JobsConfig, make_executor, remote_command
from composer_plugins.diloco.launch import ReplicaSpec


def test_modal_app_image_and_function_are_built_offline_with_the_real_sdk():
    modal = pytest.importorskip("modal")
    from composer_plugins.diloco.executors import ModalExecutor

    ex = ModalExecutor(JobsConfig(gpu="H100", timeout_s=1234, secrets=[], app_name="cp-test"))
    assert isinstance(ex.app, modal.App) and ex.app.name == "cp-test"
    assert isinstance(ex.image, modal.Image)
    assert isinstance(ex.function, modal.Function)
    assert ex._run_ctx is None  # nothing was sent to Modal


def test_cloud_executor_needs_the_object_store_transport_and_unknown_names_are_suggested():
    with pytest.raises(ConfigError, match="diloco.transport"):
        make_executor("hf_jobs", DiLoCoConfig())
    with pytest.raises(ComposerPluginsError, match="Did you mean 'hf_jobs'"):
        make_executor("hf_job", DiLoCoConfig())
    with pytest.raises(ConfigError, match="diloco.jobs.image"):
        make_executor("hf_jobs", DiLoCoConfig(transport="object_store", store="s3://runs/x"))


def test_remote_command_uses_the_container_python():
    spec = ReplicaSpec(1, ["/venv/bin/python3.11", "-m", "composer_plugins.diloco.run", "--target", "toy"], {})
    assert remote_command(spec)[:3] == ["python", "-m", "composer_plugins.diloco.run"]


def test_cloud_jobs_get_the_config_inline_not_a_local_path(tmp_path):
    from composer_plugins.diloco.launch import replica_argv
    from composer_plugins.diloco.run import main

    cfg = tmp_path / "train.yaml"
    cfg.write_text("toy:\n  max_steps: 0\n")
    argv = remote_command(ReplicaSpec(0, replica_argv("toy", str(cfg), ["toy.seed=3"]), {}))
    assert str(cfg) not in argv and argv[argv.index("--config-inline") + 1] == cfg.read_text()
    assert argv[-1] == "toy.seed=3"
    # the replica entry point reads it (a toy run of 0 steps: nothing trains, the config is parsed)
    assert main(argv[3:]) == 0


def test_modal_default_image_installs_this_project_from_its_source():
    pytest.importorskip("modal")
    from composer_plugins.diloco.executors import ModalExecutor, project_root

    ex = ModalExecutor(JobsConfig(secrets=[]))
    assert (project_root() / "pyproject.toml").exists()
    assert ex.jobs.pip == []  # no package name guessed from an index
    ex.close()  # nothing started: closing is a no-op, and the CLI always calls it


def test_hf_job_whose_status_stays_unreadable_is_cancelled_before_it_is_reported_failed(monkeypatch, tmp_path):
    from composer_plugins.diloco import executors

    cancelled: list[str] = []

    class Api:  # the Hub answering nothing but cancel
        def inspect_job(self, **kw: object) -> None:
            raise ConnectionError("hub unreachable")

        def cancel_job(self, job_id: str, **kw: object) -> None:
            cancelled.append(job_id)

        def fetch_job_logs(self, **kw: object) -> list[str]:
            return []

    class Job:
        id, url = "job-1", ""

    ex = executors.HFJobsExecutor.__new__(executors.HFJobsExecutor)
    ex.api, ex.namespace, ex.jobs, ex.log_dir = Api(), "me", JobsConfig(poll_s=0.0), None
    monkeypatch.setattr(executors, "POLL_ERRORS_S", 0.0)
    h = executors.HFJobHandle(ex, ReplicaSpec(0, ["python"], {}), Job())
    assert h.poll() is None  # the first failure starts the clock
    assert h.wait(5) == 1 and cancelled == ["job-1"] and "cancelled" in (h.message or "")
