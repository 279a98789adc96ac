"""A ``--target`` for the launcher tests: the toy LM whose replicas mark each all-reduce in a file.

``composer-plugins diloco --target diloco_fault_target:run`` (with this directory on ``PYTHONPATH``) runs
:func:`composer_plugins.diloco.toy.run_toy`; every replica's gloo group writes
``$FAULT_DIR/allreduce-r<index>-restart<k>-sync<n>`` (its pid) when it enters the all-reduce of its
``n``-th sync (``n`` = lines already in its sync log + 1). Replica ``$FAULT_HOLD_REPLICA`` (first start
only) then holds that all-reduce at sync ``$FAULT_HOLD_SYNC`` for up to ``$FAULT_HOLD_S`` seconds, so a
test can ``kill -9`` it while its peer waits inside the same all-reduce. Nothing here replaces torchft:
the group is torchft's ``ProcessGroupGloo`` and the all-reduce goes through it unchanged.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from composer_plugins.diloco import strategy
from composer_plugins.diloco.launch import ENV_INDEX, ENV_RESTART, ENV_SYNC_LOG

_make_process_group = strategy.make_process_group


def _syncs_done() -> int:
    path = os.environ.get(ENV_SYNC_LOG)
    if not path or not os.path.exists(path):
        return 0
    return sum(1 for _ in open(path))


def _marking_process_group(timeout: timedelta) -> Any:
    pg = _make_process_group(timeout)
    index, restart = int(os.environ[ENV_INDEX]), int(os.environ.get(ENV_RESTART, "0"))
    out = Path(os.environ["FAULT_DIR"])
    hold_replica = int(os.environ.get("FAULT_HOLD_REPLICA", "-1"))
    hold_sync = int(os.environ.get("FAULT_HOLD_SYNC", "0"))
    hold_s = float(os.environ.get("FAULT_HOLD_S", "60"))
    inner = pg.allreduce

    def allreduce(tensors: Any, opts: Any) -> Any:
        sync = _syncs_done() + 1
        mark = out / f"allreduce-r{index}-restart{restart}-sync{sync}"
        if not mark.exists():
            mark.write_text(str(os.getpid()))
            if index == hold_replica and restart == 0 and sync == hold_sync:
                time.sleep(hold_s)  # the test kills this process during the sleep
        return inner(tensors, opts)

    pg.allreduce = allreduce
    return pg


def run(cfg: Any) -> dict:
    from composer_plugins.diloco.toy import run_toy

    strategy.make_process_group = _marking_process_group
    return run_toy(cfg)
