"""Autoscaling on a bursty load (quiet, burst, quiet) against real engines, four setups, one run.

One unified pool of the tiny model (at most 2 replicas on this machine) serves the same open-loop
arrival pattern under:

- autoscaler: tokenfab's policy, 1..2 replicas, with its plan (`autoscaler.capacity_rps`,
  `--capacity-rps`: the requests/s one replica serves within the SLO here);
- static_min: 1 replica; static_max: 2 replicas;
- ray_default: Ray Serve's own ongoing-requests autoscaling, 1..2 replicas, its default delays.

Requests are streamed (a 64-token prompt, 64 output tokens). A request meets the SLO when its TTFT
is at most --ttft-slo and its mean inter-token gap at most --itl-slo; failures miss it.
Replica-seconds integrate the pool's running replicas (Serve's view, polled every second) over
the run.

The client runs in a scheduling group of its own at nice -10 (`machine.prioritise_client`, as
h2h.py's), or the spinning engines starve it and its own delays count as the system's; each record
says how long it still waited for a CPU (`client_waited_s`).

Each engine gets `--engine-share` of a core (benchmarks/common/engine_share.py, a CPU cgroup
quota), so a replica adds a fixed quantum of compute as an accelerator does and the front-ends
keep the rest of the machine; `--engine-share 0` leaves engines uncapped (on 2 cores a second
engine then starves the front-ends, see docs/autoscaling.md).

    .venv/bin/python benchmarks/autoscaling.py [--quiet-rps 0.25 --burst-rps 7 --phases 60,240,120]

Writes benchmarks/results/autoscaler.json, autoscaler.md and autoscaler.png (`--name`); the page
is rendered from the JSON alone (`markdown`), which records the arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common.client import one_request
from benchmarks.common.cluster import deployed, local_head, remove, tiny_topology
from benchmarks.common.engine_share import EngineShare
from benchmarks.common.machine import prioritise_client, waited_for_cpu_s
from benchmarks.common.results import RESULTS, write
from orchestrator import cluster, deploy
from orchestrator.config import Topology
from tokenfab.stats import percentile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
SETUPS = ["autoscaler", "static_min", "static_max", "ray_default"]
PROMPT_WORDS = 40
OUTPUT_TOKENS = 64


def topology(setup: str, capacity_rps: float = 0.0) -> Topology:
    pool: dict[str, Any] = {"name": "main", "role": "unified", "max_ongoing_requests": 64,
                            "resources": {"cpus": 1, "kv_cache_bytes": "128MiB"}}
    autoscaler: dict[str, Any] = {"enabled": setup in ("autoscaler", "ray_default"),
                                  "ttft_p90_s": 1.0, "itl_p90_s": 0.2,
                                  # one replica serves ~30 streams within the targets here
                                  "target_ongoing_requests": 32, "max_waiting_per_replica": 4,
                                  "downscale_delay_s": 20}
    if setup == "autoscaler":
        autoscaler |= {"capacity_rps": capacity_rps}
    if setup == "ray_default":
        autoscaler |= {"policy": "ray_requests", "target_ongoing_requests": 2}  # Serve's default
    pool |= {"replicas": 2 if setup == "static_max" else 1,
             "min_replicas": 1, "max_replicas": 2 if setup != "static_min" else 1}
    return tiny_topology(f"scale-{setup.replace('_', '-')}", [pool], autoscaler=autoscaler,
                         gateway={"port": 8015, "request_timeout_s": 120},
                         cluster=local_head(6391, 8279))


def arrivals(phases: list[tuple[float, float]], seed: int = 0) -> list[float]:
    """Poisson arrival times (s) for consecutive (seconds, requests/s) phases."""
    rng, times, start = random.Random(seed), [], 0.0
    for seconds, rps in phases:
        t = start
        while True:
            t += rng.expovariate(rps)
            if t >= start + seconds:
                break
            times.append(t)
        start += seconds
    return times


async def _one(client: httpx.AsyncClient, index: int, at: float, out: list) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    words = " ".join(f"w{(index * 31 + i) % 500}" for i in range(PROMPT_WORDS))
    body = {"model": "tiny", "prompt": f"request {index}: {words}", "max_tokens": OUTPUT_TOKENS,
            "ignore_eos": True, "stream": True}
    r = await one_request(client, body)
    out.append({"sent": r["sent"], "stamps": [r["sent"] + at for at, _ in r["chunks"]],
                "status": r["status"]})


async def _replicas(topology: Topology, until: float, out: list) -> None:
    client = deploy.ServeClient(topology.cluster.dashboard_url)
    while time.monotonic() < until:
        app = await asyncio.to_thread(client.application, topology.name) or {}
        replicas = ((app.get("deployments") or {}).get("pool-main") or {}).get("replicas") or []
        out.append((time.monotonic(), sum(r["state"] == "RUNNING" for r in replicas)))
        await asyncio.sleep(1.0)


async def run(topology: Topology, root: str, times: list[float]) -> dict[str, Any]:
    requests: list[dict] = []
    replicas: list[tuple[float, int]] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=root, timeout=300, trust_env=False,
                                 limits=limits) as client:
        await client.post("/v1/completions",
                          json={"model": "tiny", "prompt": "warm", "max_tokens": 2})
        start = time.monotonic() + 1.0
        end = start + times[-1] + 1.0
        tracker = asyncio.create_task(_replicas(topology, end + 60, replicas))
        waited = waited_for_cpu_s()
        await asyncio.gather(*(_one(client, i, start + t, requests) for i, t in enumerate(times)))
        waited = waited_for_cpu_s() - waited
        tracker.cancel()
    return {"start": start, "end": end, "requests": requests, "replicas": replicas,
            "client_waited_s": waited}


def summarize(setup: str, load: dict[str, Any], ttft_slo: float, itl_slo: float) -> dict[str, Any]:
    met, ttfts, itls = 0, [], []
    for r in load["requests"]:
        stamps = r["stamps"]
        if r["status"] != 200 or not stamps:
            continue
        ttft = stamps[0] - r["sent"]
        itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
        ttfts.append(ttft)
        itls.append(itl)
        met += ttft <= ttft_slo and itl <= itl_slo
    samples = [(t, n) for t, n in load["replicas"] if load["start"] <= t <= load["end"]]
    seconds = sum((b[0] - a[0]) * a[1] for a, b in zip(samples, samples[1:]))
    q = percentile
    return {"setup": setup, "slo_attainment": round(met / len(load["requests"]), 3),
            "replica_seconds": round(seconds, 1), "requests": len(load["requests"]),
            "failed": sum(r["status"] != 200 for r in load["requests"]),
            "ttft_p50_s": round(q(ttfts, 50), 3), "ttft_p90_s": round(q(ttfts, 90), 3),
            "itl_p90_s": round(q(itls, 90), 4), "max_replicas_seen": max(n for _, n in samples),
            "client_waited_s": round(load["client_waited_s"], 1)}


def plot(loads: dict[str, dict[str, Any]], path: Path, phases: list[tuple[float, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for setup, load in loads.items():
        start = load["start"]
        top.step([t - start for t, _ in load["replicas"]], [n for _, n in load["replicas"]],
                 where="post", label=setup)
        done = sorted((r["sent"] - start, r["stamps"][0] - r["sent"])
                      for r in load["requests"] if r["stamps"])
        xs, ys = [d[0] for d in done], [d[1] for d in done]
        window = 15
        smooth = [percentile(ys[max(0, i - window):i + 1], 90) for i in range(len(ys))]
        bottom.plot(xs, smooth, label=setup)
    edge = 0.0
    for seconds, _ in phases[:-1]:
        edge += seconds
        for axis in (top, bottom):
            axis.axvline(edge, color="grey", linestyle=":")
    top.set_ylabel("running replicas")
    bottom.set_ylabel("TTFT p90, last 15 requests (s)")
    bottom.set_xlabel("seconds since the load started")
    bottom.set_yscale("log")
    top.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict[str, Any]) -> str:
    a, records = argparse.Namespace(**result["args"]), result["records"]
    lines = [
        "# Autoscaling on a bursty load", "",
        f"`python benchmarks/autoscaling.py --phases {a.phases} --quiet-rps {a.quiet_rps} "
        f"--burst-rps {a.burst_rps} --engine-share {a.engine_share:g}`: Poisson arrivals, "
        f"quiet / burst / quiet; each request a {PROMPT_WORDS}-word prompt and {OUTPUT_TOKENS} "
        f"streamed tokens; SLO: TTFT <= {a.ttft_slo:g} s and mean inter-token gap <= "
        f"{a.itl_slo:g} s. Tiny model; each engine capped at {a.engine_share:g} of a core "
        f"(`--engine-share`, 0 = uncapped). autoscaler plans with `capacity_rps: "
        f"{a.capacity_rps:g}` (requests/s per replica). The client runs in a scheduling group "
        f"of its own at nice {result['scheduling']['client_nice']} (`prioritise_client` in "
        "machine.py); client waited: the seconds it was ready to run but waited for a CPU "
        f"during the load. Plot: {a.name}.png.", "",
        "| setup | SLO attainment | replica-seconds | requests | failed | TTFT p50 / p90 (s) | "
        "ITL p90 (s) | max replicas | client waited (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(f"| {r['setup']} | {r['slo_attainment']:.3f} | {r['replica_seconds']:.0f} | "
                     f"{r['requests']} | {r['failed']} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p90_s']:.2f} | {r['itl_p90_s']:.3f} | {r['max_replicas_seen']} | "
                     f"{r['client_waited_s']:.1f} |")
    by = {r["setup"]: r for r in records}
    if {"autoscaler", "static_max"} <= by.keys():
        a, m = by["autoscaler"], by["static_max"]
        lines += ["", f"autoscaler / static_max: attainment {a['slo_attainment']:.3f} vs "
                  f"{m['slo_attainment']:.3f}, replica-seconds ratio "
                  f"{a['replica_seconds'] / m['replica_seconds']:.2f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", default="60,240,120", help="quiet,burst,quiet seconds")
    parser.add_argument("--quiet-rps", type=float, default=0.25)
    parser.add_argument("--burst-rps", type=float, default=7.0)
    parser.add_argument("--ttft-slo", type=float, default=1.0)
    parser.add_argument("--itl-slo", type=float, default=0.2)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--engine-share", type=float, default=0.15,
                        help="share of a core each engine may use (0: uncapped)")
    parser.add_argument("--name", default="autoscaler", help="results/<name>.{json,md,png}")
    parser.add_argument("--capacity-rps", type=float, default=3.5,
                        help="the autoscaler's plan: requests/s one replica serves within the SLO "
                        "(3.5: static_max served 7 req/s on 2 replicas, all within it)")
    parser.add_argument("--client-nice", type=int, default=-10,
                        help="the client's scheduling priority (see machine.prioritise_client)")
    args = parser.parse_args()
    scheduling = prioritise_client(args.client_nice)
    quiet, burst, after = (float(x) for x in args.phases.split(","))
    phases = [(quiet, args.quiet_rps), (burst, args.burst_rps), (after, args.quiet_rps)]
    times = arrivals(phases)
    cluster.start_head(topology("static_min").cluster)
    records, loads = [], {}
    share = (EngineShare(args.engine_share, topology("static_min").cluster.dashboard_url)
             if args.engine_share > 0 else contextlib.nullcontext())
    try:
        with share:
            for setup in args.setups.split(","):
                t = topology(setup, args.capacity_rps)
                print(f"{setup}: deploying")
                root = deployed(t)
                loads[setup] = asyncio.run(run(t, root, times))
                records.append(summarize(setup, loads[setup], args.ttft_slo, args.itl_slo))
                print(json.dumps(records[-1]))
                remove(t)
    finally:
        cluster.stop_ray(topology("static_min").cluster.dashboard_url)
    result = {"args": vars(args), "records": records, "scheduling": scheduling}
    page = write(RESULTS / f"{args.name}.json", result, markdown)
    plot(loads, RESULTS / f"{args.name}.png", phases)  # from the raw loads, which the JSON lacks
    print(page)


if __name__ == "__main__":
    main()
