"""Default plugin: registers the built-in outer-sync transports through the public ``register_transports`` hook.

Factories are lazy ``"module:attr"`` strings (as the built-in codecs), so loading the plugins or listing the
transports imports nothing of :mod:`composer_plugins.diloco.transports` until one is built.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.core.registry import builtin_hook

_MODULE = "composer_plugins.diloco.transports"

#: the ``diloco.*`` keys only the object-store transport reads (``torchft`` refuses them when set)
_STORE_KEYS = (
    "store",
    "compress",
    "round_timeout_s",
    "store_retry_s",
    "poll_s",
    "poll_max_s",
    "request_timeout_s",
    "keep_rounds",
    "state_every",
    "exact_every",
    "overlap",
)

#: name -> (class in :mod:`composer_plugins.diloco.transports`, one-line description, build parameters).
BUILTIN_TRANSPORTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "torchft": (
        "Transport",
        "torchft's DiLoCo: a lighthouse and a gloo all-reduce between the replicas (bitwise the upstream update).",
        {
            "needs": "lighthouse",
            "callback_path": "composer_plugins.diloco.strategy:DiLoCoCallback",
            "cloud": False,
            "ignored": _STORE_KEYS,
        },
    ),
    "object_store": (
        "ObjectStoreTransport",
        "The replicas meet only through an object store (S3, GCS, Azure, file://): serverless, no open ports.",
        {
            "needs": "store",
            "callback_path": "composer_plugins.diloco.objstore:ObjectStoreDiLoCoCallback",
            "cloud": True,
            "ignored": (
                "min_replica_size",
                "max_retries",
                "checkpoint_dir",
                "lighthouse",
                "use_bucketization",
                "bucket_cap_mb",
                "checkpoint_transport",
            ),
        },
    ),
}


#: The built-in transports (each factory is called with ``name=`` its registered name as well).
register_transports = builtin_hook(_MODULE, BUILTIN_TRANSPORTS)
