"""One data-parallel rank of the tests in ``test_training_dp.py`` (run as a script: ``dp_worker.py SPEC RANK``).

The rank joins a gloo process group through the environment Lightning reads (``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK``, ``LOCAL_RANK``: processes launched from outside),
then runs the spec's training runs through :func:`run_train` with ``trainer.devices=W``. For every
optimizer step it records the tasks it drew and the step statistics; for the first step of the
first run also its rollouts and the (DDP-averaged, pre-clipping) gradients. Results go to
``<out>/rank<R>.pt``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from typing import Any

from lightning.pytorch.callbacks import Callback

from composer_plugins.envs.gsm8k import GSM8KEnv


class VariedRewardEnv(GSM8KEnv):
    """GSM8K prompts with a reward that differs inside a group (the completion's length mod 5), so an
    untrained policy's step has non-zero advantages and gradients."""

    def reward(self, prompts: Any, completions: Any, **columns: Any) -> list[float]:
        return [(len(c) % 5) / 4 for c in completions]


class RankFile(Callback):
    """``trainer.callbacks: [{class_path: dp_worker.RankFile, init_args: {out: DIR}}]``: writes
    ``<out>/rank<R>.done`` (holding the world size) when fit ends on global rank ``R``."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.done"), "w") as f:
            f.write(f"{trainer.world_size}\n")


def main(spec_path: str, rank: int) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = json.loads(open(spec_path).read())
    world = int(spec["world"])
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec["port"]),
        WORLD_SIZE=str(world),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
    )
    from composer_plugins.procs import set_pdeathsig

    set_pdeathsig()
    import torch
    from lightning.pytorch.callbacks import Callback

    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.runs.run import run_train

    torch.set_num_threads(1)
    out: dict[str, Any] = {"runs": {}}

    def whole(module: Any) -> dict[str, Any]:
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in module.named_parameters()}

    class Capture(Callback):
        def __init__(self, rec: dict[str, Any], grads: bool, weights: bool = False) -> None:
            self.rec, self.grads, self.weights = rec, grads, weights

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if self.weights:  # the policy after each optimizer step (DDP: whole on every rank)
                self.rec["policy"] = {trainer.global_step: whole(pl_module.policy)}

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *a: Any) -> None:
            if self.weights:
                self.rec["policy"][trainer.global_step] = whole(pl_module.policy)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if getattr(pl_module, "ema_teacher", None) is not None:  # the EMA teacher (FSDP: gathered)
                with pl_module.full_params(recurse=True):
                    self.rec["ema"] = whole(pl_module.ema_teacher.policy)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.rec.setdefault("tasks", {})[int(batch["index"])] = [t["prompt"] for t in batch["tasks"]]

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            step = trainer.global_step
            self.rec.setdefault("stats", {})[step] = dict(pl_module.last_step_stats)
            if self.grads and step == 0:
                self.rec["grads"] = {
                    n: p.grad.detach().clone() for n, p in pl_module.policy.named_parameters() if p.grad is not None
                }
                self.rec["rollout"] = pl_module.last_rollout.state()

    for run in spec["runs"]:
        cfg, src = loads_train_config(spec["yaml"], [*spec["overrides"], *run["overrides"]])
        rec: dict[str, Any] = {}
        run_train(
            cfg,
            src,
            resume=run.get("resume"),
            extra_callbacks=[Capture(rec, run.get("grads", False), run.get("weights", False))],
        )
        out["runs"][run["name"]] = rec
    torch.save(out, os.path.join(spec["out"], f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
