"""Peak memory and time of the chunked vs the materialised loss paths (not a timed test).

Two workloads, each forward + backward at one shape (default: Qwen2.5-0.5B-like head,
V=151,936, H=896, T=2,048, batch 1; ``--quick``: V=32,000, H=256, T=512):

* ``logprobs``: per-token log-probs of the sampled tokens from the final hidden states, then a
  policy-gradient-like weighted sum — ``selective_log_softmax(h @ W.T, ids)`` (materialised, TRL's
  way) vs :func:`~composer_plugins.losses.functional.chunked_logprobs`;
* ``hint_distill``: the ``hint_distill`` channel (generalised JSD, beta=0.5) on every token, fed
  student/teacher logits (materialised) vs student/teacher hidden states + the LM head (chunked,
  with the channel's default ``grad_mode="precompute"``, and with ``"recompute"``).

How memory is measured, honestly:

* CUDA: ``torch.cuda.max_memory_allocated()`` minus the allocation before the step.
* CPU: each variant runs in a **fresh subprocess**. After the timed runs, glibc's mmap threshold is
  fixed at 1 MiB (``mallopt``) and its cached heap trimmed, so every tensor buffer is mmap-ed and
  returned to the OS when freed and the resident set tracks live memory (timing runs keep the
  default allocator). Inputs are created in place (no temporaries). Right before the measured
  step the kernel's peak-RSS counter is reset (``echo 5 > /proc/self/clear_refs``) and the
  resident set read from ``/proc/self/statm``; after it the peak is ``VmHWM`` from
  ``/proc/self/status``. Peak extra memory = VmHWM − RSS before (fallback where the reset is not
  allowed: ``ru_maxrss`` of the fresh process). This counts every allocation torch makes, without
  instrumenting torch. ``excl grads`` subtracts the gradient buffers both paths must produce
  (``dL/dW`` — V×H, 519 MiB at the full shape — and ``dL/dhidden``), leaving the loss's working memory.

Time: on CPU the process CPU time of the step with one torch thread (default ``--threads 1``),
robust to other processes sharing the machine; the wall time is reported too. On CUDA, wall time
after synchronisation. Best of ``repeats`` runs after one warm-up run; memory is measured on a
separate, final run. The chunked and
materialised results of each workload are checked to agree (loss and gradient norms).

Optional variants (``--variants``, not in the default set): ``hint_distill_liger`` (the same channel with
``kernels: liger``, Liger-Kernel's fused linear JSD, ``torch.compile``-d on CUDA) and
``hint_distill_chunked_topk100`` (``topk: 100``); with them the ratios ``hint_distill_vs_liger_*`` (ours /
Liger's) and ``hint_distill_topk100_*`` (top-100 / full vocabulary). The chunked variants pin
``kernels: torch`` (the channel's ``auto`` would pick Liger on CUDA).

Run: ``python -m benchmarks.bench_losses [--quick] [--threads N] [--chunk-size C] [--variants a,b] [--json] [--out F]``.

``--teacher`` measures the ``teacher_distill`` channel instead (on-policy distillation from N teachers'
top-k log-probs), at the real vocabulary V=151,936 (H=896, T=2,048; ``--teacher-tokens``):
K = 20 and 100, one and three teachers, against a full-vocabulary implementation in the same run
(the teachers' full log-prob rows ``N × T × V``, the student's materialised logits, reverse KL to the
weighted mixture ``log Σ_n w_n q_n`` under autograd). Reported per variant: the teacher-side bytes per
token (the inputs the teachers hand the loss) against one fp32 vocabulary row (target <= 1/100), and
the step's peak against one fp32 ``T × V`` logits tensor (target <= 0.6), all memory and excluding the
gradient buffers every path returns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

FULL = {"B": 1, "T": 2048, "H": 896, "V": 151_936}
QUICK = {"B": 1, "T": 512, "H": 256, "V": 32_000}
VARIANTS = (
    "logprobs_materialised",
    "logprobs_chunked",
    "hint_distill_materialised",
    "hint_distill_chunked",
    "hint_distill_chunked_recompute",
)
#: Measured only when asked for (``--variants``): Liger's fused linear JSD, the top-100 divergence, and the fused
#: log-probs (one chunk per row at these B = 1 shapes).
EXTRA_VARIANTS = ("hint_distill_liger", "hint_distill_chunked_topk100", "logprobs_fused")
#: (ratio prefix, chunked variant, materialised baseline)
COMPARISONS = (
    ("logprobs", "logprobs_chunked", "logprobs_materialised"),
    ("hint_distill", "hint_distill_chunked", "hint_distill_materialised"),
    ("hint_distill_recompute", "hint_distill_chunked_recompute", "hint_distill_materialised"),
)
#: (ratio prefix, variant, baseline, same quantity?) for the optional variants
EXTRA_COMPARISONS = (
    ("hint_distill_vs_liger", "hint_distill_chunked", "hint_distill_liger", True),
    ("hint_distill_topk100", "hint_distill_chunked_topk100", "hint_distill_chunked", False),
    ("logprobs_fused", "logprobs_fused", "logprobs_materialised", True),
)
TARGETS = {
    **{f"{p}_peak_mem_ratio": "<= 0.125 (chunked / materialised, all memory)" for p, _, _ in COMPARISONS},
    **{
        f"{p}_peak_mem_ratio_excl_grads": "<= 0.125 (chunked / materialised, minus the gradient buffers both produce)"
        for p, _, _ in COMPARISONS
    },
    **{f"{p}_time_ratio": "<= 1.0 (chunked / materialised)" for p, _, _ in COMPARISONS},
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _hwm_bytes() -> int | None:
    """Peak resident set size since the last :func:`_reset_hwm` (``VmHWM``), or None if unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _exact_cpu_allocator() -> None:
    """Make the resident set track live memory: a fixed 1 MiB glibc mmap threshold (every tensor
    buffer is mmap-ed and unmapped when freed) and no cached heap (``malloc_trim``)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixing it disables the dynamic threshold)
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: keep the default allocator
        pass


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter to the current RSS (Linux >= 4.0: ``echo 5 > clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(variant: str, shape: dict[str, int], chunk: int, threads: int, repeats: int) -> dict[str, Any]:
    """Run one variant in this (fresh) process and return its measurements."""
    import torch

    from composer_plugins.losses import functional as LF
    from composer_plugins.losses.distill import HintDistillChannel

    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    b, t, h, v = shape["B"], shape["T"], shape["H"], shape["V"]
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*size: int, std: float) -> torch.Tensor:
        x = torch.empty(*size, device=dev)
        x.normal_(0.0, std, generator=gen)  # in place: no temporary copies
        return x

    weight = randn(v, h, std=0.05).requires_grad_(True)
    hidden = randn(b, t, h, std=1.0).requires_grad_(True)
    teacher_hidden = randn(b, t, h, std=1.0)
    teacher_hidden.mul_(0.5).add_(hidden.detach(), alpha=0.8)  # a teacher close to the student
    ids = torch.randint(0, v, (b, t), device=dev, generator=gen)
    adv = randn(b, t, std=1.0)
    hint_mask = torch.ones(b, t, dtype=torch.bool, device=dev)
    grad_mode = "recompute" if variant.endswith("_recompute") else "precompute"  # the channel's default
    channel = HintDistillChannel(
        criterion="jsd",
        beta=0.5,
        chunk_size=chunk,
        grad_mode=grad_mode,
        kernels="liger" if variant == "hint_distill_liger" else "torch",
        topk=100 if variant.endswith("_topk100") else None,
    )

    def step() -> float:
        weight.grad = None
        hidden.grad = None
        if variant == "logprobs_materialised":
            logits = hidden @ weight.T
            loss = -(LF.selective_log_softmax(logits, ids) * adv).sum() / t
            del logits
        elif variant == "logprobs_chunked":
            lp = LF.chunked_logprobs(hidden, weight, ids, chunk_size=chunk)
            assert isinstance(lp, torch.Tensor)
            loss = -(lp * adv).sum() / t
        elif variant == "logprobs_fused":  # the training step's path for row-separable losses (whole rows a chunk)
            mask = torch.ones_like(ids, dtype=torch.bool)
            lp = LF.fused_logprobs(hidden, weight, ids, mask, lambda x: -(x * adv).sum() / t, chunk_size=chunk)
            loss = -(lp * adv).sum() / t
        elif variant == "hint_distill_materialised":
            with torch.no_grad():
                t_logits = teacher_hidden @ weight.T
            s_logits = hidden @ weight.T
            loss, _ = channel({"student_logits": s_logits, "teacher_logits": t_logits, "hint_mask": hint_mask})
            del s_logits, t_logits
        elif variant.startswith("hint_distill_chunked") or variant == "hint_distill_liger":
            outs = {"student_hidden": hidden, "teacher_hidden": teacher_hidden, "lm_head_weight": weight}
            loss, _ = channel({**outs, "hint_mask": hint_mask})
        else:
            raise ValueError(variant)
        loss.backward()
        return float(loss.detach())

    step()  # warm-up (lazy library initialisation is not what we measure); not timed, not measured
    # 1) time, with the allocator as users run it
    walls: list[float] = []
    cpus: list[float] = []
    loss_value = float("nan")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        loss_value = step()
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    # 2) peak memory of one more step
    weight.grad = None
    hidden.grad = None
    if cuda:
        method = "cuda.max_memory_allocated"
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        high = torch.cuda.max_memory_allocated()
    else:
        method = "VmHWM (reset before the step), mmap threshold 1 MiB"
        _exact_cpu_allocator()
        if not _reset_hwm():
            method = "ru_maxrss (fresh process), mmap threshold 1 MiB"
        before = _rss_bytes()
        step()
        hwm = _hwm_bytes() if method.startswith("VmHWM") else None
        high = hwm if hwm is not None else _maxrss_bytes()
    peak = high - before
    assert weight.grad is not None and hidden.grad is not None
    grad_bytes = weight.grad.numel() * weight.grad.element_size() + hidden.grad.numel() * hidden.grad.element_size()
    return {
        "variant": variant,
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({threads} thread(s))",
        "peak_mib": peak / 2**20,
        "peak_excl_grads_mib": (peak - grad_bytes) / 2**20,
        "memory_method": method,
        # CPU: process CPU time (robust to other processes sharing the cores); CUDA: wall time
        "time_s": min(walls) if cuda else min(cpus),
        "wall_s": min(walls),
        "cpu_s": min(cpus),
        "loss": loss_value,
        "grad_norm_w": float(weight.grad.norm()),
        "grad_norm_h": float(hidden.grad.norm()),
    }


TEACHER_VARIANTS = tuple(
    f"teacher_{kind}_n{n}" if kind == "full" else f"teacher_chunked_k{k}_n{n}"
    for n in (1, 3)
    for kind, k in (("full", 0), ("chunked", 20), ("chunked", 100))
)
TEACHER_TARGETS = {
    "teacher_bytes_per_token_over_vocab_row": "<= 0.01 (teacher-side bytes per token / one fp32 vocabulary row)",
    "peak_over_logits": "<= 0.6 (step peak / one fp32 T x V logits tensor)",
}


def _teacher_worker(variant: str, shape: dict[str, int], chunk: int, threads: int, repeats: int) -> dict[str, Any]:
    """One ``teacher_distill`` variant in this (fresh) process: time and peak memory of forward + backward."""
    import torch

    from composer_plugins.losses.teacher_distill import TeacherDistillChannel, TeacherTopK

    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    b, t, h, v = shape["B"], shape["T"], shape["H"], shape["V"]
    n = int(variant.rsplit("_n", 1)[1])
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*size: int, std: float) -> torch.Tensor:
        x = torch.empty(*size, device=dev)
        x.normal_(0.0, std, generator=gen)
        return x

    weight = randn(v, h, std=0.05).requires_grad_(True)
    hidden = randn(b, t, h, std=1.0).requires_grad_(True)
    mask = torch.ones(b, t, device=dev)
    weights = torch.tensor([1.0, 2.0, 0.5][:n], device=dev)
    full = variant.startswith("teacher_full")
    if full:  # what a full-vocabulary implementation needs from the teachers: N log-prob rows per token
        rows = randn(n, b, t, v, std=2.0)
        for i in range(n):  # each teacher's log-probs, plus its log mixture weight (set up once, not measured)
            rows[i] = torch.log_softmax(rows[i], -1) + float((weights[i] / weights.sum()).log())
        teacher_bytes = rows.numel() * rows.element_size()
    else:
        k = int(variant.split("_k")[1].split("_")[0])
        base = torch.randint(0, v, (b, n, t, 1), device=dev, generator=gen)
        ids = (base + torch.arange(k, device=dev) * 7919) % v  # k distinct ids per token and teacher
        lps = torch.log_softmax(randn(b, n, t, k, std=1.0), -1) + torch.log(torch.tensor(0.9))
        scores = TeacherTopK(ids, lps, torch.ones(b, n, t, dtype=torch.bool, device=dev), tuple("abc"[:n]))
        teacher_bytes = scores.nbytes
        channel = TeacherDistillChannel(weights=dict(zip("abc", [1.0, 2.0, 0.5], strict=False)), chunk_size=chunk)

    def step() -> float:
        weight.grad = None
        hidden.grad = None
        if full:
            s = torch.log_softmax(hidden @ weight.T, -1)
            logq = rows[0].clone()
            for i in range(1, n):  # the mixture log Σ w_n q_n, one T × V buffer at a time
                torch.logaddexp(logq, rows[i], out=logq)
            loss = (s.exp() * (s - logq)).sum(-1).mul(mask).sum() / mask.sum()
            del s, logq
        else:
            loss, _ = channel(
                {"hidden_states": hidden, "lm_head_weight": weight, "teacher_scores": scores, "completion_mask": mask}
            )
        loss.backward()
        return float(loss.detach())

    step()
    walls: list[float] = []
    cpus: list[float] = []
    loss_value = float("nan")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        loss_value = step()
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    weight.grad = None
    hidden.grad = None
    if cuda:
        method = "cuda.max_memory_allocated"
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        high = torch.cuda.max_memory_allocated()
    else:
        method = "VmHWM (reset before the step), mmap threshold 1 MiB"
        _exact_cpu_allocator()
        if not _reset_hwm():
            method = "ru_maxrss (fresh process), mmap threshold 1 MiB"
        before = _rss_bytes()
        step()
        hwm = _hwm_bytes() if method.startswith("VmHWM") else None
        high = hwm if hwm is not None else _maxrss_bytes()
    peak = high - before
    assert weight.grad is not None and hidden.grad is not None
    grad_bytes = weight.grad.numel() * weight.grad.element_size() + hidden.grad.numel() * hidden.grad.element_size()
    logits_bytes = b * t * v * 4
    return {
        "variant": variant,
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({threads} thread(s))",
        "peak_mib": peak / 2**20,
        "peak_excl_grads_mib": (peak - grad_bytes) / 2**20,
        "peak_over_logits": peak / logits_bytes,
        "peak_excl_grads_over_logits": (peak - grad_bytes) / logits_bytes,
        "teacher_bytes_per_token": teacher_bytes / (b * t),
        "teacher_bytes_per_token_over_vocab_row": teacher_bytes / (b * t) / (v * 4),
        "memory_method": method,
        "time_s": min(walls) if cuda else min(cpus),
        "wall_s": min(walls),
        "loss": loss_value,
    }


def run_teacher(
    threads: int | None = None,
    chunk_size: int | None = None,
    repeats: int | None = None,
    tokens: int = 2048,
    quick: bool = False,
) -> dict[str, Any]:
    """The ``teacher_distill`` workloads (each variant in a fresh process): results and time ratios to the full path."""
    shape = dict(QUICK if quick else FULL)
    shape["T"] = tokens if not quick else min(tokens, QUICK["T"])
    threads, repeats = threads or 1, repeats or 1
    chunk = chunk_size or 64
    results = {}
    order = sorted(TEACHER_VARIANTS, key=lambda v: "full" in v)  # the cheap chunked variants first
    for v in order:
        results[v] = _run_variant(v, shape, chunk, threads, repeats)
        print(json.dumps(results[v]), file=sys.stderr, flush=True)  # each variant as it finishes
    results = {v: results[v] for v in TEACHER_VARIANTS}
    ratios = {}
    for name, r in results.items():
        if "chunked" in name:
            base = results[f"teacher_full_n{name.rsplit('_n', 1)[1]}"]
            ratios[f"{name}_time_ratio"] = r["time_s"] / max(base["time_s"], 1e-12)
            ratios[f"{name}_peak_ratio_vs_full"] = r["peak_mib"] / max(base["peak_mib"], 1e-9)
    return {
        "name": "losses_teacher",
        "shape": shape,
        "chunk_size": chunk,
        "results": results,
        "ratios": ratios,
        "targets": TEACHER_TARGETS,
    }


def _print_teacher(report: dict[str, Any]) -> None:
    s = report["shape"]
    print(f"bench_losses --teacher  B={s['B']} T={s['T']} H={s['H']} V={s['V']}  chunk={report['chunk_size']}")
    head = f"{'variant':<28}{'peak MiB':>10}{'excl grads':>12}{'peak/logits':>12}{'excl/logits':>12}"
    print(head + f"{'teacher B/tok':>14}{'/vocab row':>11}{'time s':>9}")
    for name, r in report["results"].items():
        print(
            f"{name:<28}{r['peak_mib']:>10.1f}{r['peak_excl_grads_mib']:>12.1f}{r['peak_over_logits']:>12.3f}"
            f"{r['peak_excl_grads_over_logits']:>12.3f}{r['teacher_bytes_per_token']:>14.0f}"
            f"{r['teacher_bytes_per_token_over_vocab_row']:>11.4f}{r['time_s']:>9.2f}"
        )
    for k, v in report["ratios"].items():
        print(f"{k:<46}{v:>7.3f}")
    for k, v in report["targets"].items():
        print(f"target {k}: {v}")


def _run_variant(variant: str, shape: dict[str, int], chunk: int, threads: int, repeats: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        variant,
        "--shape",
        json.dumps(shape),
        "--chunk-size",
        str(chunk),
        "--threads",
        str(threads),
        "--repeats",
        str(repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark worker {variant} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(
    quick: bool = False,
    threads: int | None = None,
    chunk_size: int | None = None,
    repeats: int | None = None,
    variants: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    """Measure ``variants`` (each in a fresh process) and return results, ratios and targets."""
    shape = dict(QUICK if quick else FULL)
    threads = threads or 1
    chunk = chunk_size or (64 if quick else 256)  # the same number of chunks (8) at both shapes
    repeats = repeats or (3 if quick else 1)
    try:
        from tqdm import tqdm

        todo = tqdm(variants, desc="bench_losses", leave=False)
    except ImportError:  # pragma: no cover
        todo = variants
    results = {v: _run_variant(v, shape, chunk, threads, repeats) for v in todo}
    ratios: dict[str, float] = {}
    checks: dict[str, bool] = {}
    for w, chunked, base in COMPARISONS:
        if chunked not in results or base not in results:
            continue
        mat, chk = results[base], results[chunked]
        ratios[f"{w}_peak_mem_ratio"] = chk["peak_mib"] / max(mat["peak_mib"], 1e-9)
        ratios[f"{w}_peak_mem_ratio_excl_grads"] = chk["peak_excl_grads_mib"] / max(mat["peak_excl_grads_mib"], 1e-9)
        ratios[f"{w}_time_ratio"] = chk["time_s"] / max(mat["time_s"], 1e-12)
        checks[f"{w}_same_result"] = (
            abs(chk["loss"] - mat["loss"]) <= 1e-4 * max(1.0, abs(mat["loss"]))
            and abs(chk["grad_norm_w"] - mat["grad_norm_w"]) <= 1e-3 * max(1e-6, mat["grad_norm_w"])
            and abs(chk["grad_norm_h"] - mat["grad_norm_h"]) <= 1e-3 * max(1e-6, mat["grad_norm_h"])
        )
    for w, ours, base, same in EXTRA_COMPARISONS:
        if ours not in results or base not in results:
            continue
        a, b = results[ours], results[base]
        ratios[f"{w}_peak_mem_ratio"] = a["peak_mib"] / max(b["peak_mib"], 1e-9)
        ratios[f"{w}_time_ratio"] = a["time_s"] / max(b["time_s"], 1e-12)
        if same:
            checks[f"{w}_same_result"] = abs(a["loss"] - b["loss"]) <= 1e-3 * max(1.0, abs(b["loss"])) and abs(
                a["grad_norm_w"] - b["grad_norm_w"]
            ) <= 1e-2 * max(1e-6, b["grad_norm_w"])
    return {
        "name": "losses",
        "shape": shape,
        "chunk_size": chunk,
        "device": results[variants[0]]["device"],
        "results": results,
        "checks": checks,
        "ratios": ratios,
        "targets": TARGETS,
    }


def _print(report: dict[str, Any]) -> None:
    s = report["shape"]
    print(
        f"bench_losses  B={s['B']} T={s['T']} H={s['H']} V={s['V']}  chunk={report['chunk_size']}  "
        f"device={report['device']}"
    )
    print(f"{'variant':<34}{'peak MiB':>10}{'excl grads':>12}{'time s':>9}{'wall s':>9}{'loss':>12}")
    for name, r in report["results"].items():
        print(
            f"{name:<34}{r['peak_mib']:>10.1f}{r['peak_excl_grads_mib']:>12.1f}{r['time_s']:>9.2f}"
            f"{r['wall_s']:>9.2f}{r['loss']:>12.6f}"
        )
    for k, v in report["ratios"].items():
        print(f"{k:<46}{v:>7.3f}   target {report['targets'].get(k, '-')}")
    for k, v in report["checks"].items():
        print(f"{k:<46}{'ok' if v else 'MISMATCH':>7}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shape (V=32000, H=256, T=512)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per variant (default: 1)")
    p.add_argument("--chunk-size", type=int, default=None, help="token rows per chunk (default 256; quick 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (best is kept)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", default=None, help="also write the report as JSON to this file")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {', '.join(VARIANTS + EXTRA_VARIANTS)} (default: {', '.join(VARIANTS)})",
    )
    p.add_argument("--teacher", action="store_true", help="the teacher_distill workloads (K 20/100, 1 and 3 teachers)")
    p.add_argument("--teacher-tokens", type=int, default=2048, help="T of the teacher workloads (default 2048)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        work = _teacher_worker if a.worker.startswith("teacher_") else _worker
        out = work(a.worker, json.loads(a.shape), a.chunk_size or 256, a.threads or 1, a.repeats or 1)
        print(json.dumps(out))
        return
    if a.teacher:
        rep = run_teacher(a.threads, a.chunk_size, a.repeats, a.teacher_tokens, a.quick)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rep, f, indent=2)
        print(json.dumps(rep, indent=2)) if a.json else _print_teacher(rep)
        return
    variants = tuple(v.strip() for v in a.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS + EXTRA_VARIANTS]
    if unknown or not variants:
        p.error(f"unknown --variants {unknown}; available: {', '.join(VARIANTS + EXTRA_VARIANTS)}")
    report = run(quick=a.quick, threads=a.threads, chunk_size=a.chunk_size, repeats=a.repeats, variants=variants)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)


if __name__ == "__main__":
    main()
