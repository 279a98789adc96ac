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
