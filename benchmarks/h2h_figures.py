"""The head-to-head benchmark's figures: one replay's latencies, rates, hit rate, CPU and stall
clusters; the repeats of each (system, policy, load) as medians and ranges; goodput (h2h.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.common import process_cpu
from benchmarks.common.client import MAX_TOKENS
from benchmarks.common.intervals import aggregate, goodput
from tokenfab.stats import percentile_or_none

BURST_S = 0.005  # tokens, or first tokens, this close together arrived in one instant

# every figure of a replay that is a number, kept as a median and range over the repeats
FIELDS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p90_s", "itl_p50_s",
          "itl_p90_s", "itl_p99_s", "output_tok_s", "hit_rate", "dataplane_cpu_ms_per_token",
          "background_cpu_pct", "engine_cpu_pct", "idle_dataplane_cpu_pct",
          "idle_background_cpu_pct", "client_waited_s", "stall_cluster_max", "burst_requests",
          "failed", "requests", "tokens_per_chunk")


def token_times(chunks: list[tuple[float, int | None]], mode: str) -> list[float]:
    """When each token arrived: a chunk of k tokens is k arrivals at its time (mode token_ids),
    or every chunk with a choice is one (mode chunks)."""
    if mode == "token_ids":
        return [at for at, n in chunks for _ in range(n or 0)]
    return [at for at, _ in chunks]


def ttft_p90(run: dict[str, Any]) -> tuple[float | None, int]:
    """A replay's TTFT p90 over the requests that streamed a token, and how many did not."""
    firsts = [r["chunks"][0][0] for r in run["results"] if r["status"] == 200 and r["chunks"]]
    return percentile_or_none(firsts, 90), len(run["results"]) - len(firsts)


def stall_clusters(firsts: list[float]) -> int:
    """The most requests whose first tokens fall within `BURST_S` of each other, among requests
    that got all their tokens in one instant (`firsts`: their first tokens' absolute times). A
    client or path that stalls, then delivers many streams at once, shows as a large cluster;
    requests that each simply ran fast show as clusters of 1.

    Example: firsts 1.000, 1.002, 1.004, 2.0 -> 3."""
    firsts, best, start = sorted(firsts), 0, 0
    for end, at in enumerate(firsts):
        while at - firsts[start] > BURST_S:
            start += 1
        best = max(best, end - start + 1)
    return best


def summarize(run: dict[str, Any], mode: str) -> dict[str, Any]:
    results = run["results"]
    times = [token_times(r["chunks"], mode) for r in results]
    ok = [(r, t) for r, t in zip(results, times) if r["status"] == 200 and t]
    usages = [r["usage"] for r, _ in ok]
    prompt = sum(u.get("prompt_tokens", 0) for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    output = sum(u.get("completion_tokens", 0) for u in usages)
    ttft = [t[0] for _, t in ok]
    e2e = [r["done"] - r["sent"] for r, _ in ok]
    gaps = [float(g) for _, t in ok for g in np.diff(t)]
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    chunks = [n for r, _ in ok for _, n in r["chunks"] if n]
    bursts = [r["sent"] + t[0] for r, t in ok if len(t) > 1 and t[-1] - t[0] <= BURST_S]
    cpu = process_cpu.summary(run, output)
    return {
        "ttft_p50_s": percentile_or_none(ttft, 50), "ttft_p90_s": percentile_or_none(ttft, 90), "ttft_p99_s": percentile_or_none(ttft, 99),
        "e2e_p50_s": percentile_or_none(e2e, 50), "e2e_p90_s": percentile_or_none(e2e, 90),
        "itl_p50_s": percentile_or_none(gaps, 50), "itl_p90_s": percentile_or_none(gaps, 90), "itl_p99_s": percentile_or_none(gaps, 99),
        "output_tok_s": output / wall, "hit_rate": cached / prompt if prompt else 0.0,
        "dataplane_cpu_ms_per_token": cpu.pop("dataplane_cpu_ms_per_token"),
        "background_cpu_pct": cpu["cpu_pct_of_core"]["background"],
        "engine_cpu_pct": cpu["cpu_pct_of_core"]["engine"],
        "requests": len(results), "failed": len(results) - len(ok),
        "incomplete": sum(u.get("completion_tokens", 0) != MAX_TOKENS for u in usages),
        "errors": sorted({r["error"][:200] for r in results if r["error"]})[:3],
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output,
        "tokens_per_chunk": float(np.mean(chunks)) if chunks else None,
        "burst_requests": len(bursts), "stall_cluster_max": stall_clusters(bursts),
        "client_waited_s": run["client_waited_s"], "window_s": run["window_s"], **cpu,
    }


def record(run: dict[str, Any], mode: str) -> dict[str, Any]:
    rate = run["rate"]
    return {"system": run["system"], "policy": run["policy"], "load": f"{rate:g} req/s",
            "rate_rps": rate, "repeat": run["repeat"], **summarize(run, mode),
            "namespace": run["namespace"], "other_cpu_pct_before": run["other_cpu_pct_before"],
            "idle_dataplane_cpu_pct": run["idle_cpu_pct"]["dataplane"],
            "idle_background_cpu_pct": run["idle_cpu_pct"]["background"],
            "attempts": run["attempts"]}


def with_goodput(records: list[dict[str, Any]], slo_s: float | None) -> list[dict[str, Any]]:
    """Per (system, policy, load): the median and range of every figure over the repeats (see
    intervals.aggregate), in order of setup then rate; and, where a target is set, each setup's
    goodput: the highest rate with TTFT p90 <= `slo_s` and no failure (intervals.goodput), found
    in each repeat over its rates, as `goodput_rps` (median), `goodput_rps_range` and
    `goodput_lower_bound` (every rate met the target in some repeat)."""
    records = sorted(records, key=lambda r: (r["system"], r["policy"], r["rate_rps"]))
    rows = aggregate(records, ("system", "policy", "load", "rate_rps"), FIELDS)
    if slo_s is None:
        return rows
    for setup in dict.fromkeys((r["system"], r["policy"]) for r in rows):
        runs = [r for r in records if (r["system"], r["policy"]) == setup]
        found = [goodput([(r["rate_rps"], r["ttft_p90_s"], r["failed"])
                          for r in runs if r["repeat"] == repeat], slo_s)
                 for repeat in sorted({r["repeat"] for r in runs})]
        summary = aggregate([{"goodput_rps": g} for g, _ in found], (), ("goodput_rps",))[0]
        for row in rows:
            if (row["system"], row["policy"]) == setup:
                row.update(goodput_rps=summary["goodput_rps"],
                           goodput_rps_range=summary["goodput_rps_range"],
                           goodput_runs=[g for g, _ in found],
                           goodput_lower_bound=any(bound for _, bound in found))
    return rows
