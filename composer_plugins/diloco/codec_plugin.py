"""Default plugin: registers the built-in pseudo-gradient codecs through the public ``register_codecs`` hook.

Factories are lazy ``"module:attr"`` strings (as the built-in losses), so loading the plugins, listing the
codecs or answering a config error never imports torch; :mod:`composer_plugins.diloco.codecs` holds them.
"""

from __future__ import annotations

from typing import Any

from composer_plugins.core.registry import builtin_hook

_MODULE = "composer_plugins.diloco.codecs"

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
register_codecs = builtin_hook(_MODULE, BUILTIN_CODECS)
