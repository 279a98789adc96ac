"""Cloud executors without the cloud: the Modal app/image/function built with the real SDK offline, and the
executor choice errors. (Hugging Face Jobs runs end to end against a loopback Hub: test_diloco_hf_jobs.py.)
Executors are a plugin kind (``register_executors``): listed with their provider, checked by
:func:`composer_plugins.testing.check_executor`, and a third party's is what ``--executor`` picks."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
from click.testing import CliRunner

from composer_plugins import hookimpl
from composer_plugins.core import plugins
from composer_plugins.core.cli import load_commands
from composer_plugins.core.errors import ComposerPluginsError, ConfigError
from composer_plugins.diloco.common import DiLoCoConfig
from composer_plugins.diloco.executor import LocalProcessExecutor
from composer_plugins.diloco.executors import JobsConfig, make_executor, remote_command
from composer_plugins.diloco.launch import ReplicaSpec
from composer_plugins.testing import ConformanceError, check_executor


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


# -- executors are a plugin kind (register_executors): listed with provenance, checked, picked by --executor -----


class _Tagging(LocalProcessExecutor):
    """A third party's executor: local processes that carry a tag in their environment."""

    def __init__(self, tag: str, warm_restarts: bool = False) -> None:
        super().__init__(warm_restarts=warm_restarts)
        self.tag = tag

    def start(self, spec: ReplicaSpec):
        spec.env = {**spec.env, "EXECUTOR_TAG": self.tag}
        return super().start(spec)


class _ExecutorPlugin:
    __name__ = "executor_test_plugin"

    @hookimpl
    def register_executors(self, register: Any) -> None:
        register(
            "tagged",
            lambda dcfg, *, log_dir, warm_restarts, name, tag: _Tagging(tag, warm_restarts),
            "Local processes with a tag (a third party's executor).",
            tag="t1",
        )
        register("drops_warm", lambda dcfg, **kw: LocalProcessExecutor(), "Forgets --warm-restarts.")
        register("not_an_executor", lambda dcfg, **kw: object())
        register("wrong_code", _zero_exit)


class _ZeroHandle:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec

    pid = None

    def poll(self) -> int | None:
        return 0

    def terminate(self) -> None:
        pass

    kill = terminate

    def wait(self, timeout: float | None = None) -> int | None:
        return 0


class _ZeroExit:
    """Says every replica succeeded, without running it (a launcher would never restart a crash)."""

    def start(self, spec: ReplicaSpec) -> _ZeroHandle:
        return _ZeroHandle(spec)


def _zero_exit(dcfg: Any, *, warm_restarts: bool = False, **kw: Any) -> _ZeroExit:
    if warm_restarts:
        raise ComposerPluginsError("--warm-restarts: this executor does not fork replicas here")
    return _ZeroExit()


@pytest.fixture
def with_executors(isolated_plugins):
    pm = plugins.make_plugin_manager(entrypoints=False)
    pm.register(_ExecutorPlugin(), name="executor_test_plugin")
    plugins.use_plugin_manager(pm)
    yield pm


def test_hook_register_executors(with_executors, tmp_path):
    reg = plugins.get_registry()
    assert {"local", "hf_jobs", "modal", "tagged"} <= set(reg.names("executors"))
    assert reg.get("executors", "hf_jobs").plugin == "composer_plugins.diloco.plugin"
    assert reg.get("executors", "local").provider.startswith("composer-plugins")
    assert reg.get("executors", "tagged").plugin == "executor_test_plugin"
    # --executor picks the registered entry: the third party's runs the replica, with its preset tag
    ex = make_executor("tagged", DiLoCoConfig(), log_dir=tmp_path)
    assert isinstance(ex, _Tagging) and ex.tag == "t1"
    code = "import os, sys; sys.exit(7 if os.environ['EXECUTOR_TAG'] == 't1' else 1)"
    h = ex.start(ReplicaSpec(0, [sys.executable, "-c", code], dict(os.environ)))
    assert h.wait(60) == 7
    with pytest.raises(ComposerPluginsError, match=r"unknown executor 'taged'.*Did you mean 'tagged'"):
        make_executor("taged", DiLoCoConfig())
    with pytest.raises(TypeError, match=r"executor 'not_an_executor' \(.*\) built a object"):
        make_executor("not_an_executor", DiLoCoConfig())


def test_list_and_plugins_show_the_executors_with_their_provider(with_executors):
    r = CliRunner().invoke(load_commands(), ["list", "executors", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = {d["name"]: d for d in json.loads(r.output[r.output.index("[") :])}
    assert {"local", "hf_jobs", "modal", "tagged"} <= set(rows) and all(d["kind"] == "executors" for d in rows.values())
    assert rows["local"]["plugin"] == "composer_plugins.diloco.plugin"
    assert rows["local"]["distribution"] == "composer-plugins" and rows["tagged"]["plugin"] == "executor_test_plugin"
    r = CliRunner().invoke(load_commands(), ["plugins", "--all"], catch_exceptions=False)
    data = {d["name"]: d for d in json.loads(r.output[r.output.index("[") :])}
    assert "register_executors" in data["composer_plugins.diloco.plugin"]["hooks"]
    assert "register_executors" in data["executor_test_plugin"]["hooks"]


@pytest.mark.parametrize("name", ["local", "tagged"])
def test_registered_executors_keep_the_contract(with_executors, name):
    assert check_executor(name) is not None


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("drops_warm", r"executors 'drops_warm'.*accepts --warm-restarts and drops it"),
        ("not_an_executor", r"executors 'not_an_executor'.*built a object, not a ReplicaExecutor"),
        ("wrong_code", r"executors 'wrong_code'.*a replica that exits 3 gives wait\(\) -> 0.*want non-zero"),
    ],
)
def test_an_executor_that_breaks_the_contract_is_named(with_executors, name, what):
    with pytest.raises(ConformanceError, match=what):
        check_executor(name)
