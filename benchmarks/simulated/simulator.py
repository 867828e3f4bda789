"""Routing at scale, in simulation: 16 to 1,024 replicas of a GPU engine profile behind tokenfab's
real router, on the Mooncake trace at full length.

The trace (`../shared/traces/synthetic_trace.jsonl`, one hash id per 512 tokens) is tiled until
each replica gets at least --requests-per-replica requests (each copy with hash ids of its own,
its arrivals rotated: more conversations, the same shape of reuse), and replayed at
--rate-per-replica x replicas requests/s. Prompts keep their full length up to the profile's
context (less the output), outputs their trace length up to --max-output-tokens. Every policy
gets the same requests and a cold cluster.

Per record: TTFT p50/p90 and hit rate (prompt tokens served from the engines' prefix caches)
against the bound (an infinite cache shared by all replicas), the real router's wall time per
decision (rank and dispatch) and per request (decisions and applying the engines' KV events), the
block map's peak size, and how much faster than real time the simulation ran.

    .venv/bin/python benchmarks/simulated/simulator.py [--replicas 16,64,256,1024] [--profile NAME]

Writes benchmarks/results/simulator.{json,md,png}; the fidelity records come from
benchmarks/results/sim_fidelity.json (benchmarks/sim_fidelity.py) and are copied in as they are.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from benchmarks.common.results import RESULTS, TRACE, write
from sim import params as profiles
from sim import workload
from sim.run import MakeReplay, replay

POLICIES = ["round_robin", "least_loaded", "prefix_approx", "kv_aware"]
TOKENS_PER_ID = 512


def bound_hit_rate(requests: list, block_size: int) -> float:
    """Prompt tokens an infinite cache shared by every replica would serve: each request's
    longest prefix of blocks any earlier request had, as an engine counts it (at least one
    prompt token is computed)."""
    pairs = workload.reusable_tokens(requests, block_size)
    total = sum(r.prompt_tokens for r, _ in pairs)
    return sum(cached for _, cached in pairs) / total if total else 0.0


def scale_workload(params: profiles.EngineParams, rows: list[dict[str, Any]], replicas: int,
                   args: argparse.Namespace) -> tuple[MakeReplay, int, float]:
    """The requests of one scale (`make`), the trace's copies in it, and their rate (req/s)."""
    copies = max(1, math.ceil(replicas * args.requests_per_replica / len(rows)))
    tiled = workload.tile(rows, copies, seed=args.seed)
    rate = args.rate_per_replica * replicas

    def make(index: int, start: float) -> list:
        return workload.requests(
            tiled, rate, tokens_per_id=TOKENS_PER_ID, block_size=params.block_size,
            max_prompt_tokens=params.max_model_len - args.max_output_tokens, start=start,
            output_tokens=lambda row: max(1, min(args.max_output_tokens, row["output_length"])))

    return make, copies, rate


def workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `scale_workload` reads, and --policies and --profile."""
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--rate-per-replica", type=float, default=0.75)
    parser.add_argument("--requests-per-replica", type=int, default=20)
    parser.add_argument("--max-output-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)


def run_scale(params: profiles.EngineParams, rows: list[dict[str, Any]], replicas: int,
              args: argparse.Namespace) -> list[dict[str, Any]]:
    make, copies, rate = scale_workload(params, rows, replicas, args)
    bound = bound_hit_rate(make(0, 0.0), params.block_size)
    out = []
    for policy in args.policies.split(","):
        began = time.monotonic()
        bound_args = {} if args.max_history_entries is None else \
            {"max_history_entries": args.max_history_entries}
        result = replay(params, policy, replicas, make, seed=args.seed, **bound_args)
        result.pop("per_request")
        record = {"replicas": replicas, "rate_rps": rate, "copies": copies,
                  "bound_hit_rate": bound, **result}
        record["index_bytes_per_replica"] = record["index_bytes_peak"] / replicas
        out.append(record)
        print(f"{replicas} replicas, {policy}: TTFT p50 {record['ttft_p50_s']:.3f}s "
              f"p90 {record['ttft_p90_s']:.3f}s, hit {record['hit_rate']:.3f} of "
              f"{bound:.3f}, decision p99 {record['decision_p99_ms']:.2f} ms, "
              f"{record['sim_speedup']:.1f}x real time ({time.monotonic() - began:.0f}s)",
              flush=True)
    return out


def plot(records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hit, ttft, cost) = plt.subplots(1, 3, figsize=(15, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in records):
        rows = [r for r in records if r["policy"] == policy]
        x = [r["replicas"] for r in rows]
        width = 2.5 if policy == "kv_aware" else 1.2
        hit.plot(x, [r["hit_rate"] for r in rows], marker="o", label=policy, linewidth=width)
        ttft.plot(x, [r["ttft_p90_s"] for r in rows], marker="o", label=policy, linewidth=width)
        cost.plot(x, [r["decision_p99_ms"] for r in rows], marker="o", label=policy,
                  linewidth=width)
    bound = {r["replicas"]: r["bound_hit_rate"] for r in records}
    hit.plot(list(bound), list(bound.values()), "k--", label="bound (infinite cache)")
    for ax, label in ((hit, "prefix-cache hit rate"), (ttft, "TTFT p90 (s)"),
                      (cost, "router decision p99 (ms, wall)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ttft.set_yscale("log")
    cost.set_yscale("log")
    hit.legend(fontsize=8)
    fig.suptitle("Simulated: Mooncake trace at full length, H100 Llama-3.1-8B profile, "
                 "tokenfab's real router")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict[str, Any]) -> str:
    a, p = result["args"], result["profile"]
    policies = "" if a["policies"] == ",".join(POLICIES) else f" --policies {a['policies']}"
    bound = ("" if a["max_history_entries"] is None
             else f" --max-history-entries {a['max_history_entries']}")
    lines = [
        "# Routing at scale, simulated", "",
        f"`python benchmarks/simulated/simulator.py --replicas {a['replicas']}{policies} "
        f"--profile {a['profile']} --rate-per-replica {a['rate_per_replica']:g} "
        f"--requests-per-replica {a['requests_per_replica']}{bound}`. "
        f"Run took {result['wall_s'] / 60:.1f} min.", "",
        f"Simulated: engines of profile `{p['name']}` ({p['source']}): KV cache "
        f"{p['kv_blocks']} blocks of {p['block_size']} tokens, {p['max_num_batched_tokens']} "
        f"tokens per step, context {p['max_model_len']}. Measured: every routing decision and "
        "every KV event runs tokenfab's router code unchanged (`router.service.RoutingService`), "
        "and its wall time on this machine's CPU is what the decision and router columns "
        "show.", "",
        f"Workload: `{TRACE.name}` ({result['trace_requests']} requests, one hash id per 512 "
        f"tokens), tiled to at least {a['requests_per_replica']} requests per replica, at "
        f"{a['rate_per_replica']:g} requests/s per replica; prompts up to "
        f"{p['max_model_len'] - a['max_output_tokens']} tokens, outputs up to "
        f"{a['max_output_tokens']}.", "",
        "| replicas | policy | requests | TTFT p50 (s) | TTFT p90 (s) | hit rate | bound "
        "| decision p50 (ms) | decision p99 (ms) | router ms/request | map entries (peak) "
        "| map MB (peak) | history entries (peak) | sim speed (x real time) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["scale"]:
        lines.append(
            f"| {r['replicas']} | {r['policy']} | {r['requests']} | {r['ttft_p50_s']:.3f} | "
            f"{r['ttft_p90_s']:.3f} | {r['hit_rate']:.3f} | {r['bound_hit_rate']:.3f} | "
            f"{r['decision_p50_ms']:.3f} | {r['decision_p99_ms']:.3f} | "
            f"{r['router_ms_per_request']:.2f} | {r['index_entries_peak']:,} | "
            f"{r['index_bytes_peak'] / 1e6:.0f} | {r.get('history_entries_peak', 0):,} | "
            f"{r['sim_speedup']:.1f} |")
    lines += ["", "kv_aware against round_robin, per scale:", ""]
    for n in sorted({r["replicas"] for r in result["scale"]}):
        at = {r["policy"]: r for r in result["scale"] if r["replicas"] == n}
        if "kv_aware" in at and "round_robin" in at:
            kv, rr = at["kv_aware"], at["round_robin"]
            lines.append(f"- {n} replicas: TTFT p90 {kv['ttft_p90_s'] / rr['ttft_p90_s']:.2f}x, "
                         f"hit rate {kv['hit_rate']:.3f} against {rr['hit_rate']:.3f} "
                         f"({kv['hit_rate'] / kv['bound_hit_rate']:.2f} of the bound)")
    if result["fidelity"]:
        lines += ["", "Fidelity (from sim_fidelity.json: the simulator against 2 real replicas "
                  "of the tiny model, calibrated in that run):", "",
                  "| policy | load | metric | simulated | real | error |",
                  "|---|---|---|---:|---:|---:|"]
        for f in result["fidelity"]:
            lines.append(f"| {f['policy']} | {f['load']} | {f['metric']} | {f['sim']:.3f} | "
                         f"{f['real']:.3f} | {f['rel_err']:+.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="16,64,256,1024")
    workload_arguments(parser)
    parser.add_argument("--max-history-entries", type=int, default=None,
                        help="the router's dispatch-history bound (router.max_history_entries; "
                        "default: the router's default)")
    parser.add_argument("--out", default=str(RESULTS / "simulator.json"))
    parser.add_argument("--refresh-fidelity", action="store_true",
                        help="keep the scale records of --out, take the fidelity records from "
                        "sim_fidelity.json again, rewrite the files (no simulation)")
    args = parser.parse_args()
    fidelity_path = RESULTS / "sim_fidelity.json"
    fidelity = json.loads(fidelity_path.read_text())["fidelity"] if fidelity_path.exists() else []
    if args.refresh_fidelity:
        result = json.loads(Path(args.out).read_text()) | {"fidelity": fidelity}
    else:
        result = simulate(args) | {"fidelity": fidelity}
    print(write(Path(args.out), result, markdown, lambda result, path: plot(result["scale"], path)))


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    import msgspec

    began = time.monotonic()
    params = profiles.load(args.profile)
    rows = workload.read_trace(TRACE)
    records = []
    for replicas in (int(n) for n in args.replicas.split(",")):
        records += run_scale(params, rows, replicas, args)
    kept = ("replicas", "policies", "profile", "rate_per_replica", "requests_per_replica",
            "max_output_tokens", "seed", "max_history_entries")
    return {"profile": msgspec.to_builtins(params), "trace_requests": len(rows),
            "scale": records, "wall_s": time.monotonic() - began,
            "args": {k: getattr(args, k) for k in kept}}


if __name__ == "__main__":
    main()
