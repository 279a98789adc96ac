"""A sandbox for running untrusted (model-written) code, built so that rewards cannot be hacked.

Each protection and what it rests on (namespaces where ``unshare`` works, else the ``sitecustomize`` audit
hook; results on a nonce-authenticated pipe, so printing "PASSED" scores nothing) is tabled in docs/envs.md,
"The sandbox"; ``composer-plugins env sandbox-check`` prints what works on this machine.

Modules: ``runner`` (:class:`Sandbox`, :func:`isolation_info`), ``tree`` (clean copies, the scrubbed
environment), ``host`` (interpreter paths, the allow-list, owner records and leftover cleanup), ``types``
(limits, results, errors) and ``_runtime/`` (the trusted programs copied into every sandbox). Import from
this package.
"""

from __future__ import annotations

from composer_plugins.envs.sandbox.host import OWNER_FILE, SYSTEM_PATHS, interpreter_paths, remove_leftover_sandboxes
from composer_plugins.envs.sandbox.runner import Sandbox, isolation_info
from composer_plugins.envs.sandbox.tree import (
    LEAKY_DIRS,
    LEAKY_FILES,
    LEAKY_TOP_DIRS,
    copy_clean_tree,
    safe_env,
    scrub_tree,
)
from composer_plugins.envs.sandbox.types import IsolationInfo, SandboxError, SandboxLimits, SandboxResult

__all__ = [
    "LEAKY_DIRS",
    "LEAKY_FILES",
    "LEAKY_TOP_DIRS",
    "OWNER_FILE",
    "SYSTEM_PATHS",
    "IsolationInfo",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "copy_clean_tree",
    "interpreter_paths",
    "isolation_info",
    "remove_leftover_sandboxes",
    "safe_env",
    "scrub_tree",
]
