"""Data-parallel ranks as routing targets, against the engine's own rank balancer, in one run.

One replica of the tiny model whose engine has two data-parallel ranks (a core each, a KV cache
each, vLLM's `data_parallel_size: 2`) replays the sample of Mooncake's trace that the routing
benchmark replays (routing.py: sampled by conversation root, 32-token blocks, outputs of 1-32
tokens). Two placements of the same requests on the same engine:

- `rank_aware`: tokenfab's kv_aware router with each rank a target of its own (its KV events,
  block map entries, load and TTFT model); the request runs on the rank it chose.
- `engine_balancer`: the same router sees the replica only (`router.dp_ranks: engine`), and
  vLLM's own DP balancer picks the rank by queue length, blind to prefixes: what a router that
  does not know ranks gets (Ray Serve LLM's KVAwareRouter, a plain load balancer).

Each placement gets a fresh deployment (cold caches), a warm-up in words no replay uses, and
each rate its own words. Hit rate is the engine's own (cached_tokens / prompt_tokens of every
answer); "busiest rank" is the share of prompt tokens the busier rank saw, from the ranks'
own counters.

    .venv/bin/python benchmarks/dp_routing.py [--rates 2,6] [--kv-cache 12MiB]

About 10 minutes on 2 cores. Writes benchmarks/results/dp_routing.json and dp_routing.md, the
page rendered from the JSON alone (`markdown`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common.cluster import local_head, tiny_topology
from benchmarks.common.machine import prioritise_client
from benchmarks.common.results import RESULTS, write
from benchmarks.common.traces import (BLOCK_TOKENS, sample_by_root, single_token_words,
                                      upper_bound_hit_rate)
from benchmarks.routing import (ROOT_SHARE, SAMPLE_SEED, TRACE, kv_blocks_per_replica, replay_rate,
                                summarize, sweep)
from orchestrator.config import Topology

PLACEMENTS = {"rank_aware": "route", "engine_balancer": "engine"}  # -> router.dp_ranks
CLUSTER = local_head(6394, 8287)


def topology(placement: str, kv_cache: str) -> Topology:
    return tiny_topology(
        f"dp-{placement.replace('_', '-')}",
        [{"name": "main", "role": "unified", "replicas": 1, "max_ongoing_requests": 256,
          "parallel": {"data": 2},
          "resources": {"cpus": 2, "kv_cache_bytes": kv_cache, "pin_cores": True}}],
        router={"policy": "kv_aware", "dp_ranks": PLACEMENTS[placement]},
        gateway={"port": 8022}, cluster=CLUSTER, block_size=BLOCK_TOKENS)


def rank_prompt_tokens(gateway: str) -> list[int]:
    """Prompt tokens each rank has seen since it started (computed, cached or pulled)."""
    [replica] = httpx.get(f"{gateway}/tokenfab/replicas", timeout=10, trust_env=False).json()
    return [rank["load"]["prompt_tokens_computed"] + rank["load"]["prompt_tokens_local_hit"]
            + rank["load"]["prompt_tokens_transferred"] for rank in replica["ranks"]]


def markdown(result: dict[str, Any]) -> str:
    args, blocks = result["args"], result["kv_blocks_per_rank"]
    lines = [
        "# Data-parallel ranks as routing targets", "",
        f"`python benchmarks/dp_routing.py --rates {args['rates']} --kv-cache "
        f"{args['kv_cache']}`: {result['sampled']} requests sampled by conversation root "
        "(routing.py's sample), one replica with 2 data-parallel ranks x 1 core, "
        f"{args['kv_cache']} KV cache per rank ({blocks} blocks of {BLOCK_TOKENS} tokens).", "",
        "Hit-rate bounds of this sample: infinite cache "
        f"{result['upper_bound_hit_rate']:.3f}; one LRU of {2 * blocks} blocks (both ranks' "
        f"caches as one) {result['two_cache_hit_rate']:.3f}; one LRU of {blocks} blocks (one "
        f"rank) {result['single_lru_hit_rate']:.3f}.", "",
        "rank_aware: tokenfab's kv_aware router places each request on a rank (its KV events, "
        "map entries and load). engine_balancer: the router sees the replica only "
        "(`router.dp_ranks: engine`) and vLLM's DP balancer picks the rank by queue length.", "",
        "| placement | rate (req/s) | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | output tok/s "
        "| hit rate | busiest rank | requests (replays) | failed | client lag p99 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["records"]:
        lines.append(f"| {r['policy']} | {r['rate_rps']:g} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['output_tok_s']:.1f} | "
                     f"{r['hit_rate']:.3f} | {r['busiest_rank_share']:.0%} | "
                     f"{r['requests']} ({r['replays']}) | {r['failed']} | "
                     f"{r['client_lag_p99_s']:.3f} |")
    lines += ["", "rank_aware against engine_balancer, per rate:", ""]
    lines += [f"- {line}" for line in ratios(result["records"])]
    return "\n".join(lines) + "\n"


def ratios(records: list[dict[str, Any]]) -> list[str]:
    out = []
    for rate in sorted({r["rate_rps"] for r in records}):
        at = {r["policy"]: r for r in records if r["rate_rps"] == rate}
        if {"rank_aware", "engine_balancer"} <= set(at):
            ours, theirs = at["rank_aware"], at["engine_balancer"]
            out.append(f"{rate:g} req/s: TTFT p90 "
                       f"{ours['ttft_p90_s'] / theirs['ttft_p90_s']:.2f}x, "
                       f"TTFT p50 {ours['ttft_p50_s'] / theirs['ttft_p50_s']:.2f}x, hit rate "
                       f"{ours['hit_rate']:.3f} against {theirs['hit_rate']:.3f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2,6")
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--kv-cache", default="12MiB", help="KV cache of each rank")
    parser.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    parser.add_argument("--out", default=str(RESULTS / "dp_routing.json"))
    parser.add_argument("--min-replay-s", type=float, default=60.0,
                        help="replay each rate this many seconds at least, in repeats of the "
                             "sample, each with cold caches")
    parser.add_argument("--client-nice", type=int, default=-10,
                        help="the client's scheduling priority (see machine.prioritise_client)")
    args = parser.parse_args()
    scheduling = prioritise_client(args.client_nice)
    rates = [float(r) for r in args.rates.split(",")]
    requests = sample_by_root(TRACE, ROOT_SHARE, SAMPLE_SEED)
    if args.limit:
        requests = requests[:args.limit]
    specs = {p: topology(p, args.kv_cache) for p in args.placements.split(",")}
    words = single_token_words(next(iter(specs.values())).model.resolved_path)
    result: dict[str, Any] = {"args": vars(args), "sampled": len(requests),
                              "upper_bound_hit_rate": upper_bound_hit_rate(requests),
                              "scheduling": scheduling, "records": []}
    # the replica's kv_blocks are each rank's (routing.kv_blocks_per_replica reads them)
    for placement, gateway, index, rate in sweep(specs, requests, words, rates, result,
                                                 "kv_blocks_per_rank", kv_blocks_per_replica):
        before = rank_prompt_tokens(gateway)
        results = replay_rate(gateway, requests, words, index, rate, args.min_replay_s)
        seen = [a - b for a, b in zip(rank_prompt_tokens(gateway), before)]
        record = summarize(placement, rate, results)
        del record["busiest_replica_share"]  # one replica: its ranks say more
        record["busiest_rank_share"] = max(seen) / sum(seen) if sum(seen) else 0.0
        record["rank_prompt_tokens"] = seen
        result["records"].append(record)
        print(json.dumps(record))
    write(Path(args.out), result, markdown)
    print("\n".join(ratios(result["records"])))


if __name__ == "__main__":
    main()
