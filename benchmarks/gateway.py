"""Gateway overhead: tokenfab's multi-tenant gateway against vLLM's own OpenAI server, one run.

Both fronts stand before the same engine (the tiny model, one pinned core, eager) and answer the
same near-trivial request (a 2-token prompt, 1 output token), so what differs is the layer above
the engine:

- tokenfab, gateway in a process of its own (the default): HTTP -> gateway (API key, tenant
  limits, fair queue, KV-aware routing key) -> data channel -> pool replica -> engine.
- tokenfab, gateway colocated (`gateway.colocate`): HTTP -> the pool replica's own gateway (the
  same checks) -> a call -> the same replica's serving code -> engine.
- vLLM: HTTP -> vLLM's API server -> engine.

One baseline for both: the same request through vLLM's own OpenAI serving code in-process
(pools.vllm_engine.VllmEngine, what a pool replica runs), with no HTTP and no other process in
between. Added latency = percentile of a front's latencies minus the same percentile of the
baseline's, requests sent one at a time. Max requests/s: 32 clients in a closed loop for
`--seconds`, all through the front.

The two tokenfab setups are measured one after the other, in a phase each (their one replica
claims the same core, so they cannot run at once). In a phase, the baseline, vLLM's server,
tokenfab (and its pool replica's data channel, called directly) run side by side and are
measured in interleaved rounds, so that a machine whose speed drifts during the run (this one's
moves by 2x within minutes) moves them all alike; each phase has its own baseline and vLLM
figures, and its ratio is taken within it. Each round of a target starts with
`WARM_S` of requests that are not counted: the engine served before it stops polling its
queue (vLLM's worker spins for 1 s after its last message, on the same core) and this one
wakes up.

    .venv/bin/python benchmarks/gateway.py [--requests 300] [--seconds 20]

Writes benchmarks/results/gateway.json and gateway.md, the page rendered from the JSON alone
(`markdown`), which records the arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a loopback single-node cluster

from benchmarks.common.cluster import TINY_MODEL, deployed, local_head, remove, tiny_model_dir
from benchmarks.common.machine import prioritise_client
from benchmarks.common.results import RESULTS, write
from orchestrator import cluster
from orchestrator.config import parse_topology
from orchestrator.gateway.tenancy import hash_key
from tokenfab.stats import percentile

MODEL_PATH = str(tiny_model_dir())
BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 1, "temperature": 0}
KEY = "bench-key"
ADMIN_KEY = "bench-admin-key"  # reads /tokenfab/replicas
CLIENTS = 32
ROUNDS = 5  # sequential requests: each target's count in this many interleaved rounds
RPS_ROUNDS = 2  # max req/s: `--seconds` split into this many interleaved rounds per front
WARM_S = 1.5  # uncounted requests at the start of every round (see the module's docstring)
VLLM_PORT = 8124
KV_CACHE_BYTES = 64 << 20
# The core tokenfab's one replica claims (pools.cores takes the lowest free one): the baseline and
# vLLM's server pin their engine to the same core, so the three differ only above the engine.
ENGINE_CORE = str(min(os.sched_getaffinity(0)))
PHASES = {"gateway process": False, "colocated": True}  # phase -> gateway.colocate
TOPOLOGY = {
    "name": "bench-gateway",
    "model": TINY_MODEL | {"path": MODEL_PATH},
    "engine_args": {"enforce_eager": True},
    "pools": [{"name": "main", "role": "unified", "replicas": 1, "max_ongoing_requests": 256,
               "resources": {"cpus": 1, "kv_cache_bytes": KV_CACHE_BYTES, "pin_cores": True}}],
    "gateway": {"host": "127.0.0.1", "port": 8013},
    "auth": {"enabled": True, "admin_keys": [hash_key(ADMIN_KEY)]},
    "tenants": [{"name": "bench", "api_keys": [hash_key(KEY)],
                 "limits": {"requests_per_minute": 10_000_000, "tokens_per_minute": 100_000_000,
                            "max_concurrent": 10_000, "max_prompt_tokens": 2048}}],
    "admission": {"max_in_flight": 256},
    "cluster": local_head(6391, 8279),
}


def _sequential(front: Callable[[], None], count: int) -> list[float]:
    """Latencies (s) of `count` requests sent one at a time, after `WARM_S` of uncounted ones."""
    until = time.monotonic() + WARM_S
    while time.monotonic() < until:
        front()
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        front()
        latencies.append(time.perf_counter() - started)
    return latencies


async def _sequential_async(one: Callable[[], Awaitable[None]], count: int) -> list[float]:
    """`_sequential` for a front that is a coroutine (the channel, the in-process engine)."""
    until = time.monotonic() + WARM_S
    while time.monotonic() < until:
        await one()
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        await one()
        latencies.append(time.perf_counter() - started)
    return latencies


async def _max_rps(url: str, headers: dict[str, str], seconds: float) -> tuple[int, float, int]:
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
    return done, elapsed, failed


def _p(latencies: list[float], q: float) -> float:
    return percentile(latencies, q) * 1000


def _record(target: str, fronts: list[float], baselines: list[float], rps: float,
            failed: int, replica: list[float] | None, colocated: bool = False
            ) -> dict[str, Any]:
    """`replica`: the pool replica's channel called directly. Behind a gateway process that is
    the front's second hop, so the front's time splits into HTTP and gateway, then the replica;
    a colocated front takes no channel, so its time does not split that way (the channel's own
    cost over the baseline is still recorded)."""
    p = _p
    hops = {}
    if replica is not None and not colocated:
        hops = {"gateway_p50_ms": round(p(fronts, 50) - p(replica, 50), 2),
                "replica_p50_ms": round(p(replica, 50) - p(baselines, 50), 2)}
    elif replica is not None:
        hops = {"channel_added_p50_ms": round(p(replica, 50) - p(baselines, 50), 2)}
    return hops | {"target": target,
            "added_p50_ms": round(p(fronts, 50) - p(baselines, 50), 2),
            "added_p99_ms": round(p(fronts, 99) - p(baselines, 99), 2),
            "max_rps": round(rps, 1),
            "front_p50_ms": round(p(fronts, 50), 2), "front_p99_ms": round(p(fronts, 99), 2),
            "baseline_p50_ms": round(p(baselines, 50), 2),
            "baseline_p99_ms": round(p(baselines, 99), 2),
            "failed_in_load": failed}


class Tokenfab:
    """The deployment, its gateway as a front, and its pool replica's data channel called
    directly, as a gateway in another process calls it (no HTTP, no gateway)."""

    def __init__(self, colocate: bool) -> None:
        self.colocate = colocate
        document = TOPOLOGY | {"gateway": TOPOLOGY["gateway"] | {"colocate": colocate}}
        self.topology = parse_topology(document, "gateway benchmark")
        cluster.start_head(self.topology.cluster)
        try:
            self.root = deployed(self.topology)
            self.url = f"{self.root}/v1/completions"
            self.headers = {"authorization": f"Bearer {KEY}"}
            self._http = httpx.Client(trust_env=False, timeout=60)
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, daemon=True).start()
            self._link = self._call(self._connect(self._replica_report()))
        except BaseException:
            cluster.stop_ray(self.topology.cluster.dashboard_url)
            raise

    def front(self) -> None:
        response = self._http.post(self.url, json=BODY, headers=self.headers)
        assert response.status_code == 200, response.text

    def channel(self, count: int) -> list[float]:
        return self._call(self._channel(count))

    def close(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._link.close)  # the link lives on that loop
            self._loop.call_soon_threadsafe(self._loop.stop)
            remove(self.topology)
        finally:
            cluster.stop_ray(self.topology.cluster.dashboard_url)

    def _replica_report(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The pool replica's registry report, once it carries its data channel's address
        (a replica reports it a little after Serve calls it running)."""
        deadline = time.monotonic() + timeout_s
        while True:
            reports = self._http.get(f"{self.root}/tokenfab/replicas",
                                     headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
            if reports and reports[0].get("channel"):
                return reports[0]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no replica reported its channel: {reports}")
            time.sleep(0.5)

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _connect(self, report: dict[str, Any]) -> Any:
        import ray

        from channel.client import ReplicaLink
        from channel.secret import channel_secret

        ray.init(address=self.topology.cluster.address, log_to_driver=False,
                 logging_level="ERROR")
        secret = channel_secret(self.topology.name)
        ray.shutdown()
        host, port = report["channel"].rsplit(":", 1)
        link = ReplicaLink(report["replica_id"], host, int(port), secret, "benchmark")
        await link.connect()
        return link

    async def _channel(self, count: int) -> list[float]:
        from channel.frames import Request

        request = Request("completions", json.dumps(BODY).encode())

        async def one() -> None:
            stream = self._link.open(request)
            assert (await stream.head).status == 200
            await stream.end

        return await _sequential_async(one, count)


class VllmServer:
    """vLLM's own OpenAI server before the same engine settings, on the same core. Its engine
    statistics stay on (vLLM's default), as in the baseline and in tokenfab's replicas, which
    export them: each engine step records them in all three (until commit 9b33cf4 this server ran
    with `--disable-log-stats`, the one of the three that did not)."""

    def __init__(self) -> None:
        env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": ENGINE_CORE, "VLLM_HOST_IP": "127.0.0.1"}
        self._server = subprocess.Popen([
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL_PATH,
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(VLLM_PORT),
            "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enable-prefix-caching"],
            env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.url, self.headers = f"http://127.0.0.1:{VLLM_PORT}/v1/completions", {}
        self._http = httpx.Client(trust_env=False, timeout=60)
        deadline = time.monotonic() + 600
        while True:
            try:
                if self._http.get(f"http://127.0.0.1:{VLLM_PORT}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self._server.poll() is not None:
                self.close()
                raise RuntimeError("vLLM's API server did not start")
            time.sleep(2)

    def front(self) -> None:
        response = self._http.post(self.url, json=BODY)
        assert response.status_code == 200, response.text

    def close(self) -> None:
        self._server.terminate()
        self._server.wait(60)


class Baseline:
    """The engine behind vLLM's OpenAI serving code, in-process, in a process of its own that
    measures rounds on request (a line `count` on its stdin, latencies as JSON on its stdout)."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, __file__, "--in-process-baseline"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, start_new_session=True,
            env=os.environ | {"VLLM_CPU_OMP_THREADS_BIND": ENGINE_CORE})
        line = self._reply()
        assert line == "ready", line

    def measure(self, count: int) -> list[float]:
        self._process.stdin.write(f"{count}\n")
        self._process.stdin.flush()
        return json.loads(self._reply())

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.write("0\n")
            self._process.stdin.flush()
            self._process.wait(60)

    def _reply(self) -> str:
        while True:  # vLLM may print to stdout as well; ours are the lines it cannot print
            line = self._process.stdout.readline()
            if not line:
                raise RuntimeError(f"the baseline process ended ({self._process.wait()})")
            line = line.strip()
            if line == "ready" or line.startswith("["):
                return line


def in_process_baseline() -> None:
    """Serve measurement rounds of the engine behind vLLM's OpenAI serving code, in-process."""
    from pools.engine import EngineSpec
    from pools.vllm_engine import VllmEngine

    async def run() -> None:
        engine = VllmEngine(EngineSpec(
            model_path=MODEL_PATH, model_name="tiny", dtype="bfloat16", max_model_len=2048,
            kv_cache_bytes=KV_CACHE_BYTES, engine_args={"enforce_eager": True}))
        await engine.start()

        async def one() -> None:
            async for _ in engine.reply("completions", dict(BODY)):
                pass

        print("ready", flush=True)
        while (count := int(await asyncio.to_thread(sys.stdin.readline) or 0)) > 0:
            print(json.dumps(await _sequential_async(one, count)), flush=True)
        engine.shutdown()

    asyncio.run(run())


def measure(count: int, seconds: float) -> list[dict[str, Any]]:
    """Start the baseline and vLLM's server, then each tokenfab setup in turn beside them."""
    started: list[Any] = []
    records = []
    try:
        print("starting: the baseline engine, vLLM's server")
        baseline = Baseline()
        started.append(baseline)
        vllm = VllmServer()
        started.append(vllm)
        for phase, colocate in PHASES.items():
            print(f"phase {phase}: starting tokenfab")
            tokenfab = Tokenfab(colocate)
            try:
                records += [record | {"phase": phase}
                            for record in _phase(baseline, vllm, tokenfab, count, seconds)]
            finally:
                tokenfab.close()
    finally:
        for part in reversed(started):
            part.close()
    return records


def _phase(baseline: Baseline, vllm: VllmServer, tokenfab: Tokenfab, count: int,
           seconds: float) -> list[dict[str, Any]]:
    """The three side by side in interleaved rounds (see the module's docstring)."""
    per_round = max(1, count // ROUNDS)
    series: dict[str, list[float]] = {"baseline": [], "tokenfab": [], "channel": [], "vllm": []}
    steps = [("baseline", lambda: baseline.measure(per_round)),
             ("tokenfab", lambda: _sequential(tokenfab.front, per_round)),
             ("channel", lambda: tokenfab.channel(per_round)),
             ("vllm", lambda: _sequential(vllm.front, per_round))]
    for i in range(ROUNDS):  # each round in another order: none always follows the same one
        for name, step in steps[i % len(steps):] + steps[:i % len(steps)]:
            series[name] += step()
        print(f"round {i + 1} of {ROUNDS}: " + ", ".join(
            f"{name} p50 {_p(values, 50):.2f} ms" for name, values in series.items()))
    load = {"tokenfab": [0, 0.0, 0], "vllm": [0, 0.0, 0]}  # done, seconds, failed
    for i in range(RPS_ROUNDS):
        fronts = [("tokenfab", tokenfab), ("vllm", vllm)]
        for name, front in fronts[::-1] if i % 2 else fronts:
            _sequential(front.front, 0)  # warm only
            done, elapsed, failed = asyncio.run(
                _max_rps(front.url, front.headers, seconds / RPS_ROUNDS))
            load[name][0] += done
            load[name][1] += elapsed
            load[name][2] += failed
    return [_record(name, series[name], series["baseline"], load[name][0] / load[name][1],
                    load[name][2], series["channel"] if name == "tokenfab" else None,
                    tokenfab.colocate)
            for name in ("tokenfab", "vllm")]


def markdown(result: dict[str, Any]) -> str:
    args, records = result["args"], result["records"]
    lines = [
        "# Gateway overhead", "",
        f"`python benchmarks/gateway.py --requests {args['requests']} --seconds "
        f"{args['seconds']:g}`: the tiny model "
        "on one pinned core, a 2-token prompt and 1 output token; added latency is the front's "
        "percentile minus the baseline's, the same baseline for both fronts (the engine behind "
        "vLLM's OpenAI serving code, in-process, no HTTP), from requests sent one at a time; max "
        f"req/s from {CLIENTS} closed-loop clients. tokenfab's path includes API-key auth, tenant "
        "limits, the fair queue and the routing key. Two phases, one per tokenfab setup: its "
        "gateway in a process of its own (the default), and served by the pool replica itself "
        "(`gateway.colocate`). In each, the baseline, both fronts and the pool replica's data "
        f"channel run side by side and are measured in {ROUNDS} interleaved rounds (max req/s: "
        f"{RPS_ROUNDS}), each round after {WARM_S:g} s of uncounted requests, so that drift in "
        "the machine's speed moves all alike. The client runs in a scheduling group of its own "
        f"at nice {result['scheduling']['client_nice']} and each front in a session of its own "
        "(`prioritise_client` in machine.py).",
        "",
        "| phase | target | added p50 (ms) | added p99 (ms) | max req/s | front p50 / p99 (ms) | "
        "baseline p50 / p99 (ms) | failed under load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(f"| {r['phase']} | {r['target']} | {r['added_p50_ms']:.2f} | "
                     f"{r['added_p99_ms']:.2f} | {r['max_rps']:.1f} | "
                     f"{r['front_p50_ms']:.2f} / {r['front_p99_ms']:.2f} | "
                     f"{r['baseline_p50_ms']:.2f} / {r['baseline_p99_ms']:.2f} | "
                     f"{r['failed_in_load']} |")
    for phase in PHASES:
        by = {r["target"]: r for r in records if r["phase"] == phase}
        if {"tokenfab", "vllm"} > by.keys():
            continue
        t, v = by["tokenfab"], by["vllm"]
        line = (f"{phase}: tokenfab/vLLM added p50 {t['added_p50_ms'] / v['added_p50_ms']:.2f}, "
                f"max req/s {t['max_rps'] / v['max_rps']:.2f}.")
        if "gateway_p50_ms" in t:
            line += (" Where tokenfab's added p50 goes (the replica measured on its data channel "
                     f"directly): HTTP and gateway {t['gateway_p50_ms']:.2f} ms, pool replica "
                     f"(channel and serving code) {t['replica_p50_ms']:.2f} ms.")
        elif "channel_added_p50_ms" in t:
            line += (" The replica answers its own HTTP requests by a call, so no hop splits this "
                     "path; its data channel, called from another process as a gateway process "
                     f"would, adds {t['channel_added_p50_ms']:.2f} ms over the baseline.")
        lines += ["", line]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--in-process-baseline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process_baseline:
        in_process_baseline()
        return
    scheduling = prioritise_client(-10)  # as h2h.py: the stacks do not starve the client
    print(f"scheduling: {scheduling}")
    records = measure(args.requests, args.seconds)
    for record in records:
        print(json.dumps(record))
    print(write(RESULTS / "gateway.json",
                {"args": vars(args), "scheduling": scheduling, "records": records}, markdown))


if __name__ == "__main__":
    main()
