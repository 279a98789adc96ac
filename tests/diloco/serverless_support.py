"""What the serverless DiLoCo tests share: moto's S3 server on loopback, a fault-injecting proxy in front of
it, and running ``composer-plugins diloco`` as a user does (a subprocess) and reading what it left."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
WAIT_S = 240.0
AWS_KEYS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",
}


@contextlib.contextmanager
def moto_s3(bucket: str = "runs") -> Iterator[dict[str, str]]:
    """moto's S3 server on 127.0.0.1 (free port) with ``bucket``; yields the AWS variables that reach it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", **AWS_KEYS}
    import boto3

    boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket=bucket)
    try:
        yield env
    finally:
        server.stop()


_SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
_SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.'
    b"</Message></Error>"
)


class FaultyProxy:
    """A TCP proxy on ``127.0.0.1:<free port>`` in front of ``upstream`` (host, port) that can make it unreachable
    and limit each connection's bandwidth (``rate``, bytes per second each way).

    :meth:`outage` drops every open connection and, for ``seconds``, answers each new one with ``503 SlowDown``
    (the first ``slowdown_share`` of the time) or closes it at once (a dropped connection), then forwards again.
    ``connections`` / ``refused`` count what it saw.
    """

    def __init__(self, upstream: tuple[str, int], rate: float | None = None) -> None:
        self.upstream = upstream
        #: bytes per second each direction of each connection may carry (``None``: no limit)
        self.rate = rate
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._slowdown_until = 0.0
        self.connections = 0
        self.refused = {"503": 0, "drop": 0}
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, name="faulty-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def outage(self, seconds: float, slowdown_share: float = 0.5) -> None:
        now = time.monotonic()
        with self._lock:
            self._slowdown_until = now + seconds * slowdown_share
            self._down_until = now + seconds
            for s in list(self._open):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
            self._open.clear()

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            now = time.monotonic()
            if now < self._down_until:
                threading.Thread(target=self._refuse, args=(client, now < self._slowdown_until), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _refuse(self, client: socket.socket, slowdown: bool) -> None:
        with contextlib.suppress(OSError):
            if slowdown:
                client.settimeout(2)
                client.recv(65536)  # the request head (the client may still be sending its body: it gets a reset)
                client.sendall(_SLOW_DOWN % (len(_SLOW_DOWN_BODY), _SLOW_DOWN_BODY))
                self.refused["503"] += 1
            else:
                self.refused["drop"] += 1
            client.shutdown(socket.SHUT_RDWR)
        client.close()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            start, sent = time.monotonic(), 0
            while data := src.recv(65536):
                dst.sendall(data)
                if self.rate:
                    sent += len(data)
                    ahead = sent / self.rate - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)

    def close(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._sock.close()
        self.outage(0)


def store_url(kind: str, tmp_path: Path, name: str) -> str:
    return f"s3://runs/{tmp_path.name}-{name}" if kind == "s3" else f"file://{tmp_path}/store-{name}"


def records(log_dir: Path, index: int) -> list[dict[str, Any]]:
    p = log_dir / f"replica{index}.sync.jsonl"
    out = []
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def cli(
    tmp_path: Path, log: str, *args: str, env: dict[str, str] | None = None, replicas: int = 2, target: str = "toy"
) -> subprocess.Popen[str]:
    """``composer-plugins diloco --replicas 2 --target toy ...`` (H = 8) as a subprocess, output piped."""
    cmd = [
        sys.executable,
        "-m",
        "composer_plugins",
        "diloco",
        "--replicas",
        str(replicas),
        "--target",
        target,
        "--log-dir",
        str(tmp_path / log),
        "--timeout",
        str(WAIT_S),
        "diloco.sync_every=8",
        f"toy.output={tmp_path / log}/result{{replica}}.json",
        *args,
    ]
    return subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def logs(log_dir: Path) -> str:
    return "\n".join(
        f"--- {p.name} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
        for p in sorted(log_dir.glob("replica*.log"))
    )


def finish(proc: subprocess.Popen[str], log_dir: Path, rc: int = 0) -> str:
    try:
        out, _ = proc.communicate(timeout=WAIT_S + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert proc.returncode == rc, f"{out}\n{logs(log_dir)}"
    return out


def result(log_dir: Path, i: int) -> dict[str, Any]:
    return json.loads((log_dir / f"result{i}.json").read_text())
