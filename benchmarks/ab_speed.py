"""Interleaved A/B timings for a shared, loaded machine (not a ``bench_*`` module: ``run_all`` skips it).

Wall-clock ratios of runs made one after the other swing with whatever else the machine runs. These
alternate the implementations round by round in the same conditions and report the median of the
per-round ratios (CPU time on one torch thread for the kernels).

* ``logprobs``: bench_losses' quick workload (T=512, H=256, V=32,000, chunk 64): the materialised
  path vs :func:`chunked_logprobs`, and vs the ``chunked.py`` of other checkouts (``--kernels``).
* ``jsd``: ``JSDKernel.compute`` with its gradient on one 96 x 151,936 chunk (bench_scale's CPU
  proxy vocabulary), this checkout's ``divergences.py`` against other checkouts' (``--kernels``).
* ``replay``: the replay engine at 50 ms x 32 and 200 ms x 64 against the loopback server, this
  checkout against other checkouts (``--trees``), each run in its own process: calls/s against the
  ideal and ``lease_waits`` (calls that waited for a spend-lease write: a count, independent of load).

Run: ``python -m benchmarks.ab_speed logprobs|jsd [--rounds N] [--kernels DIR ...]`` or
``python -m benchmarks.ab_speed replay [--rounds N] --trees DIR [DIR ...]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _rounds(fns: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()  # warm-up
    for r in range(rounds):
        for k in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            c0 = time.process_time()
            fns[k]()
            ts[k].append(time.process_time() - c0)
    return ts


def _report(ts: dict[str, list[float]], base: str) -> dict[str, Any]:
    out = {}
    for k, xs in ts.items():
        ratio = statistics.median(a / b for a, b in zip(xs, ts[base], strict=True))
        out[k] = {"median_ms": 1e3 * statistics.median(xs), f"ratio_to_{base}": ratio}
        print(f"{k:>44}: median {1e3 * statistics.median(xs):8.1f} ms   / {base}: {ratio:.3f}")
    return out


def ab_logprobs(rounds: int, kernels: list[str]) -> dict[str, Any]:
    import torch

    from composer_plugins.kernels.chunked import chunked_logprobs
    from composer_plugins.losses.functional import selective_log_softmax

    torch.set_num_threads(1)
    t, h, v, chunk = 512, 256, 32_000, 64
    g = torch.Generator().manual_seed(0)
    w = torch.empty(v, h).normal_(0, 0.05, generator=g).requires_grad_(True)
    x = torch.empty(1, t, h).normal_(0, 1, generator=g).requires_grad_(True)
    ids = torch.randint(0, v, (1, t), generator=g)
    adv = torch.empty(1, t).normal_(0, 1, generator=g)

    def step(loss_fn: Any) -> Any:
        def run() -> None:
            w.grad = x.grad = None
            loss_fn().backward()

        return run

    fns = {
        "materialised": step(lambda: -(selective_log_softmax(x @ w.T, ids) * adv).sum() / t),
        "chunked (this checkout)": step(lambda: -(chunked_logprobs(x, w, ids, chunk_size=chunk) * adv).sum() / t),
    }
    for i, d in enumerate(kernels):
        mod = _load(Path(d) / "composer_plugins/kernels/chunked.py", f"_ab_chunked_{i}")
        fns[f"chunked ({d})"] = step(lambda m=mod: -(m.chunked_logprobs(x, w, ids, chunk_size=chunk) * adv).sum() / t)
    return _report(_rounds(fns, rounds), "materialised")


def ab_jsd(rounds: int, kernels: list[str]) -> dict[str, Any]:
    import torch

    from composer_plugins.kernels.divergences import JSDKernel

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    zs = torch.randn(96, 151_936, generator=g) * 3
    zt = zs * 0.8 + torch.randn(96, 151_936, generator=g)
    go = torch.full((96,), 0.01)
    kinds = {"this checkout": JSDKernel}
    for i, d in enumerate(kernels):
        kinds[d] = _load(Path(d) / "composer_plugins/kernels/divergences.py", f"_ab_div_{i}").JSDKernel
    fns = {k: (lambda K=K: K(beta=0.5).compute(zs.clone(), zt.clone(), go)) for k, K in kinds.items()}
    return _report(_rounds(fns, rounds), "this checkout")


_REPLAY_CHILD = r"""
import json, sys, tempfile
from pathlib import Path
from benchmarks.bench_replay import engine_rate, _pin_self
_pin_self(0)
url, lat, conc, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with tempfile.TemporaryDirectory() as td:
    engine_rate(url, 256, 64, Path(td) / "w.sqlite", "warmup")
    rate, res = engine_rate(url, n, conc, Path(td) / "x.sqlite", "x")
print(json.dumps({"vs_ideal": rate / (conc / lat), "lease_waits": getattr(res.stats, "lease_waits", None)}))
"""


def ab_replay(rounds: int, trees: list[str]) -> dict[str, Any]:
    from composer_plugins.testing.teacher_loopback import LoopbackProcess

    trees = [str(REPO)] + [str(Path(t).resolve()) for t in trees]
    out: dict[str, Any] = {}
    multi = (os.cpu_count() or 1) >= 2
    with LoopbackProcess(cpu=1 if multi else None) as srv:
        for lat, conc, n in ((0.05, 32, 960), (0.2, 64, 640)):
            srv.configure(latency_s=lat)
            runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
            for r in range(rounds):
                for t in trees if r % 2 == 0 else trees[::-1]:
                    env = dict(os.environ, PYTHONPATH=t)
                    cmd = [sys.executable, "-c", _REPLAY_CHILD, srv.base_url, str(lat), str(conc), str(n)]
                    p = subprocess.run(cmd, cwd=t, env=env, capture_output=True, text=True, check=True)
                    runs[t].append(json.loads(p.stdout.strip().splitlines()[-1]))
            for t, ds in runs.items():
                med = statistics.median(d["vs_ideal"] for d in ds)
                waits = [d["lease_waits"] for d in ds]
                print(f"L={int(lat * 1000)}ms C={conc} {t}: vs ideal median {med:.3f}, lease_waits {waits}")
                out[f"L{int(lat * 1000)}ms/{t}"] = {"vs_ideal_median": med, "lease_waits": waits}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("logprobs", "jsd", "replay"))
    p.add_argument("--rounds", type=int, default=None, help="rounds (default: 30 logprobs, 15 jsd, 3 replay)")
    p.add_argument("--kernels", nargs="*", default=[], help="other checkouts whose kernels to time (logprobs, jsd)")
    p.add_argument("--trees", nargs="*", default=[], help="other checkouts to run the replay engine from (replay)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    rounds = a.rounds or {"logprobs": 30, "jsd": 15, "replay": 3}[a.what]
    print(f"load average {os.getloadavg()[0]:.1f}")
    if a.what == "logprobs":
        res = ab_logprobs(rounds, a.kernels)
    elif a.what == "jsd":
        res = ab_jsd(rounds, a.kernels)
    else:
        res = ab_replay(rounds, a.trees)
    print(f"load average {os.getloadavg()[0]:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
