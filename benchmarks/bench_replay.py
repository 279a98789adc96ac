"""Replay throughput against the loopback OpenAI-compatible server (a separate process).

Three measurements, all in one run:

1. **Throughput at fixed latency**: the server adds ``L`` seconds to every answer; the
   full engine (cache + ledger + spend lease on, durable commits) runs ``N`` calls with
   concurrency ``C`` (two points: 50 ms x 32, 200 ms x 64). Ideal is ``C / L`` calls/s;
   target: achieved >= 90 % of ideal.
2. **Client overhead**: zero injected latency, concurrency 64. Raw client calls/s for
   aiohttp and httpx (same run, same server), then the engine on aiohttp/httpx without
   and with the cache. Target: >= 2,000 calls/s on one core (aiohttp). Besides wall-clock
   rates, the client's CPU time per call (and the server's, from /proc) is reported: on a
   shared machine the wall rate measures the contention, the CPU time the client.
3. **Warm-cache rerun** of (2): target 0 HTTP calls.

The client is pinned to CPU 0 and the server to CPU 1 where the machine has two or more
cores. Run: ``python -m benchmarks.bench_replay [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "replay"


def _pin_self(cpu: int) -> bool:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > cpu:
        try:
            os.sched_setaffinity(0, {cpu})
            return True
        except OSError:
            return False
    return False


def _proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux /proc), or None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class _Meter:
    """Wall time, client CPU time and server CPU time of one measurement."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid

    def __enter__(self) -> _Meter:
        self.w0, self.c0, self.s0 = time.perf_counter(), time.process_time(), _proc_cpu_s(self.server_pid)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.w0
        self.client_cpu = time.process_time() - self.c0
        s1 = _proc_cpu_s(self.server_pid)
        self.server_cpu = (s1 - self.s0) if s1 is not None and self.s0 is not None else None

    def per_call_us(self, n: int) -> dict[str, float | None]:
        return {
            "client_cpu_us_per_call": 1e6 * self.client_cpu / n,
            "server_cpu_us_per_call": None if self.server_cpu is None else 1e6 * self.server_cpu / n,
        }


def _states(n: int, tag: str) -> list[Any]:
    from composer_plugins.teachers.traces import TraceState

    return [
        TraceState(
            state_id=f"{tag}-{i}#0",
            messages=[
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": f"[{tag}] What is {i} + {2 * i + 1}?"},
            ],
            student_action={"role": "assistant", "content": f"#### {3 * i}"},
        )
        for i in range(n)
    ]


def _teacher(base_url: str, concurrency: int, client: str = "aiohttp", model: str = "bench-model") -> Any:
    from composer_plugins.teachers.openai_compat import OpenAITeacher

    return OpenAITeacher(
        model,
        base_url=base_url,
        api_key_env=None,
        max_concurrency=concurrency,
        http_client=client,  # type: ignore[arg-type]
        max_tokens=16,
        timeout_s=30.0,
        prompt_usd_per_token=1e-7,
        completion_usd_per_token=4e-7,
    )


def raw_client_rate(base_url: str, client: str, n: int, concurrency: int) -> float:
    """Calls/s of ``OpenAITeacher.complete`` alone (no engine, no cache), ``concurrency`` in flight."""
    t = _teacher(base_url, concurrency, client)
    msgs = [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(n)]

    async def go() -> float:
        sem = asyncio.Semaphore(concurrency)

        async def one(m: list[dict[str, Any]]) -> None:
            async with sem:
                await t.complete(m)

        await asyncio.gather(*(one(m) for m in msgs[: min(100, n)]))  # warm the connection pool
        t0 = time.perf_counter()
        await asyncio.gather(*(one(m) for m in msgs))
        dt = time.perf_counter() - t0
        await t.aclose()
        return n / dt

    return asyncio.run(go())


def engine_rate(
    base_url: str, n: int, concurrency: int, cache_path: Path | None, tag: str, client: str = "aiohttp"
) -> tuple[float, Any]:
    """Calls/s of the full :class:`ReplayEngine` (``cache_path=None``: no cache/ledger)."""
    from composer_plugins.teachers.cache import ReplayCache
    from composer_plugins.teachers.engine import ReplayEngine

    states = _states(n, tag)
    cache = ReplayCache(cache_path) if cache_path is not None else None
    try:
        eng = ReplayEngine(
            [_teacher(base_url, concurrency, client)],
            cache=cache,
            max_usd=1e6 if cache is not None else None,  # a ceiling: the durable spend lease is exercised
            progress=False,
            run_id=tag,
        )
        t0 = time.perf_counter()
        res = eng.run(states)
        dt = time.perf_counter() - t0
    finally:
        if cache is not None:
            cache.close()
    assert not res.failures, res.failures[:3]
    return n / dt, res


def run(quick: bool = False) -> dict[str, Any]:
    """Run the three measurements; returns ``{"name", "results", "ratios", "targets"}``."""
    from composer_plugins.teachers.loopback import LoopbackProcess

    multi = (os.cpu_count() or 1) >= 2
    points = [(0.05, 32), (0.2, 64)]  # (injected latency s, concurrency)
    n_lat = {0.05: 960 if quick else 3200, 0.2: 640 if quick else 1920}
    n_fast = 3000 if quick else 12000
    n_httpx = 600 if quick else 2000
    results: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "client_pinned": False,
        "server_cpu": 1 if multi else None,
        "loadavg_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    fixed: dict[str, Any] = {}
    cpu: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp, LoopbackProcess(cpu=1 if multi else None) as srv:
        assert srv.proc is not None
        pid = srv.proc.pid
        old_aff = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        results["client_pinned"] = _pin_self(0) if multi else False
        try:
            # warm-up: imports, connection pools, sqlite (not measured)
            engine_rate(srv.base_url, 256, 64, Path(tmp) / "warmup.sqlite", "warmup")
            # 1. throughput at fixed latency (full engine: cache, ledger, spend lease)
            for lat, conc in points:
                srv.configure(latency_s=lat)
                r0 = srv.stats()["requests"]
                n = n_lat[lat]
                rate, res = engine_rate(srv.base_url, n, conc, Path(tmp) / f"lat{lat}.sqlite", f"lat{lat}")
                fixed[f"L{int(lat * 1000)}ms_C{conc}"] = {
                    "latency_s": lat,
                    "concurrency": conc,
                    "calls": n,
                    "http_requests": srv.stats()["requests"] - r0,
                    "ideal_calls_per_s": conc / lat,
                    "achieved_calls_per_s": rate,
                    "achieved_vs_ideal": rate / (conc / lat),
                    "spent_usd": res.stats.spent_usd,
                }
            # 2. client overhead at zero latency, concurrency 64
            srv.configure(latency_s=0.0)
            with _Meter(pid) as m:
                raw_aiohttp = raw_client_rate(srv.base_url, "aiohttp", n_fast, 64)
            cpu["raw_aiohttp"] = m.per_call_us(n_fast + 100)
            with _Meter(pid) as m:
                raw_httpx = raw_client_rate(srv.base_url, "httpx", n_httpx, 64)
            cpu["raw_httpx"] = m.per_call_us(n_httpx + 100)
            with _Meter(pid) as m:
                eng_nocache, _ = engine_rate(srv.base_url, n_fast, 64, None, "nocache")
            cpu["engine_aiohttp_nocache"] = m.per_call_us(n_fast)
            with _Meter(pid) as m:
                eng_httpx, _ = engine_rate(srv.base_url, n_httpx, 64, None, "nocache-httpx", client="httpx")
            cpu["engine_httpx_nocache"] = m.per_call_us(n_httpx)
            cache_path = Path(tmp) / "fast.sqlite"
            with _Meter(pid) as m:
                eng_cache, _ = engine_rate(srv.base_url, n_fast, 64, cache_path, "cached")
            cpu["engine_aiohttp_cached"] = m.per_call_us(n_fast)
            # 3. warm-cache rerun
            r1 = srv.stats()["requests"]
            warm_rate, res_warm = engine_rate(srv.base_url, n_fast, 64, cache_path, "cached")
            warm_http = srv.stats()["requests"] - r1
        finally:
            if old_aff is not None:
                os.sched_setaffinity(0, old_aff)
    results.update(
        {
            "fixed_latency": fixed,
            "raw_aiohttp_calls_per_s_c64": raw_aiohttp,
            "raw_httpx_calls_per_s_c64": raw_httpx,
            "engine_aiohttp_nocache_calls_per_s_c64": eng_nocache,
            "engine_httpx_nocache_calls_per_s_c64": eng_httpx,
            "engine_aiohttp_cached_calls_per_s_c64": eng_cache,
            "cpu_per_call": cpu,
            "engine_aiohttp_cached_calls_per_client_cpu_s": 1e6
            / cpu["engine_aiohttp_cached"]["client_cpu_us_per_call"],
            "warm_rerun_http_calls": warm_http,
            "warm_rerun_cache_hits": res_warm.stats.cache_hits,
            "warm_rerun_states_per_s": warm_rate,
            "loadavg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        }
    )
    first = fixed["L50ms_C32"]
    ratios = {
        "throughput_vs_ideal_L50ms_C32": first["achieved_vs_ideal"],
        "throughput_vs_ideal_L200ms_C64": fixed["L200ms_C64"]["achieved_vs_ideal"],
        "aiohttp_vs_httpx_raw_c64": raw_aiohttp / raw_httpx,
        "engine_cached_vs_raw_aiohttp_c64": eng_cache / raw_aiohttp,
        "engine_cached_calls_per_s_vs_2000": eng_cache / 2000.0,
        "engine_cached_calls_per_client_cpu_s_vs_2000": results["engine_aiohttp_cached_calls_per_client_cpu_s"]
        / 2000.0,
        "warm_rerun_http_calls": float(warm_http),
    }
    targets = {
        "throughput_vs_ideal_L50ms_C32": ">= 0.9",
        "throughput_vs_ideal_L200ms_C64": ">= 0.9",
        "aiohttp_vs_httpx_raw_c64": "> 1 (why aiohttp is the default client)",
        "engine_cached_vs_raw_aiohttp_c64": "informational (engine + durable cache cost)",
        "engine_cached_calls_per_s_vs_2000": ">= 1 (wall clock; needs an otherwise idle core each)",
        "engine_cached_calls_per_client_cpu_s_vs_2000": ">= 1 (calls per CPU-second of the client)",
        "warm_rerun_http_calls": "== 0",
    }
    return {"name": NAME, "results": results, "ratios": ratios, "targets": targets}


def print_table(res: dict[str, Any]) -> None:
    """A short human-readable table."""
    r = res["results"]
    cpu = r["cpu_per_call"]

    def us(k: str) -> str:
        c = cpu[k]
        srv = "?" if c["server_cpu_us_per_call"] is None else f"{c['server_cpu_us_per_call']:.0f}"
        cl = c["client_cpu_us_per_call"]
        return f"client {cl:.0f} us/call ({1e6 / cl:.0f}/CPU-s), server {srv} us"

    rows = []
    for name, f in r["fixed_latency"].items():
        rows.append(
            (
                f"engine+cache @ {name}",
                f"{f['achieved_calls_per_s']:.0f}",
                f"ideal {f['ideal_calls_per_s']:.0f}: {f['achieved_vs_ideal']:.1%} (target >= 90%)",
            )
        )
    rows += [
        ("raw aiohttp @ c64, 0 latency", f"{r['raw_aiohttp_calls_per_s_c64']:.0f}", us("raw_aiohttp")),
        (
            "raw httpx   @ c64, 0 latency",
            f"{r['raw_httpx_calls_per_s_c64']:.0f}",
            f"aiohttp/httpx {res['ratios']['aiohttp_vs_httpx_raw_c64']:.1f}x; " + us("raw_httpx"),
        ),
        (
            "engine aiohttp, no cache",
            f"{r['engine_aiohttp_nocache_calls_per_s_c64']:.0f}",
            us("engine_aiohttp_nocache"),
        ),
        ("engine httpx, no cache", f"{r['engine_httpx_nocache_calls_per_s_c64']:.0f}", us("engine_httpx_nocache")),
        (
            "engine aiohttp, cache on",
            f"{r['engine_aiohttp_cached_calls_per_s_c64']:.0f}",
            "target >= 2000; " + us("engine_aiohttp_cached"),
        ),
        ("warm rerun HTTP calls", f"{r['warm_rerun_http_calls']}", f"{r['warm_rerun_cache_hits']} cache hits"),
    ]
    w = max(len(a) for a, _, _ in rows)
    print(f"{'measurement'.ljust(w)}  {'calls/s':>8}  note")
    for a, b, c in rows:
        print(f"{a.ljust(w)}  {b:>8}  {c}")
    print(
        f"(client pinned to CPU 0: {r['client_pinned']}, server on CPU {r['server_cpu']}, cpus={r['cpus']}, "
        f"load average {r['loadavg_start']:.1f} -> {r['loadavg_end']:.1f})"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON too")
    a = ap.parse_args(argv)
    res = run(quick=a.quick)
    print_table(res)
    if a.json:
        json.dump(res, sys.stdout, indent=2, default=str)
        print()


if __name__ == "__main__":
    main()
