"""A loopback stand-in for the Hugging Face Hub's Jobs endpoints: jobs run here, as local processes.

It lets ``composer-plugins diloco --executor hf_jobs`` (and anything else built on ``huggingface_hub``'s
jobs client) run end to end without an account: point the real client at it (``HF_ENDPOINT=hub.endpoint``,
``HF_TOKEN=hub.token``, ``HF_HUB_OFFLINE=0``; docs/diloco.md) and it submits, polls, reads logs and cancels
as it would on the Hub, from a thread of this process on ``127.0.0.1:<free port>``.

The routes are those ``huggingface_hub.HfApi`` calls (``run_job``, ``inspect_job``, ``fetch_job_logs``,
``cancel_job``, ``list_jobs``, ``whoami``): ``GET /api/whoami-v2``; ``POST /api/jobs/<ns>`` (create from the
client's job spec, answer its ``JobInfo``); ``GET /api/jobs/<ns>[/<id>]`` (``status.stage``: ``SCHEDULING``
→ ``RUNNING`` → ``COMPLETED`` | ``ERROR`` | ``CANCELED``); ``GET /api/jobs/<ns>/<id>/logs`` (server-sent
events, one per output line, as the client's ``follow=False`` read); ``POST /api/jobs/<ns>/<id>/cancel``
(SIGTERM to the job's process group, SIGKILL after 5 s).

A job's command runs as a subprocess in its own session: ``python`` is this interpreter, the environment is
the image's (``image_env``: ``PATH``, ``PYTHONPATH``, ``HOME`` ... of this process) plus the job's
``environment`` and ``secrets``, nothing else, as in a container. Exit 0 → ``COMPLETED``, else ``ERROR`` with
the code in ``status.message``; past ``timeoutSeconds`` it is killed and ``ERROR``-ed. ``hold`` keeps new
jobs in ``SCHEDULING`` until :meth:`release`. A wrong or missing token gets ``401``, an unknown job ``404``.
Every request is recorded in :attr:`requests`; secret values stay in the job (:attr:`FakeJob.spec`) and are
answered as ``"***"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets as _secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from composer_plugins import procs

__all__ = ["FakeJob", "FakeJobsHub"]

IMAGE_ENV = ("PATH", "PYTHONPATH", "HOME", "TMPDIR", "LANG", "VIRTUAL_ENV")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class FakeJob:
    """One submitted job: its spec, stage, output lines and process."""

    def __init__(self, job_id: str, namespace: str, spec: dict[str, Any]) -> None:
        self.id, self.namespace, self.spec = job_id, namespace, spec
        self.stage = "SCHEDULING"
        self.message: str | None = None
        self.created_at = _now()
        self.started_at: str | None = None
        self.finished_at: str | None = None
        self.lines: list[tuple[str, str]] = []  # (timestamp, line)
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.cancel_requested = threading.Event()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    @property
    def finished(self) -> bool:
        return self.stage in ("COMPLETED", "ERROR", "CANCELED", "DELETED")

    def info(self, owner: str) -> dict[str, Any]:
        """The job as the Hub's API answers it (camelCase ``JobInfo``)."""
        s = self.spec
        return {
            "id": self.id,
            "createdAt": self.created_at,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
            "dockerImage": s.get("dockerImage"),
            "spaceId": s.get("spaceId"),
            "command": s.get("command"),
            "arguments": s.get("arguments", []),
            "environment": s.get("environment", {}),
            "secrets": dict.fromkeys(s.get("secrets") or {}, "***"),
            "flavor": s.get("flavor"),
            "labels": s.get("labels"),
            "status": {"stage": self.stage, "message": self.message},
            "owner": {"id": "0" * 24, "name": owner, "type": "user"},
        }


class FakeJobsHub:
    """The Hub's jobs endpoints on ``127.0.0.1:<port>`` (see the module docstring). A context manager.

    Args:
        token: the token the client must send (``Authorization: Bearer <token>``).
        namespace: the token's user name (what ``whoami`` answers).
        hold: keep new jobs in ``SCHEDULING`` until :meth:`release` (a job that never starts).
        image_env: the environment every job starts from (default: :data:`IMAGE_ENV` of this process).
        port: ``0`` for a free one.
    """

    def __init__(
        self,
        *,
        token: str = "hf_fake_token_for_loopback",
        namespace: str = "tester",
        hold: bool = False,
        image_env: Mapping[str, str] | None = None,
        port: int = 0,
    ) -> None:
        self.token, self.namespace = token, namespace
        self.image_env = (
            dict(image_env) if image_env is not None else {k: os.environ[k] for k in IMAGE_ENV if k in os.environ}
        )
        self.jobs: dict[str, FakeJob] = {}
        self.requests: list[dict[str, Any]] = []
        self._released = threading.Event()
        if not hold:
            self._released.set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hf-jobs", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """What ``HF_ENDPOINT`` should be."""
        return f"http://127.0.0.1:{self.port}"

    def client_env(self) -> dict[str, str]:
        """The variables that point ``huggingface_hub`` (in this or a child process) at this hub."""
        return {"HF_ENDPOINT": self.endpoint, "HF_TOKEN": self.token, "HF_HUB_OFFLINE": "0"}

    def start(self) -> FakeJobsHub:
        self._thread.start()
        return self

    def release(self) -> None:
        """Let held jobs (``hold=True``) start."""
        self._released.set()

    def hold(self) -> None:
        """Keep jobs submitted from now on in ``SCHEDULING``."""
        self._released.clear()

    def stop(self) -> None:
        """Cancel every running job and stop serving."""
        for job in list(self.jobs.values()):
            self._cancel(job)
        for job in list(self.jobs.values()):
            if job.thread is not None:
                job.thread.join(10)
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeJobsHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- jobs -----------------------------------------------------------------------------
    def _create(self, namespace: str, spec: dict[str, Any]) -> FakeJob:
        job = FakeJob(_secrets.token_hex(12), namespace, spec)
        with self._lock:
            self.jobs[job.id] = job
        job.thread = threading.Thread(target=self._run, args=(job,), name=f"fake-hf-job-{job.id}", daemon=True)
        job.thread.start()
        return job

    def _argv(self, job: FakeJob) -> list[str]:
        argv = [str(a) for a in [*(job.spec.get("command") or []), *(job.spec.get("arguments") or [])]]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        return argv

    def _run(self, job: FakeJob) -> None:
        while not self._released.wait(0.05) and not job.cancel_requested.is_set():
            pass
        if job.cancel_requested.is_set():
            self._end(job, "CANCELED", None)
            return
        env = {**self.image_env, **(job.spec.get("environment") or {}), **(job.spec.get("secrets") or {})}
        try:
            proc = subprocess.Popen(
                self._argv(job),
                env={k: str(v) for k, v in env.items()},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=procs.die_with_parent(signal.SIGKILL),
            )
        except OSError as e:
            self._end(job, "ERROR", f"cannot start the command: {e}")
            return
        with job.lock:
            job.proc = proc
            job.stage, job.started_at = "RUNNING", _now()
            job.lines.append((job.started_at, f"===== Job started at {job.started_at} ====="))
        if job.cancel_requested.is_set():
            self._signal(job, signal.SIGTERM)
        timeout = job.spec.get("timeoutSeconds")
        timer = None
        if timeout:
            timer = threading.Timer(float(timeout), self._time_out, args=(job,))
            timer.daemon = True
            timer.start()
        assert proc.stdout is not None
        for raw in proc.stdout:
            with job.lock:
                job.lines.append((_now(), raw.decode(errors="replace").rstrip("\n")))
        rc = proc.wait()
        if timer is not None:
            timer.cancel()
        job.returncode = rc
        if job.cancel_requested.is_set():
            self._end(job, "CANCELED", None)
        elif job.message == "timeout":
            self._end(job, "ERROR", f"Job timed out after {timeout}s")
        elif rc == 0:
            self._end(job, "COMPLETED", None)
        else:
            self._end(job, "ERROR", f"Job failed with exit code: {rc}")

    def _end(self, job: FakeJob, stage: str, message: str | None) -> None:
        with job.lock:
            job.stage, job.message, job.finished_at = stage, message, _now()

    def _signal(self, job: FakeJob, sig: int) -> None:
        if job.proc is not None and job.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(job.proc.pid, sig)

    def _time_out(self, job: FakeJob) -> None:
        job.message = "timeout"
        self._signal(job, signal.SIGKILL)

    def _cancel(self, job: FakeJob) -> None:
        if job.finished:
            return
        job.cancel_requested.set()
        self._signal(job, signal.SIGTERM)
        proc = job.proc
        if proc is not None:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                self._signal(job, signal.SIGKILL)

    # -- HTTP -----------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                path, _, _query = self.path.partition("?")
                body: Any = None
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    raw = self.rfile.read(n)
                    try:
                        body = json.loads(raw)
                    except ValueError:
                        self._send(400, {"error": "body is not JSON"})
                        return
                hub.requests.append({"method": method, "path": path, "body": body})
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    self._send(401, {"error": "Invalid credentials in Authorization header"})
                    return
                parts = [p for p in path.split("/") if p]
                if parts == ["api", "whoami-v2"] and method == "GET":
                    self._send(
                        200,
                        {
                            "type": "user",
                            "name": hub.namespace,
                            "id": "0" * 24,
                            "orgs": [],
                            "auth": {"type": "access_token"},
                        },
                    )
                    return
                if len(parts) < 3 or parts[:2] != ["api", "jobs"]:
                    self._send(404, {"error": f"no route {method} {path}"})
                    return
                ns = parts[2]
                if ns != hub.namespace:
                    self._send(403, {"error": f"no access to namespace {ns!r}"})
                    return
                if len(parts) == 3:
                    if method == "POST":
                        if not isinstance(body, dict) or not body.get("command"):
                            self._send(400, {"error": "a job needs a command"})
                            return
                        job = hub._create(ns, body)
                        self._send(200, job.info(hub.namespace))
                    else:
                        self._send(200, [j.info(hub.namespace) for j in hub.jobs.values()])
                    return
                job = hub.jobs.get(parts[3])
                if job is None:
                    self._send(404, {"error": f"Job {parts[3]} not found"})
                    return
                rest = parts[4:]
                if not rest and method == "GET":
                    self._send(200, job.info(hub.namespace))
                elif rest == ["cancel"] and method == "POST":
                    threading.Thread(target=hub._cancel, args=(job,), daemon=True).start()
                    self._send(200, {})
                elif rest == ["logs"] and method == "GET":
                    self._logs(job)
                else:
                    self._send(404, {"error": f"no route {method} {path}"})

            def _logs(self, job: FakeJob) -> None:
                with job.lock:
                    lines = list(job.lines)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for ts, line in lines:
                    self.wfile.write(b"data: " + json.dumps({"timestamp": ts, "data": line}).encode() + b"\n\n")
                self.wfile.flush()

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

        return Handler
