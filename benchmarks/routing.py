"""Routing policies on Mooncake's public trace, against real engines, in one run.

Two unified replicas of the tiny model (one core each, small KV caches so capacity matters)
serve a replay of `../shared/traces/synthetic_trace.jsonl`. The trace is sampled by conversation
root (every request whose first block belongs to a seeded random 6% of roots, in trace order), so
all prefix sharing among the sampled requests is kept; each 512-token block id becomes 32 fixed
single-token words, prompts are capped at 60 blocks (1,920 tokens), outputs at 1/8 of the trace's
(1..32 tokens). Arrival times are the trace's, rescaled to each target rate: a light one (1 req/s,
the replicas mostly idle), a middle one (10) and saturation (30: the best policies deliver just
under the offered tokens). A high rate replays the sample several times, each with cold caches,
so each rate measures at least a minute of arrivals. Every policy gets a fresh deployment,
warmed up with a few requests in words no replay uses; every rate gets its own word mapping, so
each run starts with cold caches. The client runs at a higher priority than the stack it
measures (`machine.prioritise_client`), and each record reports how late it sent its requests.

Hit rates are shown against three bounds: the infinite cache shared by all replicas, one LRU
prefix cache the size of one replica's (every request on one engine), and one LRU the size of
both (the most two caches can give if placement never holds a block twice).

    .venv/bin/python benchmarks/routing.py [--rates 1,10,30] [--policies kv_aware,round_robin]

Writes benchmarks/results/routing.json, routing.md and routing_ttft.png; the page is rendered
from the JSON alone (`markdown`), which records the arguments and the sample's size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import numpy as np

from benchmarks.common.client import one_request
from benchmarks.common.cluster import deployed, local_head, remove, tiny_topology
from benchmarks.common.machine import prioritise_client
from benchmarks.common.results import RESULTS, TRACE, write
from benchmarks.common.traces import (BLOCK_TOKENS, Prompts, arrival_offsets, lru_hit_rate,
                                      sample_by_root, single_token_words, upper_bound_hit_rate)
from orchestrator import cluster
from orchestrator.config import Topology
from tokenfab.stats import percentile

POLICIES = ["round_robin", "least_loaded", "prefix_approx", "kv_aware"]
ROOT_SHARE, SAMPLE_SEED = 0.06, 0
WARM_UP_REQUESTS = 16
CLUSTER = local_head(6392, 8277)


def topology(policy: str, kv_cache: str, weights: dict[str, float] | None = None) -> Topology:
    return tiny_topology(
        f"route-{policy.replace('_', '-')}",
        [{"name": "main", "role": "unified", "replicas": 2, "max_ongoing_requests": 256,
          "resources": {"cpus": 1, "kv_cache_bytes": kv_cache, "pin_cores": True}}],
        router={"policy": policy} | ({"weights": weights} if weights else {}),
        gateway={"port": 8021}, cluster=CLUSTER, block_size=BLOCK_TOKENS)


async def timed_request(client: httpx.AsyncClient, body: dict[str, Any], out: list,
                        due: float) -> None:
    r = await one_request(client, body, "/completions")
    out.append({"sent": r["sent"], "lag": r["sent"] - due,
                "ttft": r["chunks"][0][0] if r["chunks"] else None, "replica": r["replica"] or "",
                "done": r["done"], "status": r["status"], "usage": r["usage"], "error": r["error"]})


async def replay(base_url: str, requests: list[dict[str, Any]], prompts: Prompts,
                 rate: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, trust_env=False,
                                 limits=limits) as client:
        began, tasks = time.monotonic(), []
        for row, offset in zip(requests, arrival_offsets(requests, rate)):
            at = began + offset
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            body = {"model": "tiny", "prompt": prompts.prompt(row), "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True,
                    "max_tokens": max(1, min(32, row["output_length"] // 8)), "temperature": 0}
            tasks.append(asyncio.create_task(timed_request(client, body, out, at)))
        await asyncio.gather(*tasks)
    return out


def warm_up(base_url: str, requests: list[dict[str, Any]], words: list[str]) -> dict[str, int]:
    """Requests of the trace's shapes in words no replay uses, before any is measured: a fresh
    engine's first prefills take seconds (measured: TTFT about 3 s for the first ~3 s of a
    replay), which would land on whichever rate runs first. Returns requests per replica."""
    results = asyncio.run(replay(base_url, requests[:WARM_UP_REQUESTS], Prompts(words, 10_000),
                                 rate=4.0))
    bad = [r for r in results if r["status"] != 200 or r["ttft"] is None]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]['status']} {bad[0]['error']}")
    return dict(Counter(r["replica"] for r in results))


def sweep(specs: dict[str, Topology], requests: list[dict[str, Any]], words: list[str],
          rates: list[float], result: dict[str, Any], capacity_key: str,
          capacity: Callable[[str], int]) -> Iterator[tuple[str, str, int, float]]:
    """Each topology in turn on a local head of its own: deployed, the sample's hit-rate bounds
    put in `result` for the first one's cache (`capacity(gateway)` blocks, under
    `capacity_key`), warmed up; then (name, gateway, rate index, rate) for each rate, which the
    caller replays (`replay_rate`) and records. Removed after its rates; the head stops at the
    end."""
    cluster.start_head(next(iter(specs.values())).cluster)
    try:
        for name, spec in specs.items():
            print(f"{name}: deploying")
            gateway = deployed(spec)
            if capacity_key not in result:
                blocks = result[capacity_key] = capacity(gateway)
                result["single_lru_hit_rate"] = lru_hit_rate(requests, blocks)
                result["two_cache_hit_rate"] = lru_hit_rate(requests, 2 * blocks)
            print(f"{name}: warm-up, requests per replica "
                  f"{warm_up(f'{gateway}/v1', requests, words)}")
            for index, rate in enumerate(rates):
                yield name, gateway, index, rate
            remove(spec)
    finally:
        cluster.stop_ray(next(iter(specs.values())).cluster.dashboard_url)


def replay_rate(gateway: str, requests: list[dict[str, Any]], words: list[str], index: int,
                rate: float, min_replay_s: float) -> list[dict[str, Any]]:
    """The sample replayed at `rate` for at least `min_replay_s` (see `replays`), each replay
    in words of its own (cold caches); one row per request, numbered by replay."""
    results = []
    for repeat in range(replays(len(requests), rate, min_replay_s)):
        prompts = Prompts(words, 1 + index * 100 + repeat)
        for row in asyncio.run(replay(f"{gateway}/v1", requests, prompts, rate)):
            results.append(row | {"replay": repeat})
    return results


def replays(requests: int, rate: float, min_replay_s: float) -> int:
    """How many times to replay the sample at `rate` so that at least `min_replay_s` of arrivals
    are measured: one short replay at a high rate is a few seconds of queueing, too few to give
    a stable p90. Example: 262 requests, 60 s -> 1 at 1 req/s, 3 at 10 req/s, 7 at 30 req/s."""
    return max(1, math.ceil(min_replay_s * rate / requests))


def summarize(policy: str, rate: float, results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == 200 and r["ttft"] is not None]
    ttft = np.array([r["ttft"] for r in ok])
    prompt = sum(r["usage"].get("prompt_tokens", 0) for r in ok)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                 for r in ok)
    output = sum(r["usage"].get("completion_tokens", 0) for r in ok)
    runs = {r.get("replay", 0) for r in results}  # replays follow each other: sum their walls
    wall = sum(max(r["done"] for r in results if r.get("replay", 0) == k)
               - min(r["sent"] for r in results if r.get("replay", 0) == k) for k in runs)
    per_replica = Counter(r["replica"] for r in ok)
    lag = np.array([r["lag"] for r in results])
    return {"policy": policy, "rate_rps": rate, "requests": len(results),
            "replays": len(runs), "failed": len(results) - len(ok),
            "busiest_replica_share": max(per_replica.values()) / len(ok) if ok else 0.0,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99), "output_tok_s": output / wall,
            "hit_rate": cached / prompt if prompt else 0.0,
            "client_lag_p99_s": percentile(lag, 99)}


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in records):
        rows = [r for r in records if r["policy"] == policy]
        ax.plot([r["rate_rps"] for r in rows], [r["ttft_p90_s"] for r in rows], marker="o",
                label=policy, linewidth=2.5 if policy == "kv_aware" else 1.2)
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("TTFT p90 (s)")
    ax.set_yscale("log")
    ax.set_title("Mooncake trace sample, 2 tiny-model replicas on CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(result: dict[str, Any]) -> str:
    args, blocks = result["args"], result["kv_blocks_per_replica"]
    lines = [
        "# Routing policies on the Mooncake trace", "",
        f"`python benchmarks/routing.py --rates {args['rates']} --kv-cache {args['kv_cache']}`: "
        f"{result['sampled']} requests sampled by conversation root, 2 replicas x 1 core, "
        f"{args['kv_cache']} KV cache each ({blocks} blocks of {BLOCK_TOKENS} tokens).", "",
        "Hit-rate bounds of this sample: infinite cache "
        f"{result['upper_bound_hit_rate']:.3f}; one LRU of {2 * blocks} blocks (both caches as "
        f"one) {result['two_cache_hit_rate']:.3f}; one LRU of {blocks} blocks (one replica) "
        f"{result['single_lru_hit_rate']:.3f}.", "",
        f"The client runs in a scheduling group of its own at nice "
        f"{result['scheduling']['client_nice']} (`prioritise_client` in machine.py), so the "
        "engines it shares 2 cores with do not starve it; client lag is how late it sent a "
        "request against the trace's schedule.", "",
        "| policy | rate (req/s) | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | output tok/s "
        "| hit rate | busiest replica | requests (replays) | failed | client lag p99 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["records"]:
        lines.append(f"| {r['policy']} | {r['rate_rps']:g} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['output_tok_s']:.1f} | "
                     f"{r['hit_rate']:.3f} | {r['busiest_replica_share']:.0%} | "
                     f"{r['requests']} ({r['replays']}) | {r['failed']} | "
                     f"{r['client_lag_p99_s']:.3f} |")
    lines += ["", "Ratios of kv_aware's TTFT p90 to each other policy's, per rate:", ""]
    lines += [f"- {line}" for line in ratios(result["records"])]
    lines += ["", "kv_aware's hit rate against the bounds, per rate:", ""]
    for r in (r for r in result["records"] if r["policy"] == "kv_aware"):
        lines.append(f"- {r['rate_rps']:g} req/s: {r['hit_rate']:.3f}, "
                     f"{_share(r['hit_rate'], result['upper_bound_hit_rate'])} of the infinite "
                     f"cache's, {_share(r['hit_rate'], result['two_cache_hit_rate'])} of two "
                     "caches acting as one")
    return "\n".join(lines) + "\n"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.2f}" if whole else "-"


def kv_blocks_per_replica(base_url: str) -> int:
    """The smallest KV capacity, in blocks, the pool's replicas report."""
    reports = httpx.get(f"{base_url}/tokenfab/replicas", timeout=10, trust_env=False).json()
    return min(report["kv_blocks"] for report in reports)


def ratios(records: list[dict[str, Any]]) -> list[str]:
    out = []
    for rate in sorted({r["rate_rps"] for r in records}):
        at = {r["policy"]: r for r in records if r["rate_rps"] == rate}
        if "kv_aware" not in at:
            continue
        ours = at["kv_aware"]["ttft_p90_s"]
        parts = [f"{p} {ours / r['ttft_p90_s']:.2f}" for p, r in at.items() if p != "kv_aware"]
        out.append(f"{rate:g} req/s: " + ", ".join(parts))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1,10,30")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--kv-cache", default="24MiB")
    parser.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    parser.add_argument("--out", default=str(RESULTS / "routing.json"))
    parser.add_argument("--raw", default="", help="directory for per-request records")
    parser.add_argument("--min-replay-s", type=float, default=60.0,
                        help="replay each rate this many seconds at least, in repeats of the "
                             "sample, each with cold caches")
    parser.add_argument("--client-nice", type=int, default=-10,
                        help="the client's scheduling priority (see machine.prioritise_client)")
    parser.add_argument("--weights", default="", help='scorer weights for kv_aware/prefix_approx, '
                        'JSON, e.g. {"ttft": 1, "approx_prefix": 1}')
    args = parser.parse_args()
    scheduling = prioritise_client(args.client_nice)
    rates = [float(r) for r in args.rates.split(",")]
    requests = sample_by_root(TRACE, ROOT_SHARE, SAMPLE_SEED)
    if args.limit:
        requests = requests[:args.limit]
    weights = json.loads(args.weights) if args.weights else None
    specs = {p: topology(p, args.kv_cache, weights if p in ("kv_aware", "prefix_approx") else None)
             for p in args.policies.split(",")}
    words = single_token_words(next(iter(specs.values())).model.resolved_path)
    result: dict[str, Any] = {"args": vars(args), "sampled": len(requests),
                              "upper_bound_hit_rate": upper_bound_hit_rate(requests),
                              "scheduling": scheduling, "records": []}
    for policy, gateway, index, rate in sweep(specs, requests, words, rates, result,
                                              "kv_blocks_per_replica", kv_blocks_per_replica):
        results = replay_rate(gateway, requests, words, index, rate, args.min_replay_s)
        result["records"].append(summarize(policy, rate, results))
        if args.raw:
            raw = Path(args.raw) / f"{policy}-{rate:g}.json"
            raw.parent.mkdir(parents=True, exist_ok=True)
            raw.write_text(json.dumps(results))
        print(json.dumps(result["records"][-1]))
    out = Path(args.out)
    write(out, result, markdown)
    plot(result["records"], out.with_name(out.stem + "_ttft.png"))  # docs link this name
    print("\n".join(ratios(result["records"])))


if __name__ == "__main__":
    main()
