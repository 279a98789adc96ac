"""DiLoCo vs DDP: bytes all-reduced per inner step, and held-out loss at equal tokens vs one replica.

All runs train the same tiny causal LM (:class:`composer_plugins.core.diloco.ToyCausalLM`) on the same
synthetic Markov-chain data, each replica/rank on its own shard, batch ``B`` per replica per step.

* **DiLoCo**: ``R`` replica processes + a torchft lighthouse (``composer_plugins.core.launch``), ``S``
  inner steps each, sync every ``H``. Bytes = what torchft hands to its gloo process group's ``allreduce``
  (counted by a wrapper around ``torchft.ProcessGroupGloo``).
* **DDP**: ``R`` processes of ``torch.nn.parallel.DistributedDataParallel`` over gloo, ``S`` steps; bytes
  = the gradient buckets seen by a counting comm hook (then the stock all-reduce hook).
* **single**: one process, no communication, ``R*S`` steps — the same number of tokens as DiLoCo's R
  replicas together.

Bytes are payload bytes handed to all-reduce (not wire bytes; a ring all-reduce moves ~2(R-1)/R of it
for both). Expect DiLoCo/DDP ≈ 1/H. Run: ``python -m benchmarks.bench_diloco [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "diloco"


def _toy(quick: bool, steps: int) -> dict[str, Any]:
    return {
        "vocab_size": 32,
        "d_model": 32 if quick else 48,
        "n_heads": 2,
        "n_layers": 1,
        "seq_len": 24,
        "batch_size": 16,
        "lr": 3e-3,
        "max_steps": steps,
        "eval_batches": 8,
    }


# -- DDP worker (a separate process per rank) ------------------------------------------------


def ddp_worker(rank: int, world: int, port: int, toy_json: str, out: str) -> None:
    """One DDP rank: train ``max_steps`` steps with a byte-counting comm hook; rank 0 writes results."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from composer_plugins.core.diloco import ToyConfig, toy_eval_loss, toy_model, toy_stream

    torch.set_num_threads(1)
    toy = ToyConfig(**json.loads(toy_json))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(toy.seed)
    model = toy_model(toy)
    ddp = DDP(model)
    state = {"bytes": 0, "calls": 0}

    # left unannotated: DDP checks the annotations, and this module uses postponed (string) annotations
    def counting_hook(st, bucket):  # type: ignore[no-untyped-def]
        buf = bucket.buffer()
        st["bytes"] += buf.numel() * buf.element_size()
        st["calls"] += 1
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook(state, counting_hook)
    opt = model.configure_optimizers()
    t0 = time.perf_counter()
    for _, batch in zip(range(toy.max_steps), toy_stream(toy, rank).batches(), strict=False):
        ids = batch["input_ids"]
        logits = ddp(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    secs = time.perf_counter() - t0
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "bytes_allreduced": state["bytes"],
                    "allreduce_calls": state["calls"],
                    "inner_steps": toy.max_steps,
                    "eval_loss": toy_eval_loss(model, toy),
                    "num_params": sum(p.numel() for p in model.parameters()),
                    "seconds": secs,
                }
            )
        )
    dist.destroy_process_group()


def _run_ddp(world: int, toy: dict[str, Any], tmp: Path) -> dict[str, Any]:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    out = tmp / "ddp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "benchmarks.bench_diloco", "--ddp-worker"]
    procs = [
        subprocess.Popen(
            [*cmd, str(r), str(world), str(store.port), json.dumps(toy), str(out)],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in range(world)
    ]
    try:
        errs = [p.communicate(timeout=600)[1] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("DDP worker failed:\n" + "\n".join(e.decode()[-2000:] for e in errs))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return json.loads(out.read_text())


def _run_diloco(replicas: int, h: int, toy: dict[str, Any], tmp: Path) -> dict[str, Any]:
    from composer_plugins.core.launch import ReplicaGroup, replica_argv

    log_dir = tmp / f"diloco_h{h}"
    overrides = [f"diloco.sync_every={h}"] + [f"toy.{k}={v}" for k, v in toy.items()]
    argv = lambda i: replica_argv("toy", None, [*overrides, f"toy.output={log_dir}/result{i}.json"])  # noqa: E731
    with ReplicaGroup(argv, replicas, log_dir=log_dir, grace_s=5, threads_per_replica=1) as g:
        res = g.wait(timeout=900)
    if not res.ok:
        logs = "\n".join((log_dir / f"replica{i}.log").read_text()[-2000:] for i in range(replicas))
        raise RuntimeError(f"DiLoCo replicas failed: {res}\n{logs}")
    outs = [json.loads((log_dir / f"result{i}.json").read_text()) for i in range(replicas)]
    first = outs[0]
    first["identical_final_weights"] = len({o["param_hash"] for o in outs}) == 1
    syncs = [json.loads(line) for line in (log_dir / "replica0.sync.jsonl").read_text().splitlines()]
    first["syncs"] = len(syncs)
    first["min_participants"] = min(s["participants"] for s in syncs)
    return first


def _run_single(steps: int, toy: dict[str, Any]) -> dict[str, Any]:
    from composer_plugins.core.diloco import run_toy

    os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    return run_toy({"toy": {**toy, "max_steps": steps}})


def run(quick: bool = False) -> dict[str, Any]:
    """Measure; returns ``{"name", "results", "ratios", "targets"}``."""
    from tqdm import tqdm

    replicas = 2
    steps = 64 if quick else 384
    hs = [8] if quick else [4, 16, 64]
    toy = _toy(quick, steps)
    results: dict[str, Any] = {"replicas": replicas, "inner_steps_per_replica": steps, "toy": toy}
    ratios: dict[str, float] = {}
    targets: dict[str, str] = {}
    plan = ["ddp", "single"] + [f"diloco_h{h}" for h in hs]
    with tempfile.TemporaryDirectory(prefix="bench_diloco_") as d, tqdm(plan, desc="bench_diloco") as bar:
        tmp = Path(d)
        for item in bar:
            bar.set_postfix_str(item)
            if item == "ddp":
                ddp = _run_ddp(replicas, toy, tmp)
                ddp["bytes_per_inner_step"] = ddp["bytes_allreduced"] / ddp["inner_steps"]
                results["ddp"] = ddp
            elif item == "single":
                single = _run_single(replicas * steps, toy)
                results["single_equal_tokens"] = single
            else:
                h = int(item.removeprefix("diloco_h"))
                dl = _run_diloco(replicas, h, toy, tmp)
                dl["bytes_per_inner_step"] = dl["bytes_allreduced"] / dl["inner_steps"]
                results[item] = dl
                ratios[f"bytes_per_inner_step_vs_ddp_H{h}"] = dl["bytes_per_inner_step"] / ddp["bytes_per_inner_step"]
                targets[f"bytes_per_inner_step_vs_ddp_H{h}"] = f"≈ 1/H = {1 / h:.4f}"
                ratios[f"eval_loss_vs_single_equal_tokens_H{h}"] = dl["eval_loss"] / single["eval_loss"]
                targets[f"eval_loss_vs_single_equal_tokens_H{h}"] = "≈ 1 (≤ 1.10 on this tiny LM)"
        ratios["eval_loss_ddp_vs_single_equal_tokens"] = results["ddp"]["eval_loss"] / single["eval_loss"]
        targets["eval_loss_ddp_vs_single_equal_tokens"] = "≈ 1 (same tokens; DDP = large-batch SGD)"
    out = {"name": NAME, "results": results, "ratios": ratios, "targets": targets}
    _print_table(out, hs)
    return out


def _print_table(out: dict[str, Any], hs: list[int]) -> None:
    r = out["results"]
    rows = [("DDP (every step)", r["ddp"])] + [(f"DiLoCo H={h}", r[f"diloco_h{h}"]) for h in hs]
    print(f"\nDiLoCo benchmark: {r['replicas']} replicas x {r['inner_steps_per_replica']} inner steps, "
          f"{r['ddp']['num_params']} params (fp32)")  # fmt: skip
    print(f"{'run':<18}{'bytes/inner step':>18}{'vs DDP':>10}{'eval loss':>11}")
    base = r["ddp"]["bytes_per_inner_step"]
    for name, d in rows:
        print(f"{name:<18}{d['bytes_per_inner_step']:>18,.0f}{d['bytes_per_inner_step'] / base:>10.4f}"
              f"{d['eval_loss']:>11.4f}")  # fmt: skip
    s = r["single_equal_tokens"]
    print(f"{'single, = tokens':<18}{0:>18,}{0:>10.4f}{s['eval_loss']:>11.4f}  ({s['inner_steps']} steps)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result dict as JSON")
    p.add_argument("--ddp-worker", nargs=5, metavar=("RANK", "WORLD", "PORT", "TOY", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.ddp_worker:
        rank, world, port, toy_json, out = a.ddp_worker
        ddp_worker(int(rank), int(world), int(port), toy_json, out)
        return
    res = run(quick=a.quick)
    if a.json:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
