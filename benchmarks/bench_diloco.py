"""DiLoCo vs DDP: bytes all-reduced per inner step, and held-out loss at equal tokens vs one replica.

All runs train the same tiny causal LM (:class:`composer_plugins.diloco.toy.ToyCausalLM`) on the same
synthetic Markov-chain data, each replica/rank on its own shard, batch ``B`` per replica per step.

* **DiLoCo**: ``R`` replica processes + a torchft lighthouse (``composer_plugins.diloco.launch``), ``S``
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
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from composer_plugins.procs import ChildFailed, Children, exit_description

NAME = "diloco"
REPO_ROOT = Path(__file__).resolve().parent.parent


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

#: Bound of every wait in the DDP baseline: the rendezvous, process-group set-up and each collective.
DDP_TIMEOUT_S = 60.0
#: How long the other workers may take to exit after the first one has finished cleanly.
DDP_STRAGGLER_S = 60.0


def _log(msg: str) -> None:
    print(f"[bench_diloco] {msg}", file=sys.stderr, flush=True)


def ddp_worker(rank: int, world: int, port: int, toy_json: str, out: str, timeout_s: float = DDP_TIMEOUT_S) -> None:
    """One DDP rank: train ``max_steps`` steps with a byte-counting comm hook; rank 0 writes results.

    Every wait is bounded by ``timeout_s``: the rendezvous (which names a rank that exited before it
    arrived), ``init_process_group`` and each gloo collective. Run it through :func:`_ddp_worker_main`,
    which ends the process without running the process group's destructor.
    """
    import faulthandler
    from datetime import timedelta

    from composer_plugins.procs import StoreRendezvous, set_pdeathsig

    set_pdeathsig(signal.SIGKILL)  # also set by the parent's preexec_fn; harmless twice
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks before killing us

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from composer_plugins.diloco.toy import ToyConfig, toy_eval_loss, toy_model, toy_stream

    torch.set_num_threads(1)
    toy = ToyConfig(**json.loads(toy_json))
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    StoreRendezvous(store, world, name="DDP rendezvous", what="worker").wait(rank, timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    _log(f"DDP worker {rank}/{world}: process group ready")
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
    _log(f"DDP worker {rank}/{world}: {toy.max_steps} steps in {secs:.1f}s")
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
    # No ``destroy_process_group()`` and no normal interpreter exit: see :func:`_ddp_worker_main`.


def _ddp_worker_main(rank: int, world: int, port: int, toy_json: str, out: str, timeout_s: float) -> None:
    """Run :func:`ddp_worker` and end the process with ``os._exit`` (0, or 1 after printing the error).

    Why not a normal exit: torch's ``~ProcessGroupGloo`` (run when the last reference to the DDP
    reducer goes, i.e. at the latest during interpreter exit) joins gloo's worker threads while the
    calling thread holds the GIL. A worker thread that has just finished the last all-reduce may still
    be destroying that work item, which holds Python objects (the comm hook's ``fut.then`` callback,
    the autograd thread-local state captured with the work); dropping them needs the GIL. Both threads
    then wait for each other forever. It happened in about one run in four on a 2-core machine, to the
    rank that reached the end first without Python work left to do (rank 1: rank 0 still evaluates),
    so rank 0 exited 0 and rank 1 sat at ~3% CPU (the GIL wait polls) until something killed it. Once
    this function returns, every collective of this rank has completed and the results are written,
    so nothing is lost by skipping the destructors.
    """
    code = 0
    try:
        ddp_worker(rank, world, port, toy_json, out, timeout_s)
    except BaseException:  # report anything, then exit without the destructors
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_ddp(
    world: int,
    toy: dict[str, Any],
    tmp: Path,
    *,
    timeout_s: float = DDP_TIMEOUT_S,
    total_timeout_s: float = 900.0,
    straggler_s: float = DDP_STRAGGLER_S,
    on_start: Callable[[Children], None] | None = None,
) -> dict[str, Any]:
    """Run ``world`` DDP workers; fail at once (naming the worker, with its output) when one dies.

    Each worker is its own session that dies with this process; its stdout+stderr go to
    ``tmp/ddp_worker<rank>.log``. The rendezvous store lives here, so a worker that exits before it
    arrives is marked gone there and the others stop waiting for it.
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    from composer_plugins.procs import StoreRendezvous

    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=timeout_s))  # fmt: skip
    rendezvous = StoreRendezvous(store, world, name="DDP rendezvous", what="worker")
    out = tmp / "ddp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "benchmarks.bench_diloco", "--ddp-worker"]
    with Children("bench-ddp") as kids:
        for r in range(world):
            kids.start(
                f"DDP worker {r}",
                [*cmd, str(r), str(world), str(store.port), json.dumps(toy), str(out), str(timeout_s)],
                log_path=tmp / f"ddp_worker{r}.log",
                env=env,
                cwd=str(REPO_ROOT),
            )
        if on_start is not None:
            on_start(kids)
        try:
            kids.wait(
                total_timeout_s,
                straggler_s=straggler_s,
                on_exit=lambda c, rc: rendezvous.mark_gone(kids.children.index(c), exit_description(rc)),
            )
        except ChildFailed as e:
            raise RuntimeError(f"DDP baseline failed: {e}") from None
    return json.loads(out.read_text())


def _run_diloco(replicas: int, h: int, toy: dict[str, Any], tmp: Path) -> dict[str, Any]:
    from composer_plugins.diloco.launch import LaunchError, ReplicaGroup, replica_argv

    log_dir = tmp / f"diloco_h{h}"
    overrides = [f"diloco.sync_every={h}"] + [f"toy.{k}={v}" for k, v in toy.items()]
    argv = lambda i: replica_argv("toy", None, [*overrides, f"toy.output={log_dir}/result{i}.json"])  # noqa: E731
    try:
        with ReplicaGroup(argv, replicas, log_dir=log_dir, grace_s=5, threads_per_replica=1) as g:
            # a replica that dies invalidates the comparison: stop at once instead of training on without it
            res = g.wait(timeout=900, fail_fast=True)
    except LaunchError as e:
        raise RuntimeError(f"DiLoCo replicas (H={h}) failed: {e}") from None
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
    from composer_plugins.diloco.toy import run_toy

    os.environ.pop("TORCHFT_LIGHTHOUSE", None)
    return run_toy({"toy": {**toy, "max_steps": steps}})


def run(quick: bool = False) -> dict[str, Any]:
    """Measure; returns ``{"name", "results", "ratios", "targets"}``."""
    replicas = 2
    steps = 64 if quick else 384
    hs = [8] if quick else [4, 16, 64]
    toy = _toy(quick, steps)
    results: dict[str, Any] = {"replicas": replicas, "inner_steps_per_replica": steps, "toy": toy}
    ratios: dict[str, float] = {}
    targets: dict[str, str] = {}
    plan = ["ddp", "single"] + [f"diloco_h{h}" for h in hs]
    tmp = Path(tempfile.mkdtemp(prefix="bench_diloco_"))
    ok = False
    try:
        _measure(plan, replicas, steps, toy, tmp, results, ratios, targets)
        ok = True
    finally:
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # the workers' and replicas' own output, for the post-mortem
            _log(f"kept the logs of the failed run in {tmp}")
    out = {"name": NAME, "results": results, "ratios": ratios, "targets": targets}
    _print_table(out, hs)
    return out


def _measure(plan: list[str], replicas: int, steps: int, toy: dict[str, Any], tmp: Path, results: dict[str, Any],
             ratios: dict[str, float], targets: dict[str, str]) -> None:  # fmt: skip
    from tqdm import tqdm

    with tqdm(plan, desc="bench_diloco") as bar:
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
    p.add_argument("--ddp-worker", nargs=6, metavar=("RANK", "WORLD", "PORT", "TOY", "OUT", "TIMEOUT"),
                   help=argparse.SUPPRESS)  # fmt: skip
    a = p.parse_args(argv)
    if a.ddp_worker:
        rank, world, port, toy_json, out, timeout_s = a.ddp_worker
        _ddp_worker_main(int(rank), int(world), int(port), toy_json, out, float(timeout_s))
    res = run(quick=a.quick)
    if a.json:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
