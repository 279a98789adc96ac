"""Default plugin of ``diloco``: the ``diloco`` command (:mod:`.cli`) and the built-in pseudo-gradient codecs,
outer-sync transports and replica executors, through the public hooks a third party implements. Factories are lazy
``"module:attr"`` strings: nothing of torch or a cloud SDK is imported until one is built.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl
from composer_plugins.core.registry import builtin_hook
from composer_plugins.diloco.cli import diloco_cmd


@hookimpl
def register_commands(cli: Any) -> None:
    """Add ``composer-plugins diloco``."""
    cli.add_command(diloco_cmd)


#: name -> (class in :mod:`composer_plugins.diloco.codecs`, one-line description, build parameters).
BUILTIN_CODECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "none": ("NoneCodec", "fp32 values as they are (lossless; the bitwise parity with torchft holds with it).", {}),
    "bf16": ("BF16Codec", "bf16 values: half the fp32 bytes, about 0.3 % relative error.", {}),
    "int8": (
        "Int8Codec",
        "int8 with a per-block absmax scale (blocks of 4096), deflated: at most a quarter of the fp32 bytes.",
        {},
    ),
    "int4": (
        "Int4Codec",
        "int4 with a one-byte log scale per block of 256, deflated, with error feedback: about an eighth.",
        {},
    ),
    "sparseloco": (
        "SparseLoCoCodec",
        "Chunked top-k (2 % of each chunk), 2-bit values, packed indices, error feedback (SparseLoCo-class).",
        {"density": 0.02, "chunk": 4096},
    ),
    "sparse": (
        "SparseCodec",
        "A mostly-zero vector's entries: a deflated bitmap and scaled fp16 values (sparseloco's mean).",
        {},
    ),
}


#: The built-in codecs.
register_codecs = builtin_hook("composer_plugins.diloco.codecs", BUILTIN_CODECS)


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
register_transports = builtin_hook("composer_plugins.diloco.transports", BUILTIN_TRANSPORTS)


#: name -> (factory in :mod:`composer_plugins.diloco.executors`, one-line description).
BUILTIN_EXECUTORS: dict[str, tuple[str, str]] = {
    "local": ("local_executor", "Processes on this host, one OS process group per replica (--warm-restarts forks)."),
    "hf_jobs": (
        "hf_jobs_executor",
        "Each replica a Hugging Face Job (diloco.jobs: image, flavor, secrets); needs transport=object_store.",
    ),
    "modal": (
        "modal_executor",
        "Each replica one call of a Modal function (diloco.jobs: image, gpu, secrets); needs transport=object_store.",
    ),
}


#: The built-in executors (each factory is called with ``dcfg``, ``log_dir=``, ``warm_restarts=``, ``name=``).
register_executors = builtin_hook("composer_plugins.diloco.executors", BUILTIN_EXECUTORS)
