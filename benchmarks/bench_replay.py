"""Replay throughput against the loopback OpenAI-compatible server (a separate process).

Three measurements, all in one run:

1. **Throughput at fixed latency**: the server adds ``L`` seconds to every answer; the
   full engine (cache + ledger + spend lease on, durable commits) runs ``N`` calls with
   concurrency ``C`` (two points: 50 ms x 32, 200 ms x 64). Ideal is ``C / L`` calls/s;
   target: achieved >= 90 % of ideal.
2. **Client overhead**: zero injected latency, concurrency 64. Raw client calls/s of the
   teacher's transport (aiohttp) and, as the baseline that decided the transport, of a bare
   ``httpx.AsyncClient`` posting the same request bodies (no parsing, so the comparison
   favours httpx); then the engine without and with the cache. Target: >= 2,000 calls/s on
   one core (aiohttp). Besides wall-clock
   rates, the client's CPU time per call (and the server's, from /proc) is reported: on a
   shared machine the wall rate measures the contention, the CPU time the client.
3. **Warm-cache rerun** of (2): target 0 HTTP calls.

The client is pinned to CPU 0 and the server to CPU 1 where the machine has two or more
cores. Run: ``python -m benchmarks.bench_replay [--quick]``.

``--faults`` runs the fault benchmark instead (:func:`run_faults`): ``replay run`` (the real
CLI, in its own process) with three teachers against a loopback server that requires a key
and injects a fault into 30 % of all attempts (429 with Retry-After, 5xx, hangs, slow
bodies, malformed/truncated JSON, dropped connections before and after billing, billed 200s
without a usable answer, bodies echoing the key). It reports answers lost, calls paid twice
(avoidable vs unavoidable), the ledger against what the server billed, Retry-After, a warm
rerun, key fragments in every file written, and a ``kill -9`` under a tight ceiling followed
by a rerun (ledger vs real money at the kill, what the rerun re-paid and answered).
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


def _teacher(base_url: str, concurrency: int, model: str = "bench-model") -> Any:
    from composer_plugins.teachers.openai_compat import OpenAITeacher

    return OpenAITeacher(
        model,
        base_url=base_url,
        api_key_env=None,
        max_concurrency=concurrency,
        max_tokens=16,
        timeout_s=30.0,
        prompt_usd_per_token=1e-7,
        completion_usd_per_token=4e-7,
    )


def raw_client_rate(base_url: str, client: str, n: int, concurrency: int) -> float:
    """Calls/s of ``OpenAITeacher.complete`` alone (no engine, no cache), ``concurrency`` in flight.

    ``client="httpx"``: a bare ``httpx.AsyncClient`` posting the teacher's request bodies to the same
    URL instead (the transport the teachers dropped for aiohttp; kept here as the baseline).
    """
    t = _teacher(base_url, concurrency)
    msgs = [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(n)]

    async def go() -> float:
        sem = asyncio.Semaphore(concurrency)
        post = None
        if client == "httpx":
            import httpx

            limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
            hx = httpx.AsyncClient(limits=limits, timeout=60.0, trust_env=False)

            async def post(m: list[dict[str, Any]]) -> None:
                r = await hx.post(
                    t.url, content=json.dumps(t.build_request(m)).encode(), headers={"Content-Type": "application/json"}
                )
                r.raise_for_status()

        async def one(m: list[dict[str, Any]]) -> None:
            async with sem:
                await (post(m) if post is not None else t.complete(m))

        await asyncio.gather(*(one(m) for m in msgs[: min(100, n)]))  # warm the connection pool
        t0 = time.perf_counter()
        await asyncio.gather(*(one(m) for m in msgs))
        dt = time.perf_counter() - t0
        await t.aclose()
        if client == "httpx":
            await hx.aclose()
        return n / dt

    return asyncio.run(go())


def engine_rate(base_url: str, n: int, concurrency: int, cache_path: Path | None, tag: str) -> tuple[float, Any]:
    """Calls/s of the full :class:`ReplayEngine` (``cache_path=None``: no cache/ledger)."""
    from composer_plugins.teachers.cache import ReplayCache
    from composer_plugins.teachers.engine import ReplayEngine

    states = _states(n, tag)
    cache = ReplayCache(cache_path) if cache_path is not None else None
    try:
        eng = ReplayEngine(
            [_teacher(base_url, concurrency)],
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
    from composer_plugins.testing.teacher_loopback import LoopbackProcess

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
                    # calls that waited for a spend-lease write with their slot held (a count: load-independent)
                    "lease_waits": res.stats.lease_waits,
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
        "aiohttp_vs_httpx_raw_c64": "> 1 (why aiohttp is the one transport)",
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
            "bare httpx  @ c64, 0 latency",
            f"{r['raw_httpx_calls_per_s_c64']:.0f}",
            f"aiohttp/httpx {res['ratios']['aiohttp_vs_httpx_raw_c64']:.1f}x; " + us("raw_httpx"),
        ),
        (
            "engine aiohttp, no cache",
            f"{r['engine_aiohttp_nocache_calls_per_s_c64']:.0f}",
            us("engine_aiohttp_nocache"),
        ),
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


# -- the fault benchmark ------------------------------------------------------------------------

FAULT_PLAN = [
    "429",
    "500",
    "502",
    "503",
    "timeout",
    "malformed",
    "slow",
    "drop",
    "billed_drop",
    "empty",
    "slow_body",
    "echo",
]
PROMPT_PRICE, COMPLETION_PRICE = 1e-6, 4e-6
FAULT_TEACHERS = ("teacher-a", "teacher-b", "c-wrong")


def _price(prompt_tokens: int, completion_tokens: int) -> float:
    return prompt_tokens * PROMPT_PRICE + completion_tokens * COMPLETION_PRICE


def _ledger(path: Path, run_id: str) -> dict[str, float]:
    import sqlite3

    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute(
            "SELECT status, COALESCE(SUM(amount), 0) FROM ledger WHERE run_id = ? GROUP BY status", (run_id,)
        ).fetchall()
    finally:
        con.close()
    out = {"paid": 0.0, "maybe": 0.0, "lease": 0.0}
    out.update({k: float(v) for k, v in rows})
    return out


def _replay_config(tmp: Path, name: str, base_url: str, key_env: str, n_states: int, **over: Any) -> Path:
    import yaml

    from composer_plugins.testing.teacher_data import write_sample_traces

    d = tmp / name
    traces = write_sample_traces(d / "traces.jsonl", n=n_states, wrong_every=2)
    cfg: dict[str, Any] = {
        "run_id": f"bench-{name}",
        "traces": [str(traces)],
        "teachers": [
            {
                "name": "openai",
                "id": m,
                "model": m,
                "base_url": base_url,
                "api_key_env": key_env,
                "prompt_usd_per_token": PROMPT_PRICE,
                "completion_usd_per_token": COMPLETION_PRICE,
                "max_tokens": 32,
                "max_concurrency": 8,
                "timeout_s": 1.0,
            }
            for m in FAULT_TEACHERS
        ],
        "consensus": {"k": 2},
        "budget": {"max_usd": 1.0},
        "cache": {"path": str(d / "cache" / "replay.sqlite")},
        "retry": {"max_retries": 8, "backoff_base_s": 0.05, "backoff_max_s": 1.0},
        "output": {
            "pairs": str(d / "out" / "pairs.jsonl"),
            "responses": str(d / "out" / "responses.jsonl"),
            "summary": str(d / "out" / "summary.json"),
        },
        "normalize": {"enabled": False},
        "progress": False,
    }
    cfg.update(over)
    p = d / "replay.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return p


def _cli(cfg: Path, env: dict[str, str], *extra: str, timeout: float = 600) -> tuple[int, str, str]:
    import subprocess

    cmd = [sys.executable, "-m", "composer_plugins.core.cli", "replay", "run", "-c", str(cfg), "--no-progress", *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cfg.parent)
    return out.returncode, out.stdout, out.stderr


def _last_json(text: str) -> dict[str, Any]:
    return json.loads(text.strip().splitlines()[-1])


def _key_scan(root: Path, key: str, texts: list[str]) -> dict[str, int]:
    """Files under ``root`` (and captured outputs) holding the key or any 8-character piece of it."""
    frags = {key[i : i + 8] for i in range(len(key) - 7)}
    files = [f for f in root.rglob("*") if f.is_file()]
    whole = pieces = 0
    for blob in [f.read_bytes().decode("utf-8", "replace") for f in files] + texts:
        whole += key in blob
        pieces += any(x in blob for x in frags)
    return {"files_written": len(files), "outputs_scanned": len(texts), "with_key": whole, "with_fragment": pieces}


def _paid_twice(st: dict[str, Any]) -> dict[str, int]:
    """Identities billed more than once: unavoidable when the extra bills were answers never delivered."""
    total = unavoidable = 0
    for ident, (n, _, _) in st["billed"].items():
        extra = max(0, n - 1)
        total += extra
        unavoidable += min(extra, st["undelivered"].get(ident, 0))
    return {"total": total, "unavoidable": unavoidable, "avoidable": total - unavoidable}


def _retry_after(st: dict[str, Any], wait_s: float) -> dict[str, int]:
    seen = ok = 0
    for ident, kinds in st["kinds"].items():
        times = st["times"][ident]
        for i, k in enumerate(kinds[:-1]):
            if k == "429":
                seen += 1
                ok += times[i + 1] - times[i] >= wait_s - 0.05
    return {"after_429": seen, "honoured": ok}


def run_faults(quick: bool = False) -> dict[str, Any]:
    """The fault benchmark (see the module docstring); returns ``{"name", "results", "ratios", "targets"}``."""
    import secrets
    import signal
    import subprocess

    from composer_plugins.testing.teacher_loopback import LoopbackProcess

    n_states = 40 if quick else 76
    key_env = "BENCH_REPLAY_FAULTS_KEY"
    key = ("sk-bench-" + secrets.token_hex(24))[:44]
    env = {**os.environ, key_env: key, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    server = {
        "fault_mode": "attempt",
        "fault_rate": 0.3,
        "plan": FAULT_PLAN,
        "retry_after": "1",
        "hang_s": 3.0,
        "slow_s": 0.3,
        "latency_s": 0.02,
        "echo_pad": 164,  # the echoed key straddles the 200-character cut of malformed bodies
    }
    res: dict[str, Any] = {"states": n_states, "teachers": len(FAULT_TEACHERS), "fault_rate": 0.3, "plan": FAULT_PLAN}
    t0 = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="bench-replay-faults-") as td,
        LoopbackProcess(env={key_env: key}, api_key_env=key_env, **server) as srv,
    ):
        tmp = Path(td)
        jobs = n_states * len(FAULT_TEACHERS)
        outputs: list[str] = []
        # 1. every call through 30 % faults per attempt, a loose ceiling
        cfg = _replay_config(tmp, "faults", srv.base_url, key_env, n_states)
        rc, out, err = _cli(cfg, env, "--json")
        outputs += [out, err]
        s1 = _last_json(out)
        st = srv.stats()
        answered = s1["replay"]["completed"] + s1["replay"]["cache_hits"]
        led = _ledger(tmp / "faults" / "cache" / "replay.sqlite", "bench-faults")
        billed = sum(_price(pt, ct) for _, pt, ct in st["billed"].values())
        undelivered = sum(_price(pt, ct) for pt, ct in st["undelivered_usage"].values())
        res["faults"] = {
            "exit_code": rc,
            "jobs": jobs,
            "answered": answered,
            "lost": jobs - answered,
            "requests": st["requests"],
            "served": st["by_status"],
            "retries": s1["replay"]["retries"],
            "paid_twice": _paid_twice(st),
            "billed_usd": billed,
            "billed_delivered_usd": billed - undelivered,
            "billed_undelivered_usd": undelivered,
            "ledger_paid_usd": led["paid"],
            "ledger_maybe_usd": led["maybe"],
            "ledger_lease_usd": led["lease"],
            "ledger_total_usd": sum(led.values()),
            "retry_after": _retry_after(st, 1.0),
            "requests_without_key": st["by_status"].get("401", 0),
        }
        # warm rerun: nothing sent
        r0 = srv.stats()["requests"]
        rc2, out2, err2 = _cli(cfg, env, "--json")
        outputs += [out2, err2]
        res["faults"]["warm_rerun"] = {"exit_code": rc2, "requests": srv.stats()["requests"] - r0}

        # 2. kill -9 under a tight ceiling, then rerun with the same run id (no --fresh-budget)
        from composer_plugins.teachers.base import estimate_prompt_tokens
        from composer_plugins.teachers.traces import load_traces

        srv.reset()
        kill_dir = tmp / "kill"
        cfg_k = _replay_config(tmp, "kill", srv.base_url, key_env, n_states)
        states = load_traces([str(kill_dir / "traces.jsonl")])
        worst = [_price(estimate_prompt_tokens(s.messages), 32) for s in states]
        ceiling = 0.5 * len(FAULT_TEACHERS) * sum(worst)  # about the job's real cost: the ceiling binds
        cfg_k = _replay_config(tmp, "kill", srv.base_url, key_env, n_states, budget={"max_usd": ceiling})
        cmd = [sys.executable, "-m", "composer_plugins.core.cli", "replay", "run", "-c", str(cfg_k), "--no-progress"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=kill_dir)

        def real_usd() -> float:
            return sum(_price(pt, ct) for _, pt, ct in srv.stats()["billed"].values())

        try:
            deadline = time.monotonic() + 300
            while real_usd() < 0.5 * ceiling and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            killed = proc.poll() is None
            if killed:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                outputs.append(proc.stdout.read().decode("utf-8", "replace"))
                proc.stdout.close()
        while srv.stats()["in_flight"] > 0:  # requests the dead client left still finish (and bill)
            time.sleep(0.02)
        st_k = srv.stats()
        led_k = _ledger(kill_dir / "cache" / "replay.sqlite", "bench-kill")
        from composer_plugins.teachers.cache import ReplayCache

        with ReplayCache(kill_dir / "cache" / "replay.sqlite") as c:
            committed = len(c)
        delivered = sum(n - st_k["undelivered"].get(k, 0) for k, (n, _, _) in st_k["billed"].items())
        real_k = real_usd()
        billed_before = {k: v[0] for k, v in st_k["billed"].items()}
        rc3, out3, err3 = _cli(cfg_k, env, "--json")
        outputs += [out3, err3]
        s3 = _last_json(out3)
        st_r = srv.stats()
        delivered_before = {k: n - st_k["undelivered"].get(k, 0) for k, n in billed_before.items()}
        repaid_ids = [k for k, (n, _, _) in st_r["billed"].items() if k in billed_before and n > billed_before[k]]
        # an identity delivered before the kill and billed again was answered but never committed
        repaid_uncommitted = sum(1 for k in repaid_ids if delivered_before[k] > 0)
        led_r = _ledger(kill_dir / "cache" / "replay.sqlite", "bench-kill")
        real_r = sum(_price(pt, ct) for _, pt, ct in st_r["billed"].values())
        res["kill"] = {
            "killed": killed,
            "ceiling_usd": ceiling,
            "at_kill": {
                "real_billed_usd": real_k,
                "ledger_paid_usd": led_k["paid"],
                "ledger_maybe_usd": led_k["maybe"],
                "ledger_lease_usd": led_k["lease"],
                "ledger_total_usd": sum(led_k.values()),
                "answers_committed": committed,
                "answers_billed_not_committed": delivered - committed,
            },
            "rerun": {
                "exit_code": rc3,
                "calls_sent": s3["replay"]["calls"],
                "answered": s3["replay"]["completed"],
                "cache_hits": s3["replay"]["cache_hits"],
                "budget_skipped": s3["replay"]["skipped_budget"],
                "unanswered": s3["failures"]["unanswered"],
                "re_paid_calls": len(repaid_ids),
                "re_paid_uncommitted_answers": repaid_uncommitted,
                "re_paid_after_undelivered_bills": len(repaid_ids) - repaid_uncommitted,
            },
            "final": {
                "real_billed_usd": real_r,
                "ledger_total_usd": sum(led_r.values()),
                "ledger_lease_usd": led_r["lease"],
            },
        }
        # 3. a base_url typo and an outage: refused before sending / a failing exit status
        srv.reset()
        typo = _replay_config(
            tmp, "typo", srv.base_url.removeprefix("http://"), key_env, 10, budget={"max_usd": ceiling}
        )
        rc4, out4, err4 = _cli(typo, env)
        outputs += [out4, err4]
        typo_requests = srv.stats()["requests"]
        srv.configure(fault_mode="identity", fault_rate=1.0, plan=["503"] * 20)
        outage = _replay_config(tmp, "outage", srv.base_url, key_env, 10, retry={"max_retries": 1})
        rc5, out5, err5 = _cli(outage, env)
        outputs += [out5, err5]
        res["typo"] = {"exit_code": rc4, "requests": typo_requests, "error": err4.strip()[-300:]}
        res["outage"] = {"exit_code": rc5, "error": err5.strip().splitlines()[-1][:300] if err5.strip() else ""}
        res["key"] = _key_scan(tmp, key, outputs)
    res["wall_s"] = time.perf_counter() - t0
    f, k = res["faults"], res["kill"]
    ratios = {
        "lost_answers": float(f["lost"]),
        "paid_twice_avoidable": float(f["paid_twice"]["avoidable"]),
        "ledger_paid_vs_billed_delivered": f["ledger_paid_usd"] / f["billed_delivered_usd"],
        "ledger_total_vs_billed": f["ledger_total_usd"] / f["billed_usd"],
        "warm_rerun_requests": float(f["warm_rerun"]["requests"]),
        "key_fragments_in_files": float(res["key"]["with_fragment"]),
        "kill_ledger_vs_ceiling": k["at_kill"]["ledger_total_usd"] / k["ceiling_usd"],
        "kill_real_vs_ceiling": k["at_kill"]["real_billed_usd"] / k["ceiling_usd"],
        "final_real_vs_ceiling": k["final"]["real_billed_usd"] / k["ceiling_usd"],
    }
    targets = {
        "lost_answers": "== 0",
        "paid_twice_avoidable": "== 0",
        "ledger_paid_vs_billed_delivered": "== 1",
        "ledger_total_vs_billed": ">= 1 (maybe-billed calls at their worst case)",
        "warm_rerun_requests": "== 0",
        "key_fragments_in_files": "== 0",
        "kill_ledger_vs_ceiling": "<= 1",
        "kill_real_vs_ceiling": "informational",
        "final_real_vs_ceiling": "<= 1",
    }
    return {"name": NAME + "_faults", "results": res, "ratios": ratios, "targets": targets}


def print_faults(res: dict[str, Any]) -> None:
    """The fault benchmark as a few readable lines."""
    r = res["results"]
    f, k, a, rr = r["faults"], r["kill"], r["kill"]["at_kill"], r["kill"]["rerun"]
    c = k["ceiling_usd"]
    pt = f["paid_twice"]
    print(
        f"{r['teachers']} teachers x {r['states']} states, {r['fault_rate']:.0%} faults per attempt "
        f"({f['requests']} requests; served {f['served']})"
    )
    print(f"  lost answers: {f['lost']} of {f['jobs']} (exit {f['exit_code']}); retries {f['retries']}")
    print(
        f"  paid twice: {pt['total']} ({pt['avoidable']} avoidable, {pt['unavoidable']} after a billed "
        "answer that never arrived)"
    )
    print(
        f"  ledger vs billed: paid ${f['ledger_paid_usd']:.6f} vs delivered ${f['billed_delivered_usd']:.6f}; "
        f"maybe ${f['ledger_maybe_usd']:.6f} vs billed-undelivered ${f['billed_undelivered_usd']:.6f}; "
        f"total ${f['ledger_total_usd']:.6f} vs billed ${f['billed_usd']:.6f} (lease left ${f['ledger_lease_usd']:g})"
    )
    ra = f["retry_after"]
    warm = f["warm_rerun"]["requests"]
    print(f"  Retry-After honoured: {ra['honoured']}/{ra['after_429']}; warm rerun requests: {warm}")
    print(
        f"  kill -9 (ceiling ${c:.6f}): real ${a['real_billed_usd']:.6f} ({a['real_billed_usd'] / c:.0%}); "
        f"ledger ${a['ledger_total_usd']:.6f} ({a['ledger_total_usd'] / c:.0%}: paid {a['ledger_paid_usd'] / c:.0%}, "
        f"maybe {a['ledger_maybe_usd'] / c:.0%}, lease {a['ledger_lease_usd'] / c:.0%}); "
        f"{a['answers_billed_not_committed']} answers billed but not committed"
    )
    print(
        f"  rerun: exit {rr['exit_code']}, sent {rr['calls_sent']}, answered {rr['answered']}, cache hits "
        f"{rr['cache_hits']}, budget-skipped {rr['budget_skipped']}, re-paid {rr['re_paid_calls']} "
        f"({rr['re_paid_uncommitted_answers']} answered but uncommitted at the kill, "
        f"{rr['re_paid_after_undelivered_bills']} whose earlier bill never delivered); "
        f"final real ${k['final']['real_billed_usd']:.6f} ({k['final']['real_billed_usd'] / c:.0%} of the ceiling), "
        f"ledger {k['final']['ledger_total_usd'] / c:.0%}"
    )
    print(
        f"  base_url typo: exit {r['typo']['exit_code']}, {r['typo']['requests']} requests; "
        f"outage: exit {r['outage']['exit_code']}"
    )
    ks = r["key"]
    print(
        f"  key: {ks['with_key']} whole / {ks['with_fragment']} with an 8+ char fragment, in {ks['files_written']} "
        f"files + {ks['outputs_scanned']} captured outputs; requests without the key: {f['requests_without_key']}"
    )
    print(f"  ({r['wall_s']:.0f} s)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--faults", action="store_true", help="run the fault benchmark instead (see the docstring)")
    ap.add_argument("--json", action="store_true", help="print the result dict as JSON too")
    a = ap.parse_args(argv)
    if a.faults:
        res = run_faults(quick=a.quick)
        print_faults(res)
    else:
        res = run(quick=a.quick)
        print_table(res)
    if a.json:
        json.dump(res, sys.stdout, indent=2, default=str)
        print()


if __name__ == "__main__":
    main()
