"""The fair GPU benchmark: the composed RL step against TRL's ``GRPOTrainer``, like for like, phase by phase.

Every row trains one model in one ``fit``/``train()`` (no teardown between its steps): ``--warmup`` steps
(compilation, allocator growth) are run and dropped, then ``--steps`` timed steps (median and spread), then,
for the full composition, one more step under ``torch.profiler`` (its top kernels). Rows, in this order (what
matters most first; each in its own process, written as soon as it ends, so a run stopped from outside keeps
what it measured):

* ``grpo``; ``trl_grpo`` (TRL ``GRPOTrainer``, ``loss_type="grpo"``, ``beta=0``);
* ``full``: grpo + hint_distill (EMA teacher, top-100) + teacher_distill (a causal-LM teacher, K=100) +
  replay_dpo, profiled;
* each channel alone with grpo: ``grpo+hint``, ``grpo+teacher_distill``, ``grpo+replay``.

Both sides use the same model (random weights of the shape, the tiny tokenizer), prompts, batch (prompts ×
generations × new tokens), sampling (temperature 1, top-p 1, no top-k), seeded random rewards in [0, 1), dtype
(fp32 weights, bf16 autocast on CUDA), attention implementation (what ``from_pretrained`` picks, recorded per
row), optimizer (``torch.optim.AdamW``, fused on CUDA) and gradient checkpointing (the project's
``compute.gradient_checkpointing`` on both). Generation differs by design: the project's ``rollout.compile``
(``--compile``, default ``auto``: a static cache and a compiled decode step on CUDA); TRL's eager dynamic cache.

Per row and step: wall seconds, completion tokens, and a phase split (seconds and, on CUDA, the peak
``max_memory_allocated`` of each phase; the peak statistic is reset at every phase boundary, so a phase's
peak is its own): ``generation``, ``experience`` (rewards, no-grad log-probs, hinted contexts), ``forward``
(the policy's with-grad forward and the loss), ``teacher`` (the hint teacher's forward, the wait for
teacher_distill scores), ``replay`` (the preference pairs' forward), ``backward`` (one backward of the composed
loss), ``optimizer`` (clipping and the AdamW step), ``ema`` (the EMA teacher update), ``other`` (the rest:
the trainer's loop). Phases are exclusive: a phase nested in another is not counted twice. The phases are
found by wrapping the step's public parts (the generator, the experience maker, the step computer, the input
builders, the optimizer step; TRL's generation, loss and backward) for this benchmark only: off, they cost
nothing.

Run: ``python -m benchmarks.bench_gpu [--shape gpu-0.5b|cpu-tiny] [--rows grpo,trl_grpo,...] [--steps 5]
[--warmup 1] [--new-tokens N] [--compile auto|on|off] [--budget-s S] [--json out.json] [--report-dir DIR]``.
``--report-dir DIR`` rewrites ``DIR/gpu.json`` and ``DIR/gpu.md`` after each row (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
ROWS = ("grpo", "trl_grpo", "full", "grpo+hint", "grpo+teacher_distill", "grpo+replay")
#: Each row's channels (besides grpo).
CHANNELS = {
    "grpo": (),
    "full": ("hint", "teacher_distill", "replay"),
    "grpo+hint": ("hint",),
    "grpo+teacher_distill": ("teacher_distill",),
    "grpo+replay": ("replay",),
    "trl_grpo": (),
}
PHASES = ("generation", "experience", "forward", "teacher", "replay", "backward", "optimizer", "ema", "other")
#: ``--shape``: model, batch and device. ``cpu-tiny`` is the dry run (the embedded tiny model, seconds).
SHAPES = {
    "gpu-0.5b": {"model": "qwen2.5-0.5b", "prompts": 8, "generations": 8, "new_tokens": 128, "device": "cuda"},
    "cpu-tiny": {"model": "tiny", "prompts": 2, "generations": 2, "new_tokens": 8, "device": "cpu"},
}
#: Shapes whose rows run in the benchmark's own process (the CPU dry run: no per-row imports; no CUDA peaks).
IN_PROCESS = ("cpu-tiny",)
#: What the profile table keeps.
PROFILE_ROWS = 15


class PhaseTimer:
    """Exclusive seconds and (CUDA) peak memory of named phases inside each step.

    ``enter``/``exit`` (or :meth:`wrap`) bracket a phase; the time and peak between two boundaries go to the
    innermost open phase (``other`` when none). ``begin_step``/``end_step`` bracket a step; ``record=False``
    steps (warm-up, the profiled one) are not kept.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.steps: list[dict[str, Any]] = []
        self.stack: list[str] = []
        self.step: dict[str, Any] | None = None
        self.t = 0.0
        self.seen: set[str] = set()

    def _now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def _mark(self) -> None:
        t = self._now()
        if self.step is not None and self.stack:
            name = self.stack[-1]
            self.step["phases_s"][name] = self.step["phases_s"].get(name, 0.0) + t - self.t
            if self.cuda:
                import torch

                peak = torch.cuda.max_memory_allocated() / 2**30
                self.step["peak_gib"][name] = max(self.step["peak_gib"].get(name, 0.0), peak)
                torch.cuda.reset_peak_memory_stats()
        self.t = self._now() if self.cuda else t

    def enter(self, name: str) -> None:
        self._mark()
        self.stack.append(name)
        self.seen.add(name)

    def exit(self, name: str) -> None:
        self._mark()
        top = self.stack.pop()
        assert top == name, f"phase {name!r} closed while {top!r} was open"

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        """``obj.attr`` (a callable) runs as phase ``name`` (an instance attribute: nothing else changes)."""
        inner = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            self.enter(name)
            try:
                return inner(*a, **k)
            finally:
                self.exit(name)

        setattr(obj, attr, timed)

    def begin_step(self, record: bool = True) -> None:
        self._mark()
        self.stack = ["other"]
        self.step = {"phases_s": {}, "peak_gib": {}, "t0": self._now(), "record": record}
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        self.t = self.step["t0"]

    def end_step(self, tokens: float) -> None:
        self._mark()
        step, self.step, self.stack = self.step, None, []
        if step is None or not step.pop("record"):
            return
        step["wall_s"] = self.t - step.pop("t0")
        step["tokens"] = float(tokens)
        self.steps.append(step)


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max step seconds, tokens/s, and each phase's median seconds and largest peak."""
    walls = [s["wall_s"] for s in steps]
    toks = [s["tokens"] for s in steps]
    phases = {}
    for name in PHASES:
        secs = [s["phases_s"].get(name, 0.0) for s in steps]
        peaks = [s["peak_gib"][name] for s in steps if name in s["peak_gib"]]
        phases[name] = {"s_median": statistics.median(secs), "peak_gib": max(peaks) if peaks else None}
    peaks = [p for s in steps for p in s["peak_gib"].values()]
    return {
        "steps": len(steps),
        "step_s_median": statistics.median(walls),
        "step_s_min": min(walls),
        "step_s_max": max(walls),
        "tokens_per_step": statistics.median(toks),
        "tokens_per_s": sum(toks) / sum(walls),
        "peak_cuda_gib": max(peaks) if peaks else None,
        "phases": phases,
        "per_step": steps,
    }


def profile_table(prof: Any, cuda: bool) -> dict[str, Any]:
    """The top kernels (CUDA: by self device time; CPU: by self CPU time) of one profiled step."""
    events = prof.key_averages()

    def self_time(e: Any) -> float:
        if cuda:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))
        return float(e.self_cpu_time_total)

    top = sorted(events, key=self_time, reverse=True)[:PROFILE_ROWS]
    total = sum(self_time(e) for e in events) or 1.0
    return {
        "by": "self CUDA time" if cuda else "self CPU time",
        "rows": [
            {"name": e.key[:120], "calls": int(e.count), "self_ms": self_time(e) / 1e3, "share": self_time(e) / total}
            for e in top
        ],
    }


# -- one row, in its own process ---------------------------------------------------------------------------
def _config(tmp: str, spec: dict[str, Any], model: str, pairs: str, row: str, compile: str) -> Any:
    from composer_plugins.training.config.train import loads_train_config

    gpu = spec["device"] == "cuda"
    ch = CHANNELS[row]
    hint = json.dumps({"weight": 0.5, "enabled": "hint" in ch, "teacher": "ema", "topk": 100})
    teacher = {"kind": "causal_lm", "id": "base", "model_path": model, "topk": 100, "device": spec["device"]}
    teacher.update(dtype="bfloat16" if gpu else "float32", batch_size=16)
    td = json.dumps({"weight": 0.5, "enabled": "teacher_distill" in ch, "teachers": [teacher]})
    optim = "{args: {fused: true}}" if gpu else "{}"
    text = f"""
output_dir: {tmp}/run
cache_dir: {os.environ.get("COMPOSER_CACHE_DIR", ".composer_cache")}
model: {{name_or_path: {model}, dtype: float32}}
sft: {{enabled: false}}
losses:
  grpo: {{weight: 1.0}}
  hint_distill: {hint}
  teacher_distill: {td}
  replay: {{name: replay_dpo, weight: 0.1, enabled: {str("replay" in ch).lower()}}}
hints: {{provider: {{name: template, reveal_answer: true}}}}
replay: {{pairs_path: {pairs}, pairs_per_step: 4}}
optim: {optim}
rollout: {{prompts_per_step: {spec["prompts"]}, num_generations: {spec["generations"]},
          max_new_tokens: {spec["new_tokens"]}, temperature: 1.0, top_p: 1.0, top_k: 0,
          success_threshold: 1.0, compile: {compile}}}
trainer: {{max_steps: 1000, checkpoint_every_n_steps: 0, enable_progress_bar: false,
          accelerator: {"gpu" if gpu else "cpu"}, precision: {"bf16-mixed" if gpu else "32-true"}}}
eval: {{at_start: false, at_end: false}}
"""
    cfg, _ = loads_train_config(text)
    return cfg


def _wrap_builders(timer: PhaseTimer) -> Any:
    """The input builders of the teacher and replay channels (and the policy's own) run as phases; returns the
    original table getter (put back after the row)."""
    from composer_plugins.training.step import assemble

    phase = {
        "policy_logprobs": "forward",
        "policy_hidden_states": "forward",
        "hint_inputs": "teacher",
        "hint_teacher_logprobs": "teacher",
        "teacher_scores": "teacher",
        "pair_inputs": "replay",
    }
    table = assemble.input_builders()
    wrapped: dict[int, Any] = {}
    for name, fn in list(table.items()):
        label = phase.get(getattr(fn, "__name__", ""))
        if label is None:
            continue
        if id(fn) not in wrapped:  # one builder registered under several names stays one object
            holder = type("H", (), {"f": staticmethod(fn)})()
            timer.wrap(holder, "f", label)
            wrapped[id(fn)] = holder.f
        table[name] = wrapped[id(fn)]
    original = assemble.input_builders
    assemble.input_builders = lambda registry=None: table  # type: ignore[assignment]
    return original


def _composer_row(row: str, spec: dict[str, Any], cfg: Any, env: Any, n: int, warmup: int, profile: bool) -> Any:
    import torch
    from lightning.pytorch.callbacks import Callback

    from benchmarks.bench_scale import RandomRewardEnv
    from benchmarks.bench_training import _tasks, composed_steps
    from composer_plugins.training.lightning.module import ComposerModule

    cuda = spec["device"] == "cuda"
    timer = PhaseTimer(cuda)
    total = warmup + n + (1 if profile else 0)
    module = ComposerModule(cfg, env=RandomRewardEnv(env, seed=0))
    timer.wrap(module.generator, "generate", "generation")
    timer.wrap(module.experience, "make", "experience")
    timer.wrap(module.stepper, "loss", "forward")
    timer.wrap(module, "optimizer_step", "optimizer")
    timer.wrap(module, "update_ema_teacher", "ema")
    original = _wrap_builders(timer)
    prof_out: dict[str, Any] = {}

    class Phases(Callback):
        i = 0
        prof: Any = None

        def on_train_batch_start(self, *a: Any) -> None:
            if profile and self.i == total - 1:
                acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.__enter__()
            timer.begin_step(record=warmup <= self.i < warmup + n)

        def on_before_backward(self, *a: Any) -> None:
            timer.enter("backward")

        def on_after_backward(self, *a: Any) -> None:
            timer.exit("backward")

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *a: Any) -> None:
            timer.end_step(pl_module.last_step_stats["completion_tokens"])
            if self.prof is not None:
                if cuda:
                    torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                prof_out.update(profile_table(self.prof, cuda))
                self.prof = None
            self.i += 1

    from composer_plugins.training.step import assemble

    try:
        composed_steps(module, cfg, _tasks(env, cfg, total), 0, callbacks=[Phases()])
    finally:
        assemble.input_builders = original
    attn = module.policy.config._attn_implementation
    return timer, prof_out, attn


def _trl_row(spec: dict[str, Any], cfg: Any, env: Any, model: str, n: int, warmup: int) -> Any:
    from transformers import TrainerCallback

    from benchmarks.bench_scale import RandomRewardEnv, _trl_reward
    from benchmarks.bench_training import _tasks, trl_steps

    cuda = spec["device"] == "cuda"
    timer = PhaseTimer(cuda)
    renv = RandomRewardEnv(env, seed=0)
    renv.reward_fn = lambda: _trl_reward(renv.rng)  # type: ignore[attr-defined]
    attn: dict[str, str] = {}

    class Phases(TrainerCallback):
        i = 0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            timer.begin_step(record=warmup <= self.i < warmup + n)

        def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
            timer.enter("optimizer")

        def on_optimizer_step(self, *a: Any, **k: Any) -> None:
            timer.exit("optimizer")

        def on_step_end(self, *a: Any, **k: Any) -> None:
            timer.end_step(0.0)  # tokens: from TRL's log below
            self.i += 1

    def setup(trainer: Any) -> None:
        timer.wrap(trainer, "_generate_single_turn", "generation")
        timer.wrap(trainer, "_generate_and_score_completions", "experience")
        timer.wrap(trainer, "compute_loss", "forward")
        timer.wrap(trainer.accelerator, "backward", "backward")
        trainer.add_callback(Phases())
        attn["impl"] = trainer.model.config._attn_implementation

    args = {
        "optim": "adamw_torch_fused" if cuda else "adamw_torch",
        "gradient_checkpointing": bool(cfg.compute.gradient_checkpointing),
        "model_init_kwargs": {"dtype": "float32"},
    }
    res = trl_steps(model, renv, cfg, _tasks(env, cfg, warmup + n), device=spec["device"], args=args, setup=setup)
    if isinstance(res, str):
        raise RuntimeError(res)
    for step, r in zip(timer.steps, res[warmup:], strict=False):
        step["tokens"] = r.get("tokens", 0.0)
    return timer, {}, attn.get("impl")


def child(row: str, spec: dict[str, Any], model: str, pairs: str, n: int, warmup: int, compile: str) -> dict[str, Any]:
    """One row in this process."""
    import torch

    from composer_plugins.training.step.components import build_env

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(tmp, spec, model, pairs, "grpo" if row == "trl_grpo" else row, compile)
        env = build_env(cfg)
        if row == "trl_grpo":
            timer, prof, attn = _trl_row(spec, cfg, env, model, n, warmup)
        else:
            timer, prof, attn = _composer_row(row, spec, cfg, env, n, warmup, profile=row == "full")
    out = summarize(timer.steps)
    out["settings"] = {
        "attn_implementation": attn,
        "optimizer": "AdamW fused" if spec["device"] == "cuda" else "AdamW",
        "dtype": "fp32 weights, bf16 autocast" if spec["device"] == "cuda" else "fp32",
        "gradient_checkpointing": bool(cfg.compute.gradient_checkpointing),
        "generation": "HF generate, eager dynamic cache"
        if row == "trl_grpo"
        else f"HF generate, rollout.compile={compile}",
        "batch": f"{spec['prompts']} prompts x {spec['generations']} x {spec['new_tokens']} new tokens",
    }
    out["phases_seen"] = sorted(timer.seen)
    if prof:
        out["profile"] = prof
    return out


# -- the parent: prepare once, one process per row ---------------------------------------------------------
def _prepare(tmp: Path, spec: dict[str, Any]) -> tuple[str, str]:
    from benchmarks.bench_scale import _prepare as prepare_shaped

    if spec["model"] != "tiny":
        model, pairs, _ = prepare_shaped(tmp, spec["model"])
        return model, pairs
    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.step.components import build_env
    from composer_plugins.training.step.policy import resolve_policy

    cache = os.environ.get("COMPOSER_CACHE_DIR", ".composer_cache")
    cfg, _ = loads_train_config(f"cache_dir: {cache}\nsft: {{enabled: false}}")  # the tiny base, untrained
    return str(resolve_policy(cfg, build_env(cfg))), _pairs(tmp)


def _pairs(tmp: Path) -> str:
    from composer_plugins.core.io import atomic_write_jsonl
    from composer_plugins.training.config.train import loads_train_config
    from composer_plugins.training.step.components import build_env

    cfg, _ = loads_train_config("sft: {enabled: false}")
    tasks = build_env(cfg).sample_tasks(8, "train", seed=3)
    rows = [{"prompt": t["prompt"], "chosen": t["target"], "rejected": t["target"] + " 1"} for t in tasks]
    atomic_write_jsonl(tmp / "pairs.jsonl", rows)
    return str(tmp / "pairs.jsonl")


def _spawn(row: str, shape: str, model: str, pairs: str, a: Any, timeout: float) -> dict[str, Any]:
    if shape in IN_PROCESS:
        spec = {**SHAPES[shape], **({"new_tokens": a.new_tokens} if a.new_tokens else {})}
        t0 = time.perf_counter()
        try:
            res = child(row, spec, model, pairs, a.steps, a.warmup, a.compile)
        except Exception as e:  # the row's error is its result; the other rows still run
            return {"error": f"{type(e).__name__}: {e}"}
        res["process_s"] = round(time.perf_counter() - t0, 1)
        return res
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "r.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "benchmarks.bench_gpu", "--child", row, "--shape", shape, "--model", model]
        cmd += ["--pairs", pairs, "--steps", str(a.steps), "--warmup", str(a.warmup), "--compile", a.compile]
        cmd += ["--json", str(out)]
        if a.new_tokens:
            cmd += ["--new-tokens", str(a.new_tokens)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out.exists():
            return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
        res = json.loads(out.read_text())
        res["process_s"] = round(time.perf_counter() - t0, 1)
        return res


def _write(path: Path | None, report_dir: Path | None, res: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(res, indent=2))
    if report_dir is not None:
        sys.path.insert(0, str(REPO_ROOT / "scripts"))
        import gpu_check

        gpu_check.cmd_report(report_dir)


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """Each project row's tokens/s and peak memory relative to TRL's."""
    trl = results.get("trl_grpo", {})
    out = {}
    for row, r in results.items():
        if row == "trl_grpo" or "tokens_per_s" not in r or "tokens_per_s" not in trl:
            continue
        out[f"{row}_speed_vs_trl"] = r["tokens_per_s"] / trl["tokens_per_s"]
        if r.get("peak_cuda_gib") and trl.get("peak_cuda_gib"):
            out[f"{row}_mem_vs_trl"] = r["peak_cuda_gib"] / trl["peak_cuda_gib"]
    return out


#: What the rows should reach on the GPU (steady state, against TRL's GRPOTrainer).
TARGETS = {
    "grpo_speed_vs_trl": ">= 1.0 (completion tokens/s vs TRL, steady state)",
    "full_speed_vs_trl": ">= 1.0",
    "full_mem_vs_trl": "<= 1.5 (peak CUDA memory vs TRL)",
}


def run(quick: bool = False) -> dict[str, Any]:
    """``run_all``'s entry: every row at the GPU shape where CUDA is, else the CPU dry run's tiny shape."""
    import torch

    shape = "gpu-0.5b" if torch.cuda.is_available() else "cpu-tiny"
    return run_rows(_parser().parse_args(["--shape", shape, "--steps", "5" if quick else "10"]))


def run_rows(a: Any) -> dict[str, Any]:
    """Every row of ``a.rows`` within ``a.budget_s`` seconds; the results so far written after each."""
    t0 = time.perf_counter()
    spec = dict(SHAPES[a.shape])
    if a.new_tokens:
        spec["new_tokens"] = a.new_tokens
    res: dict[str, Any] = {"name": "fair", "shape": a.shape, "spec": spec, "steps": a.steps, "warmup": a.warmup}
    res.update(compile=a.compile, rows=list(a.rows), results={}, ratios={}, targets=TARGETS, partial=True)
    path = Path(a.json) if a.json else None
    report = Path(a.report_dir) if a.report_dir else None
    if report is not None and path is None:
        path = report / "gpu.d" / "fair.json"  # where the report reads it
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        model, pairs = _prepare(Path(td), spec)
        for row in a.rows:
            left = a.budget_s - (time.perf_counter() - t0)
            if left < a.min_row_s:
                res["results"][row] = {"error": f"not run: {left:.0f} s of the {a.budget_s:.0f} s budget left"}
            else:
                res["results"][row] = _spawn(row, a.shape, model, pairs, a, min(a.row_timeout, left))
            res["ratios"] = ratios(res["results"])
            _write(path, report, res)
    res["partial"] = False
    res["seconds"] = round(time.perf_counter() - t0, 1)
    _write(path, report, res)
    return res


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="gpu-0.5b", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=5, help="timed steps per row (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--new-tokens", type=int, default=0, help="new tokens per completion (default: the shape's)")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="the project's rollout.compile")
    p.add_argument("--budget-s", type=float, default=3600, help="seconds for every row together")
    p.add_argument("--row-timeout", type=float, default=600, help="seconds one row's process may take")
    p.add_argument("--min-row-s", type=float, default=20, help="a row is not started with less budget left")
    p.add_argument(
        "--json",
        default=None,
        help="write the results here after each row (default with --report-dir: DIR/gpu.d/fair.json)",
    )
    p.add_argument("--report-dir", default=None, help="rewrite DIR/gpu.json and DIR/gpu.md after each row")
    p.add_argument("--child", default=None, choices=ROWS, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pairs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rows", default=",".join(ROWS), type=_rows, help=f"comma-separated subset of {', '.join(ROWS)}")
    return p


def _rows(text: str) -> tuple[str, ...]:
    rows = tuple(r.strip() for r in text.split(",") if r.strip())
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown rows {bad}; available: {', '.join(ROWS)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.child:
        spec = dict(SHAPES[a.shape])
        if a.new_tokens:
            spec["new_tokens"] = a.new_tokens
        out = child(a.child, spec, a.model, a.pairs, a.steps, a.warmup, a.compile)
        Path(a.json).write_text(json.dumps(out))
        return 0
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    res = run_rows(a)
    for row, r in res["results"].items():
        if "error" in r:
            print(f"{row:<22} error: {r['error'][:300]}")
        else:
            print(f"{row:<22} {r['step_s_median']:.3f} s/step  {r['tokens_per_s']:.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
