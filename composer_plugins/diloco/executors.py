"""Where replicas run: this host (:class:`~.executor.LocalProcessExecutor`), Hugging Face Jobs
(:class:`HFJobsExecutor`) or Modal (:class:`ModalExecutor`), behind the launcher's ``ReplicaExecutor`` protocol;
a plugin kind (docs/plugins.md, "register_executors"), built by name with :func:`make_executor`.

The cloud executors send only ``spec.job_env`` plus ``diloco.jobs.env``; credentials travel as the platform's
secrets, never in the command line or the logs (docs/diloco.md, the deployments under "Serverless"). Their SDKs
(extras ``hf_jobs``, ``modal``) are imported when the executor is built.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from composer_plugins.core.config import Config, from_dict
from composer_plugins.core.errors import ComposerPluginsError, one_line
from composer_plugins.diloco.common import DiLoCoConfig, JobsConfig
from composer_plugins.diloco.executor import (
    LaunchError,
    LocalProcessExecutor,
    ReplicaExecutor,
    ReplicaSpec,
    wait_polling,
)

__all__ = [
    "HFJobsExecutor",
    "JobsConfig",
    "ModalExecutor",
    "cloud_jobs",
    "hf_jobs_executor",
    "local_executor",
    "make_executor",
    "modal_executor",
]

#: how long a job's status may stay unreadable (Hub unreachable, 5xx) before its replica counts as failed
POLL_ERRORS_S = 120.0


#: what is not sent with the project's source to a Modal image
SOURCE_IGNORE = [".venv", ".git", "**/__pycache__", "**/*.pyc", ".dvc/cache", "runs", "diloco_logs", "**/.pytest_cache"]


def project_root() -> Path:
    """The directory holding this project's ``pyproject.toml`` (what a Modal image installs)."""
    import composer_plugins

    root = Path(composer_plugins.__file__).resolve().parents[1]
    if not (root / "pyproject.toml").exists():
        raise ComposerPluginsError(
            f"composer_plugins runs from {root}, not a source checkout: a Modal image cannot "
            "install it from here. HINT: -S diloco.jobs.pip='[composer-plugins[serverless]==X]' "
            "or -S diloco.jobs.image=<an image with it installed>."
        )
    return root


def make_executor(
    name: str, dcfg: DiLoCoConfig, *, log_dir: str | os.PathLike[str] | None = None, warm_restarts: bool = False
) -> ReplicaExecutor:
    """The executor registered as ``name``, configured from ``dcfg``; unknown names list the available ones and
    the closest."""
    from composer_plugins.diloco.transports import registered

    entry = registered("executors", name, ComposerPluginsError, " (composer-plugins list executors)")
    executor = entry.build(dcfg, log_dir=log_dir, warm_restarts=warm_restarts, name=entry.name)
    if not isinstance(executor, ReplicaExecutor):
        raise TypeError(
            f"executor {name!r} ({entry.provider or entry.plugin}) built a {type(executor).__name__}, which has no "
            "start(spec) -> handle: see composer_plugins.diloco.executor.ReplicaExecutor"
        )
    return executor


def local_executor(
    dcfg: DiLoCoConfig, *, log_dir: Any = None, warm_restarts: bool = False, name: str = "local"
) -> LocalProcessExecutor:
    """The ``local`` executor: one OS process group per replica on this host."""
    return LocalProcessExecutor(warm_restarts=warm_restarts)


def cloud_jobs(name: str, dcfg: DiLoCoConfig, warm_restarts: bool = False) -> JobsConfig:
    """The ``diloco.jobs:`` section, after the checks every cloud executor makes: no ``--warm-restarts`` and a
    transport whose replicas need no lighthouse."""
    if warm_restarts:
        raise ComposerPluginsError(
            f"--warm-restarts forks replicas on this host; --executor {name} starts each replica as a job. "
            "HINT: drop --warm-restarts, or use --executor local."
        )
    from composer_plugins.diloco.transports import get_transport

    if not get_transport(dcfg.transport).cloud:
        raise Config().error(
            "diloco.transport",
            f"--executor {name} runs replicas as cloud jobs that cannot reach "
            "a torchft lighthouse: set -S diloco.transport=object_store -S diloco.store=s3://...",
        )
    return from_dict(JobsConfig, dcfg.jobs or {}, Config(), "diloco.jobs").validate(Config(), "diloco.jobs")


def hf_jobs_executor(
    dcfg: DiLoCoConfig, *, log_dir: Any = None, warm_restarts: bool = False, name: str = "hf_jobs", api: Any = None
) -> HFJobsExecutor:
    """The ``hf_jobs`` executor: each replica a Hugging Face Job (``api``: an ``HfApi``, default from the env)."""
    return HFJobsExecutor(cloud_jobs(name, dcfg, warm_restarts), log_dir=log_dir, api=api)


def modal_executor(
    dcfg: DiLoCoConfig, *, log_dir: Any = None, warm_restarts: bool = False, name: str = "modal"
) -> ModalExecutor:
    """The ``modal`` executor: each replica one call of a Modal function."""
    return ModalExecutor(cloud_jobs(name, dcfg, warm_restarts), log_dir=log_dir)


def remote_command(spec: ReplicaSpec) -> list[str]:
    """The replica's command for a container: ``python`` instead of this host's interpreter path, and the
    config file's text inline (``--config-inline``) instead of a path that exists only here."""
    argv = list(spec.argv)
    if argv and os.path.isabs(argv[0]) and "python" in os.path.basename(argv[0]):
        argv[0] = "python"
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 < len(argv):
            path = Path(argv[i + 1])
            try:
                text = path.read_text()
            except OSError as e:
                raise LaunchError(f"cannot read the config {path} to send it to the cloud job: {e}") from e
            argv[i : i + 2] = ["--config-inline", text]
    return argv


def _forward(names: list[str], what: str) -> dict[str, str]:
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise ComposerPluginsError(
            f"diloco.jobs.{what} names {', '.join(missing)}, not set in this environment. "
            "HINT: export them, or remove them from the list."
        )
    return {n: os.environ[n] for n in names}


class _RemoteHandle:
    """What a remote replica's handle shares: no local pid, ``terminate`` = ``kill`` = cancel, ``wait`` polls."""

    _rc: int | None
    pid: int | None = None
    poll: Any
    _cancel: Any
    _wait_s = 0.5  #: seconds between polls in :meth:`wait`

    def terminate(self) -> None:
        if self._rc is None:
            with contextlib.suppress(Exception):
                self._cancel()

    kill = terminate

    def wait(self, timeout: float | None = None) -> int | None:
        return wait_polling(self.poll, timeout, self._wait_s)


# -- Hugging Face Jobs ----------------------------------------------------------------------


class HFJobHandle(_RemoteHandle):
    """One replica running as a Hugging Face Job (``inspect_job`` for its state, ``cancel_job`` to stop it)."""

    def __init__(self, executor: HFJobsExecutor, spec: ReplicaSpec, job: Any) -> None:
        self.spec = spec
        self.executor = executor
        self.job_id: str = job.id
        self.url: str = getattr(job, "url", "")
        self.started_at = time.monotonic()
        self._rc: int | None = None
        self._last_poll = 0.0
        self._stage = "SCHEDULING"
        self.message: str | None = None
        self._failing_since: float | None = None
        self._wait_s = min(0.2, executor.jobs.poll_s)

    def __repr__(self) -> str:
        return f"HFJobHandle(replica={self.spec.index}, job={self.job_id}, stage={self._stage})"

    def poll(self) -> int | None:
        if self._rc is not None:
            return self._rc
        now = time.monotonic()
        if now - self._last_poll < self.executor.jobs.poll_s:
            return None
        self._last_poll = now
        try:
            info = self.executor.api.inspect_job(job_id=self.job_id, namespace=self.executor.namespace)
        except Exception as e:  # the Hub unreachable or 5xx for a moment: ask again at the next poll
            self._failing_since = self._failing_since or now
            if now - self._failing_since > POLL_ERRORS_S:
                self.message = f"cannot read the job's status for {POLL_ERRORS_S:.0f}s: {one_line(e)}; cancelled"
                # it may still be running: cancel it before the launcher starts another copy of this replica
                with contextlib.suppress(Exception):
                    self._cancel()
                self._finish(1)
            return self._rc
        self._failing_since = None
        self._stage, self.message = str(info.status.stage), info.status.message
        stage = self._stage.rsplit(".", 1)[-1]
        if stage == "SCHEDULING" and now - self.started_at > self.executor.jobs.start_timeout_s:
            self._cancel()
            self.message = f"did not start within diloco.jobs.start_timeout_s={self.executor.jobs.start_timeout_s:g}s"
            self._finish(1)
        elif stage == "COMPLETED":
            self._finish(0)
        elif stage in ("ERROR", "CANCELED", "DELETED"):
            self._finish(1 if stage == "ERROR" else -int(signal.SIGTERM))
        return self._rc

    def _finish(self, rc: int) -> None:
        self._rc = rc
        self.executor.save_logs(self)

    def _cancel(self) -> None:
        self.executor.api.cancel_job(job_id=self.job_id, namespace=self.executor.namespace)


class HFJobsExecutor:
    """Runs each replica as a Hugging Face Job (``huggingface_hub``'s ``run_job``/``inspect_job``/``fetch_job_logs``/
    ``cancel_job``); the Hub endpoint is ``$HF_ENDPOINT`` and the token the usual ``HF_TOKEN`` / login."""

    def __init__(
        self, jobs: JobsConfig | None = None, *, log_dir: str | os.PathLike[str] | None = None, api: Any = None
    ) -> None:
        try:
            from huggingface_hub import HfApi
        except ImportError as e:
            raise ComposerPluginsError(
                "--executor hf_jobs needs huggingface_hub. HINT: pip install 'composer-plugins[hf_jobs]'"
            ) from e
        self.jobs = jobs or JobsConfig()
        if not self.jobs.image:
            raise Config().error(
                "diloco.jobs.image",
                "--executor hf_jobs needs a Docker image with composer-plugins "
                "installed, e.g. -S diloco.jobs.image=ghcr.io/you/composer-plugins:latest.",
            )
        # $HF_ENDPOINT read now, not when huggingface_hub was first imported
        self.api = api or HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
        self.namespace = self.jobs.namespace or self._whoami()
        self.log_dir = Path(log_dir) if log_dir is not None else None

    def _whoami(self) -> str:
        """The token's user, asked once (the Hub rate-limits ``whoami``; every jobs call needs a namespace)."""
        try:
            return str(self.api.whoami(cache=True)["name"])
        except Exception as e:
            raise ComposerPluginsError(
                f"--executor hf_jobs cannot tell who you are on {self.api.endpoint}: {one_line(e)}. HINT: set HF_TOKEN "
                "(or run `hf auth login`), or name the namespace with -S diloco.jobs.namespace=<user-or-org>."
            ) from e

    def start(self, spec: ReplicaSpec) -> HFJobHandle:
        env = {**_forward(self.jobs.env, "env"), **spec.job_env}
        secrets = _forward(self.jobs.secrets, "secrets")
        try:
            job = self.api.run_job(
                image=self.jobs.image,
                command=remote_command(spec),
                env=env,
                secrets=secrets or None,
                flavor=self.jobs.flavor,
                timeout=self.jobs.timeout_s,
                namespace=self.namespace,
                labels={"composer-plugins": "diloco", "replica": str(spec.index), "restart": str(spec.restart)},
            )
        except Exception as e:
            raise LaunchError(f"cannot start replica {spec.index} as a Hugging Face Job: {e}") from e
        h = HFJobHandle(self, spec, job)
        if self.log_dir is not None and spec.log_path is not None:
            spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(spec.log_path, "a") as f:
                f.write(f"\n=== replica {spec.index} (restart {spec.restart}): HF job {h.job_id} {h.url}\n")
        return h

    def save_logs(self, h: HFJobHandle) -> None:
        """Append the job's logs (``fetch_job_logs``) and its final stage to the replica's log file."""
        if h.spec.log_path is None:
            return
        try:
            lines = list(self.api.fetch_job_logs(job_id=h.job_id, namespace=self.namespace))
        except Exception as e:
            lines = [f"(cannot fetch the job's logs: {e})"]
        with open(h.spec.log_path, "a") as f:
            f.writelines(line.rstrip("\n") + "\n" for line in lines)
            f.write(f"=== HF job {h.job_id}: {h._stage}{f' ({h.message})' if h.message else ''}\n")


# -- Modal ----------------------------------------------------------------------------------


class ModalHandle(_RemoteHandle):
    """One replica running as a Modal function call (``FunctionCall``: ``get(timeout=0)`` polls, ``cancel``)."""

    def __init__(self, executor: ModalExecutor, spec: ReplicaSpec, call: Any) -> None:
        self.spec, self.executor, self.call = spec, executor, call
        self._rc: int | None = None

    def poll(self) -> int | None:
        if self._rc is not None:
            return self._rc
        try:
            out = self.call.get(timeout=0)
        except TimeoutError:
            return None
        except Exception as e:  # the function raised, was cancelled, or timed out on Modal
            self._rc, out = 1, {"returncode": 1, "output": f"{type(e).__name__}: {e}"}
        else:
            self._rc = int(out.get("returncode", 1))
        if self.spec.log_path is not None:
            with open(self.spec.log_path, "a") as f:
                f.write(str(out.get("output", "")))
        return self._rc

    def _cancel(self) -> None:
        self.call.cancel()


def _modal_replica(argv: list[str], env: dict[str, str]) -> dict[str, Any]:  # pragma: no cover - runs on Modal
    """What runs inside the Modal container: the replica command, its output returned with its exit code."""
    import subprocess

    p = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True)
    return {"returncode": p.returncode, "output": p.stdout + p.stderr}


class ModalExecutor:
    """Runs each replica as one call of a Modal function (``modal.App`` + ``Image`` + ``App.function``); the app
    runs from the first :meth:`start` until :meth:`close`."""

    def __init__(self, jobs: JobsConfig | None = None, *, log_dir: str | os.PathLike[str] | None = None) -> None:
        try:
            import modal
        except ImportError as e:
            raise ComposerPluginsError(
                "--executor modal needs the modal SDK. HINT: pip install 'composer-plugins[modal]'"
            ) from e
        self.modal = modal
        self.jobs = jobs or JobsConfig()
        self.log_dir = log_dir
        self.app, self.image, self.function = self.build()
        self._run_ctx: Any = None
        self._lock = threading.Lock()

    def build(self) -> tuple[Any, Any, Any]:
        """``(app, image, function)`` for ``diloco.jobs``; nothing is sent to Modal here."""
        modal, j = self.modal, self.jobs
        if j.image:
            image = modal.Image.from_registry(j.image)
        elif j.pip:
            image = modal.Image.debian_slim(python_version="3.11").pip_install(*j.pip)
        else:  # this project, from the source it runs from (not a same-named package from an index)
            root = project_root()
            image = (
                modal.Image.debian_slim(python_version="3.11")
                .add_local_dir(root, "/opt/composer-plugins", copy=True, ignore=SOURCE_IGNORE)
                .run_commands("pip install '/opt/composer-plugins[serverless]'")
            )
        image = image.env({"PYTHONUNBUFFERED": "1"})
        app = modal.App(j.app_name, image=image)
        kwargs: dict[str, Any] = {
            "timeout": int(j.timeout_s),
            "serialized": True,
            "secrets": [modal.Secret.from_name(s) for s in j.secrets],
        }
        kwargs |= {k: v for k, v in (("gpu", j.gpu), ("cpu", j.cpu), ("memory", j.memory_mb)) if v}
        return app, image, app.function(**kwargs)(_modal_replica)

    def start(self, spec: ReplicaSpec) -> ModalHandle:
        with self._lock:
            if self._run_ctx is None:
                self._run_ctx = self.app.run()
                self._run_ctx.__enter__()
        env = {**_forward(self.jobs.env, "env"), **spec.job_env}
        try:
            call = self.function.spawn(remote_command(spec), env)
        except Exception as e:
            raise LaunchError(f"cannot start replica {spec.index} on Modal: {e}") from e
        return ModalHandle(self, spec, call)

    def close(self) -> None:
        if self._run_ctx is not None:
            with contextlib.suppress(Exception):
                self._run_ctx.__exit__(None, None, None)
            self._run_ctx = None
