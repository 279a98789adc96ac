"""A toy replica with faults chosen by environment variables (first life, restart 0, only):

* ``STRAGGLE_REPLICA``/``STRAGGLE_STEP``/``STRAGGLE_S``: that replica sleeps after that inner step, so it misses
  the round's deadline;
* ``LATE_REPLICA``/``LATE_S``: that replica sleeps before its first inner step (starts late); with
  ``LATE_AFTER=<file>`` it first waits until ``$FAULT_DIR/<file>`` exists (an event, not a guess at a time);
* every life writes ``$FAULT_DIR/started-<index>-<restart>`` as it starts training (with ``FAULT_DIR`` set);
* ``DIE_REPLICA``/``DIE_STEP``: that replica kills itself (SIGKILL) after that inner step;
* ``DIE_AFTER_MANIFEST_ROUND``: whichever replica creates that round's manifest kills itself (SIGKILL) at once,
  before it writes the round's global state;
* ``PAUSE_REPLICA``/``PAUSE_ROUND``: that replica stops itself (SIGSTOP) right after it published that round's
  pseudo-gradient, having written its pid to ``$FAULT_DIR/paused-<index>``; the test sends SIGCONT.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


def _me() -> int:
    return int(os.environ.get("COMPOSER_DILOCO_REPLICA_INDEX", "0"))


def _first_life() -> bool:
    return os.environ.get("COMPOSER_DILOCO_RESTART", "0") == "0"


def _is(var: str) -> bool:
    return var in os.environ and _first_life() and _me() == int(os.environ[var])


class _Faults(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        fault_dir = os.environ.get("FAULT_DIR")
        if fault_dir:
            restart = os.environ.get("COMPOSER_DILOCO_RESTART", "0")
            Path(fault_dir, f"started-{_me()}-{restart}").write_text(str(os.getpid()))
        if _is("LATE_REPLICA"):
            if "LATE_AFTER" in os.environ:
                event, deadline = Path(os.environ["FAULT_DIR"], os.environ["LATE_AFTER"]), time.monotonic() + 300
                while not event.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            time.sleep(float(os.environ["LATE_S"]))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if _is("STRAGGLE_REPLICA") and step == int(os.environ["STRAGGLE_STEP"]):
            time.sleep(float(os.environ["STRAGGLE_S"]))
        if _is("DIE_REPLICA") and step == int(os.environ["DIE_STEP"]):
            os.kill(os.getpid(), signal.SIGKILL)


def _die_after_manifest(r_kill: int) -> None:
    from composer_plugins.diloco.objstore import RoundStore

    close = RoundStore.close_round

    def close_round(
        self: RoundStore, r: int, grads: dict[int, str], closer: int, **kw: Any
    ) -> tuple[dict[str, Any], bool]:
        m, created = close(self, r, grads, closer, **kw)
        if created and r == r_kill and _first_life():
            os.kill(os.getpid(), signal.SIGKILL)
        return m, created

    RoundStore.close_round = close_round  # type: ignore[method-assign]


def _pause_after_publish(r_pause: int) -> None:
    from composer_plugins.diloco.objstore import RoundStore

    put = RoundStore.put_grad

    def put_grad(self: RoundStore, r: int, *args: Any, **kw: Any) -> tuple[str, int]:
        out = put(self, r, *args, **kw)
        if r == r_pause and _is("PAUSE_REPLICA"):
            Path(os.environ["FAULT_DIR"], f"paused-{_me()}").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return out

    RoundStore.put_grad = put_grad  # type: ignore[method-assign]


def run(cfg: Any) -> dict:
    from composer_plugins.diloco.toy import run_toy

    if "DIE_AFTER_MANIFEST_ROUND" in os.environ:
        _die_after_manifest(int(os.environ["DIE_AFTER_MANIFEST_ROUND"]))
    if "PAUSE_ROUND" in os.environ:
        _pause_after_publish(int(os.environ["PAUSE_ROUND"]))
    return run_toy(cfg, extra_callbacks=[_Faults()])
