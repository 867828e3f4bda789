"""Gateway overhead: tokenfab's multi-tenant gateway against vLLM's own OpenAI server, one run.

Both fronts stand before the same engine (the tiny model, one pinned core, eager) and answer the
same near-trivial request (a 2-token prompt, 1 output token), so what differs is the layer above
the engine:

- tokenfab: HTTP -> gateway (API key, tenant limits, fair queue, KV-aware routing key) -> data
  channel -> pool replica -> engine.
- vLLM: HTTP -> vLLM's API server -> engine.

One baseline for both: the same request through vLLM's own OpenAI serving code in-process
(pools.vllm_engine.VllmEngine, what a pool replica runs), with no HTTP and no other process in
between. Added latency = percentile of a front's latencies minus the same percentile of the
baseline's, requests sent one at a time. Max requests/s: 32 clients in a closed loop for
`--seconds`, all through the front.

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
from orchestrator.gateway.tenancy import hash_key
from harness import deployed, remove
from machine import prioritise_client

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
MODEL_PATH = str(Path("~/.cache/tokenfab/models/tiny-llama").expanduser())
BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 1, "temperature": 0}
KEY = "bench-key"
ADMIN_KEY = "bench-admin-key"  # reads /tokenfab/replicas
CLIENTS = 32
VLLM_PORT = 8124
KV_CACHE_BYTES = 64 << 20
# The core tokenfab's one replica claims (pools.cores takes the lowest free one): the baseline and
# vLLM's server pin their engine to the same core, so the three differ only above the engine.
ENGINE_CORE = str(min(os.sched_getaffinity(0)))
TOPOLOGY = {
    "name": "bench-gateway",
    "model": {"name": "tiny", "path": MODEL_PATH, "generate": "tiny", "dtype": "bfloat16",
              "max_model_len": 2048},
    "engine_args": {"enforce_eager": True},
    "pools": [{"name": "main", "role": "unified", "replicas": 1, "max_ongoing_requests": 256,
               "resources": {"cpus": 1, "kv_cache_bytes": KV_CACHE_BYTES, "pin_cores": True}}],
    "gateway": {"host": "127.0.0.1", "port": 8013},
    "auth": {"enabled": True, "admin_keys": [hash_key(ADMIN_KEY)]},
    "tenants": [{"name": "bench", "api_keys": [hash_key(KEY)],
                 "limits": {"requests_per_minute": 10_000_000, "tokens_per_minute": 100_000_000,
                            "max_concurrent": 10_000, "max_prompt_tokens": 2048}}],
    "admission": {"max_in_flight": 256},
    "cluster": {"node_ip": "127.0.0.1", "address": "127.0.0.1:6391",
                "dashboard_url": "http://127.0.0.1:8279", "num_cpus": 2},
}


def _sequential(front: Any, count: int) -> list[float]:
    """Latencies (s) of `count` requests sent one at a time, after 20 warm-up requests."""
    for _ in range(20):
        front()
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        front()
        latencies.append(time.perf_counter() - started)
    return latencies


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


def _p(latencies: list[float], q: float) -> float:
    return float(np.percentile(latencies, q)) * 1000


def _record(target: str, fronts: list[float], baselines: list[float], rps: float,
            failed: int, replica: list[float] | None) -> dict[str, Any]:
    p = _p
    hops = {}
    if replica is not None:  # HTTP and gateway, then the replica's channel and serving code
        hops = {"gateway_p50_ms": round(p(fronts, 50) - p(replica, 50), 2),
                "replica_p50_ms": round(p(replica, 50) - p(baselines, 50), 2)}
    return hops | {"target": target,
            "added_p50_ms": round(p(fronts, 50) - p(baselines, 50), 2),
            "added_p99_ms": round(p(fronts, 99) - p(baselines, 99), 2),
            "max_rps": round(rps, 1),
            "front_p50_ms": round(p(fronts, 50), 2), "front_p99_ms": round(p(fronts, 99), 2),
            "baseline_p50_ms": round(p(baselines, 50), 2),
            "baseline_p99_ms": round(p(baselines, 99), 2),
            "failed_in_load": failed}


def tokenfab(count: int, seconds: float) -> tuple[list[float], float, int, list[float]]:
    """The gateway's latencies and max req/s, and the pool replica's own latencies: the same
    request sent on its data channel directly, as the gateway sends it (no HTTP, no gateway)."""
    topology = parse_topology(TOPOLOGY, "gateway benchmark")
    cluster.start_head(topology.cluster)
    try:
        root = deployed(topology)
        headers = {"authorization": f"Bearer {KEY}"}
        http = httpx.Client(trust_env=False, timeout=60)

        def front() -> None:
            response = http.post(f"{root}/v1/completions", json=BODY, headers=headers)
            assert response.status_code == 200, response.text

        fronts = _sequential(front, count)
        reports = http.get(f"{root}/tokenfab/replicas",
                           headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
        replica = _channel_direct(topology, reports[0], count)
        rps, failed = asyncio.run(_max_rps(f"{root}/v1/completions", headers, seconds))
        remove(topology)
    finally:
        cluster.stop_ray(topology.cluster.dashboard_url)
    return fronts, rps, failed, replica


def _channel_direct(topology: Any, report: dict[str, Any], count: int) -> list[float]:
    import ray

    from channel.client import ReplicaLink
    from channel.frames import Request
    from channel.secret import channel_secret

    ray.init(address=topology.cluster.address, log_to_driver=False, logging_level="ERROR")
    secret = channel_secret(topology.name)
    ray.shutdown()
    host, port = report["channel"].rsplit(":", 1)
    request = Request("completions", json.dumps(BODY).encode())

    async def run() -> list[float]:
        link = ReplicaLink(report["replica_id"], host, int(port), secret, "benchmark")
        await link.connect()
        latencies = []
        for i in range(count + 20):
            started = time.perf_counter()
            stream = link.open(request)
            assert (await stream.head).status == 200
            await stream.end
            if i >= 20:
                latencies.append(time.perf_counter() - started)
        link.close()
        return latencies

    return asyncio.run(run())


def _vllm_server() -> subprocess.Popen:
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": ENGINE_CORE, "VLLM_HOST_IP": "127.0.0.1"}
    return subprocess.Popen([
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL_PATH,
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(VLLM_PORT),
        "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enable-prefix-caching",
        "--disable-log-stats"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True)


def vllm(count: int, seconds: float) -> tuple[list[float], float, int, None]:
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

        fronts = _sequential(front, count)
        rps, failed = asyncio.run(_max_rps(f"{url}/v1/completions", {}, seconds))
    finally:
        server.terminate()
        server.wait(60)
    return fronts, rps, failed, None


def baseline(count: int) -> list[float]:
    """The engine behind vLLM's OpenAI serving code, in-process, in a process of its own."""
    result = subprocess.run([sys.executable, __file__, "--in-process-baseline", str(count)],
                            capture_output=True, text=True, timeout=900,
                            env=os.environ | {"VLLM_CPU_OMP_THREADS_BIND": ENGINE_CORE})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


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
        "percentile minus the baseline's, the same baseline for both fronts (the engine behind "
        "vLLM's OpenAI serving code, in-process, no HTTP), from requests sent one at a time; max "
        f"req/s from {CLIENTS} closed-loop clients. tokenfab's path includes API-key auth, tenant "
        "limits, the fair queue and the routing key. The client runs in a scheduling group of "
        "its own at nice -10 and each front in a session of its own (`prioritise_client` in "
        "machine.py).", "",
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
    if "tokenfab" in by:
        t = by["tokenfab"]
        lines += ["", "Where tokenfab's added p50 goes, by hop (the replica measured on its data "
                  "channel directly, as the gateway calls it): HTTP and gateway "
                  f"{t['gateway_p50_ms']:.2f} ms, pool replica (channel and serving code) "
                  f"{t['replica_p50_ms']:.2f} ms."]
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
    scheduling = prioritise_client(-10)  # as h2h.py: the stacks do not starve the client
    print(f"scheduling: {scheduling}")
    print("baseline: the engine in-process")
    baselines = baseline(args.requests)
    records = []
    for name, run in (("tokenfab", tokenfab), ("vllm", vllm)):
        print(f"{name}: measuring")
        fronts, rps, failed, replica = run(args.requests, args.seconds)
        records.append(_record(name, fronts, baselines, rps, failed, replica))
        print(json.dumps(records[-1]))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway.json").write_text(json.dumps({"records": records}, indent=2))
    (RESULTS / "gateway.md").write_text(markdown(records, args.requests, args.seconds))
    print(markdown(records, args.requests, args.seconds))


if __name__ == "__main__":
    main()
