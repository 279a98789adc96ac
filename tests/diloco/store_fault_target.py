"""A toy replica that sleeps once (a straggler): replica ``$STRAGGLE_REPLICA`` sleeps ``$STRAGGLE_S`` seconds
after inner step ``$STRAGGLE_STEP`` of its first start, so it misses that round's deadline."""

from __future__ import annotations

import os
import time
from typing import Any

import lightning.pytorch as pl


class _Straggle(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        me = int(os.environ.get("COMPOSER_DILOCO_REPLICA_INDEX", "0"))
        first = os.environ.get("COMPOSER_DILOCO_RESTART", "0") == "0"
        if (
            first
            and me == int(os.environ["STRAGGLE_REPLICA"])
            and trainer.global_step == int(os.environ["STRAGGLE_STEP"])
        ):
            time.sleep(float(os.environ["STRAGGLE_S"]))


def run(cfg: Any) -> dict:
    from composer_plugins.diloco.toy import run_toy

    return run_toy(cfg, extra_callbacks=[_Straggle()])
