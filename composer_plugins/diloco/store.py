"""The object store the ``object_store`` transport meets through, and what is written into it.

:class:`ObjectStore` opens a URL with obstore or fsspec (:mod:`.urls`) and adds bounded retries, byte counters,
multipart uploads and ranged reads; :func:`pack` / :func:`unpack` wrap every object with the SHA-256 of its body;
:func:`encode_tree` / :func:`decode_tree` carry nested state as plain data. See docs/diloco.md ("Serverless", "What
a team can trust the store with").
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import random
import struct
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from typing import Any, TypeVar

import torch

from composer_plugins.core.errors import ComposerPluginsError, one_line
from composer_plugins.diloco.codecs import (
    INT4_BLOCK,
    INT8_BLOCK,
    CorruptObjectError,
    decode_vector,
    encode_vector,
    host_tensor,
)
from composer_plugins.diloco.urls import SCHEMES, check_store_url, redact_url

log = logging.getLogger(__name__)

__all__ = [
    "INT4_BLOCK",
    "INT8_BLOCK",
    "SCHEMES",
    "CorruptObjectError",
    "ObjectStore",
    "StoreError",
    "check_store_url",
    "decode_tree",
    "decode_vector",
    "encode_tree",
    "encode_vector",
    "host_tensor",
    "pack",
    "redact_url",
    "to_host",
    "unpack",
]

INSTALL_HINT = "pip install 'composer-plugins[serverless]'"
MAGIC = b"CPDS"
#: objects above this go up as multipart uploads and come down as ranged GETs of this size
PART_BYTES = 8 << 20
#: a small object standing for a large one written under ``<key>.blob-<nonce>`` (see :meth:`ObjectStore.put`)
REF = "ref"

T = TypeVar("T")


class StoreError(ComposerPluginsError, RuntimeError):
    """A store operation failed for good (not transient, or still failing after ``store_retry_s``)."""


class _Obstore:
    """The store operations through obstore (the schemes of :data:`SCHEMES`)."""

    def __init__(self, url: str, request_timeout_s: float) -> None:
        try:
            import obstore as obs
        except ImportError as e:
            raise ComposerPluginsError(f"diloco.transport=object_store needs obstore. HINT: {INSTALL_HINT}") from e
        self.obs, ex = obs, obs.exceptions
        self.missing = (ex.NotFoundError, FileNotFoundError)
        self.permanent: tuple[type[BaseException], ...] = (
            ex.NotFoundError,
            ex.AlreadyExistsError,
            ex.PreconditionError,
            ex.PermissionDeniedError,
            ex.UnauthenticatedError,
            ex.InvalidPathError,
            ex.NotSupportedError,
            ex.UnknownConfigurationKeyError,
        )
        scheme = url.split("://", 1)[0]
        kwargs: dict[str, Any] = {}
        if scheme == "file":
            os.makedirs(url.split("://", 1)[1], exist_ok=True)
            kwargs["mkdir"] = True
        elif scheme != "memory":
            # obstore retries a little on its own; the bounded loop in ObjectStore._call does the rest
            kwargs["retry_config"] = {
                "max_retries": 1,
                "retry_timeout": timedelta(seconds=request_timeout_s),
                "backoff": {
                    "init_backoff": timedelta(milliseconds=50),
                    "max_backoff": timedelta(seconds=1),
                    "base": 2.0,
                },
            }
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
        self.store = obs.store.from_url(url, **kwargs)

    def put(self, key: str, data: Any, create: bool, part: int) -> bool:
        ex = self.obs.exceptions
        try:
            self.obs.put(
                self.store,
                key,
                data,
                mode="create" if create else "overwrite",
                use_multipart=len(data) > part,
                chunk_size=part,
                max_concurrency=4,
            )
        except (ex.AlreadyExistsError, ex.PreconditionError):
            return False
        return True

    def head_part(self, key: str, part: int) -> tuple[bytes, int]:
        try:
            res = self.obs.get(self.store, key, options={"range": (0, part)})
        except self.missing:
            raise
        except Exception as e:  # an empty object has no range 0..part on some stores
            if "range" not in str(e).lower():
                raise
            res = self.obs.get(self.store, key)
        return bytes(res.bytes()), int(res.meta["size"])

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return bytes(self.obs.get_range(self.store, key, start=start, end=end))

    def head(self, key: str) -> None:
        self.obs.head(self.store, key)

    def delete(self, key: str) -> None:
        self.obs.delete(self.store, key)

    def list(self, prefix: str) -> list[str]:
        return [m["path"] for chunk in self.obs.list(self.store, prefix=prefix) for m in chunk]


class _Fsspec:
    """The store operations through an fsspec filesystem: any scheme registered with fsspec that obstore does not
    reach (a conditional create is an exclusive open, ``xb``)."""

    missing = (FileNotFoundError,)
    permanent: tuple[type[BaseException], ...] = (FileNotFoundError, FileExistsError, PermissionError)

    def __init__(self, url: str) -> None:
        import fsspec

        self.fs, self.root = fsspec.url_to_fs(url)
        self.root = self.root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def put(self, key: str, data: Any, create: bool, part: int) -> bool:
        path = self._path(key)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        try:
            with self.fs.open(path, "xb" if create else "wb") as f:
                f.write(bytes(data))
        except FileExistsError:
            return False
        return True

    def head_part(self, key: str, part: int) -> tuple[bytes, int]:
        path = self._path(key)
        return bytes(self.fs.cat_file(path, start=0, end=part)), int(self.fs.size(path))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return bytes(self.fs.cat_file(self._path(key), start=start, end=end))

    def head(self, key: str) -> None:
        if not self.fs.exists(self._path(key)):
            raise FileNotFoundError(key)

    def delete(self, key: str) -> None:
        self.fs.rm_file(self._path(key))

    def list(self, prefix: str) -> list[str]:
        base = len(self.root) + 1
        return [p[base:] for p in self.fs.find(self._path(prefix))]


class ObjectStore:
    """One run directory in an object store (``url``, see :mod:`.urls`), with retries and byte counters.

    ``retry_s``: how long one operation is retried through transient errors (a hung request, past
    ``request_timeout_s``, is one) before :class:`StoreError`.
    """

    def __init__(
        self, url: str, *, retry_s: float = 120.0, request_timeout_s: float = 10.0, part_bytes: int = PART_BYTES
    ) -> None:
        check_store_url(url, lambda msg: StoreError(msg))
        self.url = url.rstrip("/")
        self.part_bytes = part_bytes
        self.retry_s = retry_s
        self.bytes_written = 0
        self._count_lock = threading.Lock()  # the state writer counts from its own thread
        self.bytes_read = 0
        self.retries = 0
        try:
            obstore_scheme = url.split("://", 1)[0] in SCHEMES
            self._io: Any = _Obstore(url, request_timeout_s) if obstore_scheme else _Fsspec(url)
        except ComposerPluginsError:
            raise
        except Exception as e:
            raise StoreError(f"cannot open store {redact_url(self.url)}: {one_line(e)}") from e

    def __repr__(self) -> str:
        return f"ObjectStore({redact_url(self.url)!r})"

    @property
    def where(self) -> str:
        """The URL for messages and logs: ``scheme://bucket/prefix``, never a query string or credentials."""
        return redact_url(self.url)

    # -- retries -------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.retry_s
        delay = 0.1
        for attempt in itertools.count(1):
            try:
                return fn()
            except self._io.permanent:
                raise
            except Exception as e:  # transient: 5xx, SlowDown, timeouts, refused/dropped connections
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreError(
                        f"{what} on {self.where} still failing after {attempt} attempts over "
                        f"{self.retry_s:.0f}s (diloco.store_retry_s): {one_line(e)}"
                    ) from e
                with self._count_lock:
                    self.retries += 1
                if attempt == 1 or attempt % 10 == 0:
                    log.warning(
                        "store %s: %s failed (%s); retrying for up to %.0fs", self.where, what, one_line(e), left
                    )
                time.sleep(min(delay * (0.5 + random.random()), left))
                delay = min(delay * 2, 2.0)

    def _missing_ok(self, what: str, fn: Callable[[], T], default: T) -> T:
        """``fn()`` with retries, ``default`` when the object is not there."""

        def op() -> T:
            try:
                return fn()
            except self._io.missing:
                return default

        return self._call(what, op)

    # -- operations ----------------------------------------------------------------------
    def put(self, key: str, data: bytes, *, create: bool = False) -> bool:
        """Write ``key``. With ``create``, only if absent (If-None-Match): ``False`` when it already exists.
        Above ``part_bytes``: a multipart upload; a large create uploads a blob, then ``key`` as a reference to it."""
        if len(data) <= self.part_bytes:
            ok = self._put_one(key, data, create)
        elif not create:
            self._put_one(key, memoryview(data), False)
            ok = True
        else:
            blob = f"{key}.blob-{os.urandom(6).hex()}"
            self._put_one(blob, memoryview(data), False)
            digest = hashlib.sha256(data).hexdigest()
            ref = pack(
                {"kind": REF, "blob": blob.rsplit("/", 1)[-1], "blob_sha256": digest, "blob_length": len(data)}, b""
            )
            ok = self._put_one(key, ref, True)
            if not ok:
                self.delete(blob)
        if ok:
            with self._count_lock:
                self.bytes_written += len(data)
        return ok

    def _put_one(self, key: str, data: Any, create: bool) -> bool:
        what = f"put {key}" if len(data) <= self.part_bytes else f"multipart put {key} ({len(data)} bytes)"
        return self._call(what, lambda: self._io.put(key, data, create, self.part_bytes))

    def get(self, key: str) -> bytes | None:
        """The bytes of ``key`` (read in ranged requests of ``part_bytes``), or ``None`` when it does not exist (a
        reference is followed, see :meth:`put`)."""
        data = self._get_ranged(key)
        if data is not None and data[:4] == MAGIC and len(data) < 4096:
            try:
                header, _ = unpack(data, key)
            except CorruptObjectError:
                header = {}
            if header.get("kind") == REF:
                blob = str(header.get("blob", ""))
                if "/" in blob or not blob.startswith(key.rsplit("/", 1)[-1] + ".blob-"):
                    raise CorruptObjectError(f"{self.where}/{key}: a reference to {blob!r}, outside its own blobs")
                parent = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
                body = self._get_ranged(parent + blob)
                if (
                    body is None
                    or len(body) != header.get("blob_length")
                    or (hashlib.sha256(body).hexdigest() != header.get("blob_sha256"))
                ):
                    raise CorruptObjectError(f"{self.where}/{key}: its blob {blob} is missing or corrupt")
                data = body
        if data is not None:
            with self._count_lock:
                self.bytes_read += len(data)
        return data

    def _get_ranged(self, key: str) -> bytes | None:
        part = self.part_bytes
        got = self._missing_ok(f"get {key}", lambda: self._io.head_part(key, part), None)
        if got is None:
            return None
        head, size = got
        if len(head) >= size:
            return head[:size]
        buf = bytearray(size)
        buf[: len(head)] = head
        for start in range(len(head), size, part):
            end = min(size, start + part)
            buf[start:end] = self._call(f"get {key} bytes {start}-{end}", partial(self._io.get_range, key, start, end))
        return bytes(buf)

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists (a HEAD request)."""
        return self._missing_ok(f"head {key}", lambda: self._io.head(key) is None, False)

    def delete(self, key: str) -> None:
        """Delete ``key`` (absent: nothing to do)."""
        self._missing_ok(f"delete {key}", lambda: self._io.delete(key), None)

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a directory, no trailing slash), sorted."""
        return sorted(self._missing_ok(f"list {prefix}/", lambda: self._io.list(prefix.rstrip("/") + "/"), []))


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
    if not isinstance(header, dict):
        raise CorruptObjectError(f"{what}: its header is a JSON {type(header).__name__}, not an object")
    body = data[8 + n :]
    if len(body) != header.get("length") or hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise CorruptObjectError(f"{what}: checksum mismatch ({len(body)} of {header.get('length')} bytes)")
    return header, body


# -- host tensors only --------------------------------------------------------------------


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached on the CPU as a plain tensor (the one place device memory meets the store)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t


# -- nested state as data (no pickle) -----------------------------------------------------

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
}


def encode_tree(obj: Any, what: str = "state") -> tuple[Any, bytes]:
    """``(tree, body)`` of nested state: a JSON-able tree and the bytes of its tensors (see the module docstring).

    Scalars (``None``, bool, int, float, str) stay as they are; a list stays a list; a tuple becomes
    ``{"T": [...]}``, a mapping ``{"M": [[key, value], ...]}`` (keys of any scalar type), a tensor
    ``{"X": [dtype, shape, offset, nbytes]}``. Anything else is refused with its path.
    """
    chunks: list[bytes] = []
    offset = 0

    def walk(x: Any, path: str) -> Any:
        nonlocal offset
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, torch.Tensor):
            t = host_tensor(x, f"{what}{path}").detach().contiguous()
            name = str(t.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise TypeError(f"{what}{path}: dtype {t.dtype} cannot be stored")
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            chunks.append(raw)
            offset += len(raw)
            return {"X": [name, list(t.shape), offset - len(raw), len(raw)]}
        if isinstance(x, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return {"T": [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, Mapping):
            out = []
            for k, v in x.items():
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise TypeError(f"{what}{path}: key {k!r} of type {type(k).__name__} cannot be stored")
                out.append([k, walk(v, f"{path}[{k!r}]")])
            return {"M": out}
        raise TypeError(
            f"{what}{path}: a {type(x).__name__} cannot be stored as data (tensors, numbers, strings, "
            "lists, tuples and dicts only)"
        )

    return walk(obj, ""), b"".join(chunks)


def decode_tree(tree: Any, body: bytes, what: str = "state") -> Any:
    """The nested state of :func:`encode_tree`; builds only scalars, lists, tuples, dicts and CPU tensors."""
    buf = bytearray(body)

    def walk(x: Any, path: str) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, dict) and len(x) == 1:
            ((tag, v),) = x.items()
            if tag == "T" and isinstance(v, list):
                return tuple(walk(e, f"{path}[{i}]") for i, e in enumerate(v))
            if tag == "M" and isinstance(v, list) and all(isinstance(e, list) and len(e) == 2 for e in v):
                out = {}
                for k, e in v:
                    if not (k is None or isinstance(k, (bool, int, float, str))):
                        raise CorruptObjectError(f"{what}{path}: a key of type {type(k).__name__}")
                    out[k] = walk(e, f"{path}[{k!r}]")
                return out
            if tag == "X" and isinstance(v, list) and len(v) == 4:
                name, shape, off, nbytes = v
                dtype = _DTYPES.get(name) if isinstance(name, str) else None
                dims_ok = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                span_ok = isinstance(off, int) and isinstance(nbytes, int) and 0 <= off and off + nbytes <= len(buf)
                if dtype is None or not (dims_ok and span_ok) or math.prod(shape) * dtype.itemsize != nbytes:
                    raise CorruptObjectError(f"{what}{path}: a bad tensor entry {v!r}")
                if not nbytes:
                    return torch.empty(shape, dtype=dtype)
                raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=off)
                return raw.view(dtype).reshape(shape).clone()
        raise CorruptObjectError(f"{what}{path}: not a data node ({str(x)[:80]!r})")

    return walk(tree, "")
