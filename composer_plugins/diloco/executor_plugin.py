"""Default plugin: registers the built-in replica executors through the public ``register_executors`` hook.

Factories are lazy ``"module:attr"`` strings (as the built-in transports and codecs), so loading the plugins or
listing the executors imports nothing of :mod:`composer_plugins.diloco.executors` (nor a cloud SDK) until
``--executor`` builds one.
"""

from __future__ import annotations

from composer_plugins.core.registry import builtin_hook

_MODULE = "composer_plugins.diloco.executors"

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
register_executors = builtin_hook(_MODULE, BUILTIN_EXECUTORS)
