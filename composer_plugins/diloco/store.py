"""The object store the ``object_store`` transport meets through, and what is written into it.

The store library is `obstore <https://developmental-seed.github.io/obstore>`_ (Rust ``object_store`` under a
small Python API): one dependency reaches S3 and every S3-compatible service, GCS, Azure and local files
(``file://``), it implements conditional creates (``put(mode="create")``, S3's ``If-None-Match: *``) that the
round manifest needs, and it reads the standard cloud environment itself (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ALLOW_HTTP`` for
an ``http://`` endpoint). A named AWS profile (``$AWS_PROFILE``, ``~/.aws/config``) is resolved through
boto3 when boto3 is installed. Credentials are never logged: messages name the store URL only.

:class:`ObjectStore` adds what the transport needs on top: bounded retries with exponential backoff for
transient errors (5xx, 503 SlowDown, timeouts, refused or dropped connections), byte counters, and
``create`` returning ``False`` instead of raising when the object already exists.

:func:`pack` / :func:`unpack` wrap every object written (a header with the SHA-256 of the body); a torn or
corrupt object raises :class:`CorruptObjectError` and the reader treats it as missing.
:func:`encode_vector` / :func:`decode_vector` are the pseudo-gradient codecs (``none``, ``bf16``, ``int8``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import struct
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from composer_plugins.core.errors import ComposerPluginsError, closest, one_line

log = logging.getLogger(__name__)

__all__ = [
    "COMPRESSIONS",
    "CorruptObjectError",
    "ObjectStore",
    "StoreError",
    "check_store_url",
    "decode_vector",
    "encode_vector",
    "pack",
    "unpack",
]

#: URL schemes obstore's ``from_url`` reaches.
SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "adl", "azure", "file", "memory", "http", "https")
COMPRESSIONS = ("none", "bf16", "int8")
INSTALL_HINT = "pip install 'composer-plugins[serverless]'"
MAGIC = b"CPDS"
INT8_BLOCK = 4096

T = TypeVar("T")


class StoreError(ComposerPluginsError, RuntimeError):
    """A store operation failed for good (not transient, or still failing after ``store_retry_s``)."""


class CorruptObjectError(ComposerPluginsError, ValueError):
    """An object's bytes do not match its checksum (torn write, truncation, bit rot)."""


def check_store_url(url: str, error: Callable[[str], Exception]) -> None:
    """Raise ``error(message)`` unless ``url`` is a store URL obstore can open."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest.strip("/"):
        raise error(f"{url!r} is not a store URL. HINT: s3://bucket/prefix, gs://bucket/prefix, az://container/"
                    "prefix or file:///absolute/path.")  # fmt: skip
    if scheme not in SCHEMES:
        near = closest(scheme, SCHEMES, cutoff=0.4)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise error(f"unknown store scheme {scheme!r} in {url!r}; available: {', '.join(SCHEMES)}.{hint}")
    if scheme == "file" and not rest.startswith("/"):
        raise error(f"{url!r}: a file store needs an absolute path (file:///abs/path).")
    if scheme.startswith("s3") and len(rest.split("/", 1)[0]) < 3:
        raise error(f"{url!r}: S3 bucket names have at least 3 characters.")


def _obstore() -> Any:
    try:
        import obstore
    except ImportError as e:
        raise ComposerPluginsError(f"diloco.transport=object_store needs obstore. HINT: {INSTALL_HINT}") from e
    return obstore


def _permanent_errors() -> tuple[type[BaseException], ...]:
    ex = _obstore().exceptions
    return (
        ex.NotFoundError,
        ex.AlreadyExistsError,
        ex.PreconditionError,
        ex.PermissionDeniedError,
        ex.UnauthenticatedError,
        ex.InvalidPathError,
        ex.NotSupportedError,
        ex.UnknownConfigurationKeyError,
    )


class ObjectStore:
    """One run directory in an object store (``url``), with retries and byte counters.

    Args:
        url: ``s3://bucket/prefix``, ``gs://...``, ``az://...``, ``file:///path`` or ``memory://``.
        retry_s: total time one operation is retried through transient errors before :class:`StoreError`.
        request_timeout_s: per-request timeout (a hung request counts as a transient error).
    """

    def __init__(self, url: str, *, retry_s: float = 120.0, request_timeout_s: float = 10.0) -> None:
        check_store_url(url, lambda msg: StoreError(msg))
        self.url = url.rstrip("/")
        self.retry_s = retry_s
        self.bytes_written = 0
        self.bytes_read = 0
        self.retries = 0
        obs = _obstore()
        scheme = url.split("://", 1)[0]
        kwargs: dict[str, Any] = {}
        if scheme == "file":
            os.makedirs(url.split("://", 1)[1], exist_ok=True)
            kwargs["mkdir"] = True
        elif scheme != "memory":
            # obstore retries a little on its own; the bounded loop in _call does the rest
            kwargs["retry_config"] = {"max_retries": 1, "retry_timeout": timedelta(seconds=request_timeout_s),
                                      "backoff": {"init_backoff": timedelta(milliseconds=50),
                                                  "max_backoff": timedelta(seconds=1), "base": 2.0}}  # fmt: skip
            kwargs["client_options"] = {"timeout": f"{request_timeout_s:g}s", "connect_timeout": "5s"}
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if scheme.startswith("s3") and endpoint and endpoint.startswith("http://"):
                kwargs["client_options"]["allow_http"] = True
            if scheme.startswith("s3") and os.environ.get("AWS_PROFILE") and not os.environ.get("AWS_ACCESS_KEY_ID"):
                try:
                    import boto3
                    from obstore.auth.boto3 import Boto3CredentialProvider
                except ImportError:
                    log.warning("AWS_PROFILE is set but boto3 is not installed; using the environment's credentials")
                else:
                    kwargs["credential_provider"] = Boto3CredentialProvider(boto3.Session())
        try:
            self._store = obs.store.from_url(url, **kwargs)
        except Exception as e:
            raise StoreError(f"cannot open store {self.url}: {e}") from e

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    # -- retries -------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.retry_s
        delay = 0.1
        permanent = _permanent_errors()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except permanent:
                raise
            except Exception as e:  # transient: 5xx, SlowDown, timeouts, refused/dropped connections
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreError(f"{what} on {self.url} still failing after {attempt} attempts over "
                                     f"{self.retry_s:.0f}s (diloco.store_retry_s): {one_line(e)}") from e  # fmt: skip
                self.retries += 1
                if attempt == 1 or attempt % 10 == 0:
                    log.warning("store %s: %s failed (%s); retrying for up to %.0fs", self.url, what, one_line(e), left)
                time.sleep(min(delay * (0.5 + random.random()), left))
                delay = min(delay * 2, 2.0)

    # -- operations ----------------------------------------------------------------------
    def put(self, key: str, data: bytes, *, create: bool = False) -> bool:
        """Write ``key``. With ``create``, only if absent (If-None-Match): ``False`` when it already exists."""
        obs = _obstore()

        def op() -> bool:
            try:
                obs.put(self._store, key, data, mode="create" if create else "overwrite")
            except obs.exceptions.AlreadyExistsError:
                return False
            except obs.exceptions.PreconditionError:
                return False
            return True

        ok = self._call(f"put {key}", op)
        if ok:
            self.bytes_written += len(data)
        return ok

    def get(self, key: str) -> bytes | None:
        """The bytes of ``key``, or ``None`` when it does not exist."""
        obs = _obstore()

        def op() -> bytes | None:
            try:
                return bytes(obs.get(self._store, key).bytes())
            except (obs.exceptions.NotFoundError, FileNotFoundError):
                return None

        data = self._call(f"get {key}", op)
        if data is not None:
            self.bytes_read += len(data)
        return data

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a directory, no trailing slash), sorted."""
        obs = _obstore()

        def op() -> list[str]:
            try:
                out: list[str] = []
                for chunk in obs.list(self._store, prefix=prefix.rstrip("/") + "/"):
                    out.extend(m["path"] for m in chunk)
                return sorted(out)
            except (obs.exceptions.NotFoundError, FileNotFoundError):
                return []

        return self._call(f"list {prefix}/", op)


# -- the envelope of every object ---------------------------------------------------------


def pack(header: dict[str, Any], body: bytes) -> bytes:
    """``MAGIC | u32 header length | header JSON (with the body's SHA-256 and length) | body``."""
    h = dict(header, sha256=hashlib.sha256(body).hexdigest(), length=len(body))
    hb = json.dumps(h, separators=(",", ":"), sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(hb)) + hb + body


def unpack(data: bytes, what: str = "object") -> tuple[dict[str, Any], bytes]:
    """The header and body of a :func:`pack`-ed object; :class:`CorruptObjectError` if it is not intact."""
    if len(data) < 8 or data[:4] != MAGIC:
        raise CorruptObjectError(f"{what}: not a DiLoCo store object ({len(data)} bytes)")
    (n,) = struct.unpack("<I", data[4:8])
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise CorruptObjectError(f"{what}: unreadable header") from e
    body = data[8 + n :]
    if len(body) != header.get("length") or hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise CorruptObjectError(f"{what}: checksum mismatch ({len(body)} of {header.get('length')} bytes)")
    return header, body


# -- pseudo-gradient codecs ---------------------------------------------------------------


def encode_vector(vec: torch.Tensor, compress: str) -> tuple[dict[str, Any], bytes]:
    """Header fields and body for a flat fp32 vector under ``compress`` (``none`` | ``bf16`` | ``int8``).

    ``int8``: blocks of 4096 values, each scaled by its absolute maximum / 127 (fp32 scales), rounded to
    int8, then deflated (zlib), so the body is at most a quarter of the fp32 bytes on pseudo-gradients.
    """
    v = vec.detach().to(torch.float32).contiguous().view(-1)
    n = v.numel()
    if compress == "none":
        return {"codec": "none", "numel": n}, v.numpy().tobytes()
    if compress == "bf16":
        return {"codec": "bf16", "numel": n}, v.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    if compress == "int8":
        pad = (-n) % INT8_BLOCK
        blocks = torch.nn.functional.pad(v, (0, pad)).view(-1, INT8_BLOCK)
        scale = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:n]
        body = scale.numpy().tobytes() + zlib.compress(q.numpy().tobytes(), 6)
        return {"codec": "int8", "numel": n, "blocks": int(scale.numel())}, body
    raise ValueError(f"unknown compression {compress!r}; available: {', '.join(COMPRESSIONS)}")


def decode_vector(header: dict[str, Any], body: bytes) -> torch.Tensor:
    """The flat fp32 vector of an :func:`encode_vector` payload."""
    n, codec = int(header["numel"]), header["codec"]
    if codec == "none":
        return torch.frombuffer(bytearray(body), dtype=torch.float32).clone()
    if codec == "bf16":
        return torch.frombuffer(bytearray(body), dtype=torch.int16).view(torch.bfloat16).to(torch.float32)
    if codec == "int8":
        nb = int(header["blocks"])
        scale = torch.frombuffer(bytearray(body[: 4 * nb]), dtype=torch.float32)
        q = torch.frombuffer(bytearray(zlib.decompress(body[4 * nb :])), dtype=torch.int8).to(torch.float32)
        q = torch.nn.functional.pad(q, (0, nb * INT8_BLOCK - n)).view(nb, INT8_BLOCK)
        return (q * scale[:, None]).view(-1)[:n].contiguous()
    raise CorruptObjectError(f"unknown codec {codec!r}")
