"""Scale-out: 1 vs 2 data-parallel processes, and rollouts from an inference server vs in-process generate.

* **Data parallel.** The real stack (``run_train``, Lightning ``DDPStrategy`` over gloo) with
  ``trainer.devices=W`` ranks launched from outside as ``torchrun`` would, one torch thread each, at
  the *same per-rank batch* (``prompts_per_step = W × per-rank prompts``). Each rank draws its own
  share of the step's prompts, so two ranks should do twice the work per step in about the same
  time. Measured: median step time (between consecutive batch starts, after two warm-up steps),
  prompts/s and completion tokens/s of the whole step (all ranks), at the embedded tiny default and
  at the CPU scale proxy (``models.tiny.MODEL_SHAPES["cpu-proxy"]``: the real 151,936-token
  vocabulary with a tiny body). The 1- and 2-process runs alternate in rounds; the ratio is the
  median of per-round ratios (the machine may be shared). Target: ≥ 1.6× prompts/s.
* **Rollout generators.** The ``server`` generator against the loopback server
  (:mod:`composer_plugins.testing.loopback_server`: HF ``generate`` behind vLLM's completions API,
  one torch thread, one request of ``n = G`` per prompt) vs the ``hf`` generator (one batched
  ``generate`` in-process, one thread), same policy, prompts, ``G`` and budget: completions/s.
  The loopback server samples prompt by prompt, so this is the HTTP/client overhead plus unbatched
  sampling, not vLLM's throughput.

Run: ``python -m benchmarks.bench_scaleout [--quick]`` (``nice -n 10`` on a shared machine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Per-rank batch and budget of each scale (tiny: the default config's rollout section).
SCALES: dict[str, dict[str, Any]] = {
    "tiny": {"prompts": 8, "generations": 8, "new_tokens": 32},
    "cpu-proxy": {"prompts": 2, "generations": 4, "new_tokens": 16},
}


#: Untimed steps at the start of every run (allocator, caches and, with 2 ranks, the first collectives).
WARMUP_STEPS = 2


def _cache() -> str:
    return os.environ.get("COMPOSER_CACHE_DIR", ".composer_cache")


def _yaml(model: str | None) -> str:
    base = f"model: {{name_or_path: {model}}}\nsft: {{enabled: false}}\n" if model else "sft: {progress: false}\n"
    return (
        f"cache_dir: {_cache()}\n{base}"
        "losses: {grpo: {weight: 1.0}, hint_distill: {enabled: false}}\n"
        "trainer: {checkpoint_every_n_steps: 0, enable_progress_bar: false, num_threads: 1}\n"
        "eval: {at_start: false, at_end: false}\nmlflow: {enabled: false}\n"
    )


# -- one rank (a separate process) --------------------------------------------------------------


def worker(spec_path: str, rank: int) -> None:
    """One rank of a timed run: ``run_train`` for ``steps + 1`` steps; rank 0 writes step times and tokens."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = json.loads(Path(spec_path).read_text())
    world = int(spec["world"])
    if world > 1:
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
    starts: list[float] = []
    tokens: list[float] = []
    ends: list[float] = []

    class Timer(Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *a: Any) -> None:
            stats = pl_module.last_step_stats
            tokens.append(next(float(v) for k, v in stats.items() if k.endswith("completion_tokens")))
            ends.append(time.perf_counter())

    cfg, src = loads_train_config(spec["yaml"], spec["overrides"])
    t0 = time.perf_counter()
    run_train(cfg, src, extra_callbacks=[Timer()])
    if rank == 0:
        # between consecutive batch starts (the last step: to its end), after the warm-up steps
        w = int(spec.get("warmup", WARMUP_STEPS))
        steps = [b - a for a, b in itertools.pairwise([*starts[w:], ends[-1]])]
        out = {"step_s": steps, "tokens": tokens[w:], "total_s": time.perf_counter() - t0}
        Path(spec["out"]).write_text(json.dumps(out))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed_run(tmp: Path, model: str | None, scale: dict[str, Any], world: int, steps: int, tag: str) -> dict[str, Any]:
    from composer_plugins.procs import Children

    out = tmp / f"{tag}.json"
    overrides = [
        f"output_dir={tmp / tag}",
        f"rollout.prompts_per_step={scale['prompts'] * world}",
        f"rollout.num_generations={scale['generations']}",
        f"rollout.max_new_tokens={scale['new_tokens']}",
        f"trainer.max_steps={steps + WARMUP_STEPS}",
        f"trainer.devices={world}",
        "trainer.dist_timeout_s=300",
    ]
    if world > 1:
        overrides.append("trainer.strategy=ddp")
    spec = {"world": world, "port": _free_port(), "yaml": _yaml(model), "overrides": overrides, "out": str(out)}
    spec_path = tmp / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    with Children(f"scaleout-{tag}") as kids:
        for r in range(world):
            argv = [sys.executable, "-m", "benchmarks.bench_scaleout", "--worker", str(spec_path), str(r)]
            kids.start(f"{tag}-rank{r}", argv, log_path=tmp / f"{tag}.rank{r}.log")
        kids.wait(timeout=1500, straggler_s=120)
    res = json.loads(out.read_text())
    step = statistics.median(res["step_s"])
    prompts = scale["prompts"] * world
    return {
        "world": world,
        "step_s": step,
        "prompts_per_s": prompts / step,
        "tokens_per_s": statistics.median(t / s for t, s in zip(res["tokens"], res["step_s"], strict=True)),
        "prompts_per_step": prompts,
    }


def _models(tmp: Path) -> dict[str, str | None]:
    """``{scale: model path}``: the tiny default (SFT warm start, cached) and the CPU proxy (random weights)."""
    from composer_plugins.models.tiny import build_shaped_model
    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.step.components import build_env
    from composer_plugins.training.step.policy import resolve_policy

    cfg, _ = loads_train_config(_yaml(None))
    tiny = resolve_policy(cfg, build_env(cfg))
    proxy = build_shaped_model(tiny, tmp / "model-cpu-proxy", "cpu-proxy")
    return {"tiny": tiny, "cpu-proxy": str(proxy)}


def _rollouts(tmp: Path, model: str, quick: bool) -> dict[str, Any]:
    """Completions/s of the server generator (loopback server) and the in-process ``hf`` generator."""
    import torch

    from composer_plugins.models.tiny import load_policy
    from composer_plugins.testing.loopback_server import RolloutServerProcess
    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.rollout.rewards import task_prompt
    from composer_plugins.training.rollout.rollouts import HFGenerator, ServerGenerator
    from composer_plugins.training.step.components import build_env

    torch.set_num_threads(1)
    cfg, _ = loads_train_config(_yaml(None))
    env = build_env(cfg)
    policy, tok = load_policy(model)
    P, G = (4, 8) if quick else (8, 8)
    kw = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 32, "max_prompt_length": 192}
    rounds = 2 if quick else 4
    hf, srv_times, hf_times = HFGenerator(), [], []
    with RolloutServerProcess(model=model, threads=1) as srv:
        gen = ServerGenerator(srv.base_url, max_concurrency=P, sync_at_start=False)
        prompts = [task_prompt(t) for t in env.sample_tasks(P, "train", seed=0)]
        gen.generate(policy, tok, prompts, G, seed=0, **kw)  # warm-up
        hf.generate(policy, tok, prompts, G, seed=0, **kw)
        for k in range(rounds):
            prompts = [task_prompt(t) for t in env.sample_tasks(P, "train", seed=k + 1)]
            t0 = time.perf_counter()
            gen.generate(policy, tok, prompts, G, seed=k, **kw)
            srv_times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hf.generate(policy, tok, prompts, G, seed=k, **kw)
            hf_times.append(time.perf_counter() - t0)
    n = P * G
    return {
        "completions_per_call": n,
        "server_rollouts_per_s": n / statistics.median(srv_times),
        "inprocess_rollouts_per_s": n / statistics.median(hf_times),
        "ratio": statistics.median(h / s for s, h in zip(srv_times, hf_times, strict=True)),
    }


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns ``{"name", "results", "ratios", "targets"}``."""
    steps = 4 if quick else 8
    rounds = 1 if quick else 3
    results: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        models = _models(tmp)
        for name, scale in SCALES.items():
            one, two, per_round = [], [], []
            for k in range(rounds):
                a = _timed_run(tmp, models[name], scale, 1, steps, f"{name}-w1-r{k}")
                b = _timed_run(tmp, models[name], scale, 2, steps, f"{name}-w2-r{k}")
                one.append(a)
                two.append(b)
                per_round.append(b["prompts_per_s"] / a["prompts_per_s"])
            results[name] = {"per_rank_batch": scale, "one_process": one, "two_processes": two}
            ratios[f"{name}/prompts_per_s_2proc_vs_1proc"] = statistics.median(per_round)
            ratios[f"{name}/tokens_per_s_2proc_vs_1proc"] = statistics.median(
                b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(one, two, strict=True)
            )
            ratios[f"{name}/step_time_2proc_vs_1proc"] = statistics.median(
                b["step_s"] / a["step_s"] for a, b in zip(one, two, strict=True)
            )
        results["rollouts"] = _rollouts(tmp, str(models["tiny"]), quick)
        ratios["rollouts/server_vs_inprocess"] = results["rollouts"]["ratio"]
    return {
        "name": "scaleout",
        "results": results,
        "ratios": ratios,
        "targets": {
            "tiny/prompts_per_s_2proc_vs_1proc": ">= 1.6",
            "cpu-proxy/prompts_per_s_2proc_vs_1proc": ">= 1.6",
        },
        "cpu_count": os.cpu_count(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "RANK"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]))
        return
    print(json.dumps(run(quick=a.quick), indent=2))


if __name__ == "__main__":
    main()
