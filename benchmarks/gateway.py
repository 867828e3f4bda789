"""Gateway overhead: tokenfab's multi-tenant gateway against vLLM's own OpenAI server, one run.

Both fronts stand before the same engine (the tiny model, one pinned core, eager) and answer the
same near-trivial request (a 2-token prompt, 1 output token), so what differs is the layer above
the engine:

- tokenfab: HTTP -> Ray Serve proxy -> gateway (API key, tenant limits, fair queue, KV-aware
  routing key) -> pool replica. Baseline: the same request sent straight to the pool replica
  through its Serve handle, with the one-call method the gateway uses for non-streamed requests
  ("calling the engine pool directly").
- vLLM: HTTP -> vLLM's API server -> engine. Baseline: the same request through vLLM's own
  OpenAI serving code in-process (pools.vllm_engine.VllmEngine, what a pool replica runs), no HTTP.

Added latency = percentile of the front's latencies minus the same percentile of its baseline's,
with requests sent one at a time and front/baseline interleaved. Max requests/s: 32 clients
in a closed loop for `--seconds`, all through the front.

    .venv/bin/python benchmarks/gateway.py [--requests 300] [--seconds 20]

Writes benchmarks/results/gateway.json and gateway.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a loopback single-node cluster

from orchestrator import cluster
from orchestrator.config import parse_topology
from orchestrator.tenancy import hash_key
from harness import deployed, remove

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
MODEL_PATH = str(Path("~/.cache/tokenfab/models/tiny-llama").expanduser())
BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 1, "temperature": 0}
KEY = "bench-key"
CLIENTS = 32
VLLM_PORT = 8124
KV_CACHE_BYTES = 64 << 20
ENGINE_CORE = "1"
TOPOLOGY = {
    "name": "bench-gateway",
    "model": {"name": "tiny", "path": MODEL_PATH, "generate": "tiny", "dtype": "bfloat16",
              "max_model_len": 2048},
    "engine_args": {"enforce_eager": True},
    "pools": [{"name": "main", "role": "unified", "replicas": 1, "max_ongoing_requests": 256,
               "resources": {"cpus": 1, "kv_cache_bytes": KV_CACHE_BYTES}}],
    "gateway": {"host": "127.0.0.1", "port": 8013},
    "auth": {"enabled": True},
    "tenants": [{"name": "bench", "api_keys": [hash_key(KEY)],
                 "limits": {"requests_per_minute": 10_000_000, "tokens_per_minute": 100_000_000,
                            "max_concurrent": 10_000, "max_prompt_tokens": 2048}}],
    "admission": {"max_in_flight": 256},
    "cluster": {"node_ip": "127.0.0.1", "address": "127.0.0.1:6391",
                "dashboard_url": "http://127.0.0.1:8279", "num_cpus": 2},
}


def _sequential(front: Any, baseline: Any, count: int) -> tuple[list[float], list[float]]:
    """Latencies (s) of `count` requests through each, interleaved; 20 warm-up requests first."""
    for _ in range(20):
        front(), baseline()
    fronts, baselines = [], []
    for _ in range(count):
        for call, out in ((front, fronts), (baseline, baselines)):
            started = time.perf_counter()
            call()
            out.append(time.perf_counter() - started)
    return fronts, baselines


async def _max_rps(url: str, headers: dict[str, str], seconds: float) -> tuple[float, int]:
    done = failed = 0

    async def client(http: httpx.AsyncClient, until: float) -> None:
        nonlocal done, failed
        while time.monotonic() < until:
            response = await http.post(url, json=BODY, headers=headers)
            if response.status_code == 200:
                done += 1
            else:
                failed += 1

    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=120, trust_env=False, limits=limits) as http:
        started = time.monotonic()
        await asyncio.gather(*(client(http, started + seconds) for _ in range(CLIENTS)))
        elapsed = time.monotonic() - started
    return done / elapsed, failed


def _record(target: str, fronts: list[float], baselines: list[float], rps: float,
            failed: int) -> dict[str, Any]:
    p = lambda xs, q: float(np.percentile(xs, q)) * 1000  # noqa: E731
    return {"target": target,
            "added_p50_ms": round(p(fronts, 50) - p(baselines, 50), 2),
            "added_p99_ms": round(p(fronts, 99) - p(baselines, 99), 2),
            "max_rps": round(rps, 1),
            "front_p50_ms": round(p(fronts, 50), 2), "front_p99_ms": round(p(fronts, 99), 2),
            "baseline_p50_ms": round(p(baselines, 50), 2),
            "baseline_p99_ms": round(p(baselines, 99), 2),
            "failed_in_load": failed}


def tokenfab(count: int, seconds: float) -> dict[str, Any]:
    import ray
    from ray import serve

    topology = parse_topology(TOPOLOGY, "gateway benchmark")
    cluster.start_head(topology.cluster)
    try:
        root = deployed(topology)
        ray.init(address=topology.cluster.address, log_to_driver=False, logging_level="ERROR")
        handle = serve.get_deployment_handle("pool-main", topology.name)
        loop = asyncio.new_event_loop()

        async def direct() -> None:  # the replica's one-call method, as the gateway uses it
            head, _ = await handle.reply_whole.remote("completions", BODY)
            assert head.status == 200

        headers = {"authorization": f"Bearer {KEY}"}
        http = httpx.Client(trust_env=False, timeout=60)

        def front() -> None:
            response = http.post(f"{root}/v1/completions", json=BODY, headers=headers)
            assert response.status_code == 200, response.text

        fronts, baselines = _sequential(front, lambda: loop.run_until_complete(direct()), count)
        rps, failed = asyncio.run(_max_rps(f"{root}/v1/completions", headers, seconds))
        ray.shutdown()
        remove(topology)
    finally:
        cluster.stop_ray()
    return _record("tokenfab", fronts, baselines, rps, failed)


def _vllm_server() -> subprocess.Popen:
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": ENGINE_CORE, "VLLM_HOST_IP": "127.0.0.1"}
    return subprocess.Popen([
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL_PATH,
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(VLLM_PORT),
        "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enable-prefix-caching",
        "--disable-log-stats"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)


def vllm(count: int, seconds: float) -> dict[str, Any]:
    """vLLM's server first (its numbers), then the in-process baseline with the same engine."""
    server, url = _vllm_server(), f"http://127.0.0.1:{VLLM_PORT}"
    http = httpx.Client(trust_env=False, timeout=60)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if http.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("vLLM's API server did not start")
            time.sleep(2)

        def front() -> None:
            response = http.post(f"{url}/v1/completions", json=BODY)
            assert response.status_code == 200, response.text

        for _ in range(20):
            front()
        fronts = []
        for _ in range(count):
            started = time.perf_counter()
            front()
            fronts.append(time.perf_counter() - started)
        rps, failed = asyncio.run(_max_rps(f"{url}/v1/completions", {}, seconds))
    finally:
        server.terminate()
        server.wait(60)
    result = subprocess.run([sys.executable, __file__, "--in-process-baseline", str(count)],
                            capture_output=True, text=True, timeout=900,
                            env=os.environ | {"VLLM_CPU_OMP_THREADS_BIND": ENGINE_CORE})
    assert result.returncode == 0, result.stderr[-3000:]
    baselines = json.loads(result.stdout.strip().splitlines()[-1])
    return _record("vllm", fronts, baselines, rps, failed)


def in_process_baseline(count: int) -> None:
    """The engine behind vLLM's OpenAI serving code, called in-process (prints latencies)."""
    from pools.engine import EngineSpec
    from pools.vllm_engine import VllmEngine

    async def run() -> list[float]:
        engine = VllmEngine(EngineSpec(
            model_path=MODEL_PATH, model_name="tiny", dtype="bfloat16", max_model_len=2048,
            kv_cache_bytes=KV_CACHE_BYTES, engine_args={"enforce_eager": True}))
        await engine.start()
        latencies = []
        for i in range(count + 20):
            started = time.perf_counter()
            async for _ in engine.reply("completions", dict(BODY)):
                pass
            if i >= 20:
                latencies.append(time.perf_counter() - started)
        engine.shutdown()
        return latencies

    print(json.dumps(asyncio.run(run())))


def markdown(records: list[dict[str, Any]], count: int, seconds: float) -> str:
    lines = [
        "# Gateway overhead", "",
        f"`python benchmarks/gateway.py --requests {count} --seconds {seconds:g}`: the tiny model "
        "on one pinned core, a 2-token prompt and 1 output token; added latency is the front's "
        "percentile minus its baseline's (tokenfab: the pool replica called through its Serve "
        "handle; vLLM: its OpenAI serving code in-process), from requests sent one at a time; max "
        f"req/s from {CLIENTS} closed-loop clients. tokenfab's path includes API-key auth, tenant "
        "limits, the fair queue and the routing key.", "",
        "| target | added p50 (ms) | added p99 (ms) | max req/s | front p50 / p99 (ms) | "
        "baseline p50 / p99 (ms) | failed under load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(f"| {r['target']} | {r['added_p50_ms']:.2f} | {r['added_p99_ms']:.2f} | "
                     f"{r['max_rps']:.1f} | {r['front_p50_ms']:.2f} / {r['front_p99_ms']:.2f} | "
                     f"{r['baseline_p50_ms']:.2f} / {r['baseline_p99_ms']:.2f} | "
                     f"{r['failed_in_load']} |")
    by = {r["target"]: r for r in records}
    if {"tokenfab", "vllm"} <= by.keys():
        lines += ["", f"Ratio tokenfab/vLLM: added p50 "
                  f"{by['tokenfab']['added_p50_ms'] / by['vllm']['added_p50_ms']:.2f}, max req/s "
                  f"{by['tokenfab']['max_rps'] / by['vllm']['max_rps']:.2f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--in-process-baseline", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process_baseline:
        in_process_baseline(args.in_process_baseline)
        return
    records = []
    for name, run in (("tokenfab", tokenfab), ("vllm", vllm)):
        print(f"{name}: measuring")
        records.append(run(args.requests, args.seconds))
        print(json.dumps(records[-1]))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway.json").write_text(json.dumps({"records": records}, indent=2))
    (RESULTS / "gateway.md").write_text(markdown(records, args.requests, args.seconds))
    print(markdown(records, args.requests, args.seconds))


if __name__ == "__main__":
    main()
