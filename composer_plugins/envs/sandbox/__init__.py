"""A sandbox for running untrusted (model-written) code, built so that rewards cannot be hacked.

Every run gets a fresh temp directory and a subprocess that:

* runs in new network, mount, PID, IPC and UTS namespaces when ``unshare`` works on this
  machine (``isolation="namespaces"``): no network at all (not even loopback), a private
  ``/proc`` (no other process's environment or memory), hidden paths overmounted by a tmpfs,
  every process killed with the namespace. Real root is switched to a fresh unprivileged uid
  (so ``RLIMIT_NPROC`` applies); a user namespace's root drops all capabilities;
* otherwise (``isolation="guard"``) is protected by an audit hook installed through
  ``sitecustomize`` (see :mod:`composer_plugins.envs.sandbox._runtime.sitecustomize`): sockets, hidden
  paths, other processes' ``/proc``, ctypes and object-graph walks are refused, and a token pipe
  caps the number of processes;
* sees every host path read-only (namespace mode remounts every mount read-only; the guard refuses
  writes) or hidden, except its own directory, whose total size is bounded (``max_disk_mb``); its
  ``/dev/shm`` is a private tmpfs of ``max_shm_mb``;
* has wall-clock and CPU timeouts, an address-space limit, a process limit, a file-size limit
  and an output-size limit, and is killed as a whole process group (``start_new_session`` +
  ``killpg``);
* dies with the process that started it (``PR_SET_PDEATHSIG`` on the outermost sandbox process, and
  on the namespace's init inside), and enforces its wall-clock limit inside as well, so killing the
  scorer with ``kill -9`` leaves nothing running; the next sandbox started on the machine removes
  ``cp-sandbox-*`` directories whose owner process is gone;
* with ``expose="allowlist"`` sees only an allow-list of host paths (the interpreter, its
  site-packages, system libraries) instead of everything but the hidden paths;
* sees a scrubbed environment (no API keys, ``HOME`` inside the sandbox,
  ``PYTHONDONTWRITEBYTECODE=1``);
* only gets copies of source trees with everything that leaks deleted code removed:
  ``__pycache__``/``.pyc``, type-checker and linter caches, ``.git`` history, build artifacts,
  editor backups, compiled copies of ``.py`` modules (see :func:`copy_clean_tree`).

Results come back on a nonce-authenticated pipe, so printing "PASSED" or exiting 0 early
scores nothing. ``composer-plugins env sandbox-check`` prints what works on this machine.

Modules: :mod:`~composer_plugins.envs.sandbox.runner` (the :class:`Sandbox` that runs one command, and
:func:`isolation_info`), :mod:`~composer_plugins.envs.sandbox.tree` (cleaned copies of source trees and the
scrubbed environment), :mod:`~composer_plugins.envs.sandbox.host` (interpreter paths, the allow-list, owner
records and leftover cleanup), :mod:`~composer_plugins.envs.sandbox.types` (limits, results, errors), and
``_runtime/`` (the trusted programs copied into every sandbox). Import from this package.
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
