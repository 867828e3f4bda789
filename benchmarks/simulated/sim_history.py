"""The router's dispatch history at scale, simulated: how long kv_aware remembers where it sent a
prefix, against the hit rate it buys and the decodes it slows.

kv_aware's `approx_prefix` score reads the router's own memory of what it sent where
(`router.load.DispatchHistory`), bounded to `router.max_history_entries` (block, replica) pairs.
At a steady rate the bound sets how many seconds of dispatches it remembers, so the same bound
remembers less the longer the prompts and the higher the rate. This replays the Mooncake trace's
shapes at one steady rate on a static pool of simulated engines, kv_aware routing with each bound
(round_robin beside it, whose placement reads no history), and reports per run:

- the prefix-hit rate, TTFT p50/p90, the p90 of each request's mean inter-token gap;
- SLO attainment (TTFT <= --ttft-slo and mean gap <= --itl-slo, as sim_autoscaling.py counts it)
  and the requests that miss on the gap alone, with those requests' median prompt and output
  and the other prefills that ran on their replica while they decoded (`stalling_prefills`);
- the history's peak size (at the bound: it forgets what it sent longest ago).

Requests arriving in the first --warmup-s are served but not counted.

    .venv/bin/python benchmarks/simulated/sim_history.py

Writes benchmarks/results/sim_history.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.autoscaling import arrivals
from benchmarks.common.results import RESULTS, command, write
from benchmarks.simulated.sim_autoscaling import TRACE, requests
from sim import params as profiles
from sim import workload
from sim.cluster import SimCluster
from sim.engine import SimRequest
from sim.loop import EventLoop
from tokenfab.stats import percentile


def run(policy: str, capacity: int | None, seed: int, params: profiles.EngineParams,
        rows: list[dict[str, Any]], args: argparse.Namespace,
        weights: dict[str, float] | None = None) -> dict[str, Any]:
    """One replay of `args.seconds` at `args.rate` on `args.replicas` static replicas (`weights`:
    the policy's scorer weights, its defaults where None), and what it counts."""
    times = arrivals([(args.seconds, args.rate)], seed)
    reqs = requests(params, rows, times, args.max_output_tokens)
    loop = EventLoop()
    bound = {"max_history_entries": capacity} if capacity else {}
    sim = SimCluster(loop, params, policy, args.replicas, max_ongoing_requests=256,
                     weights=weights, **bound)
    sim.submit(reqs)
    began = time.perf_counter()
    loop.run()
    wall = time.perf_counter() - began
    counted = [r for r in reqs if r.arrival >= args.warmup_s and r.first_token is not None]
    ttft = np.array([r.first_token - r.arrival for r in counted])
    gap = np.array([r.itl_sum_s / r.itl_count if r.itl_count else 0.0 for r in counted])
    met = (ttft <= args.ttft_slo) & (gap <= args.itl_slo)
    gap_only = (ttft <= args.ttft_slo) & (gap > args.itl_slo)
    missed = [r for r, miss in zip(counted, gap_only) if miss]  # the gap alone missed
    behind, during = stalling_prefills(missed, reqs)
    return {
        "policy": policy, "max_history_entries": capacity, "seed": seed,
        "requests": len(counted),
        "hit_rate": sum(r.cached_tokens for r in counted) / sum(r.prompt_tokens for r in counted),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "itl_mean_p90_s": percentile(gap, 90),
        "slo_attainment": float(met.mean()), "missed_on_gap_only": int(gap_only.sum()),
        "gap_missed_prompt_p50": float(np.median([r.prompt_tokens for r in missed]))
        if missed else None,
        "gap_missed_output_p50": float(np.median([r.output_tokens for r in missed]))
        if missed else None,
        "stalling_prefills_queued_behind": behind, "stalling_prefills_during_decode": during,
        "history_peak_entries": sim.peak_history_entries,
        "wall_s": wall,
    }


def stalling_prefills(missed: list[SimRequest], requests: list[SimRequest]) -> tuple[int, int]:
    """The other prefills that ran on each missed request's replica while it decoded (they
    reached the engine before it finished and answered after its first token), counted as
    (queued behind it: they reached the engine before its first token, so FCFS ran them as
    soon as its own prefill ended; arrived during its decode).

    Example: m prefills from 10 to 11 s and decodes to 11.5 s; o reaches the engine at 10.5 s
    and answers at 11.4 s -> queued behind; one arriving at 11.2 s -> during its decode.
    """
    on: dict[str, list[SimRequest]] = defaultdict(list)
    for r in requests:
        if r.first_token is not None:
            on[r.replica].append(r)
    behind = during = 0
    for m in missed:
        end = m.finished if m.finished is not None else math.inf
        for o in on[m.replica]:
            if o is not m and o.engine_arrival < end and o.first_token > m.first_token:
                if o.engine_arrival < m.first_token:
                    behind += 1
                else:
                    during += 1
    return behind, during


def shown_command(result: dict[str, Any], script: str) -> str:
    """How the run was started: as it recorded, or for the runs before they recorded it (their
    settings in `args`), the script and its --out where that was not results/<script>.json."""
    if "command" in result:
        return str(result["command"])
    out = Path(result["args"]["out"])
    return f"python benchmarks/simulated/{script}.py" + (
        "" if (out.parent.name, out.name) == ("results", f"{script}.json") else f" --out {out}")


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        "# The dispatch history's memory at scale, simulated", "",
        f"`{shown_command(result, 'sim_history')}`: {a['replicas']} static replicas of profile "
        f"`{a['profile']}`, Poisson arrivals at {a['rate']:g} req/s for {a['seconds']:g} s of the "
        f"Mooncake trace's shapes (outputs up to {a['max_output_tokens']}), requests of the first "
        f"{a['warmup_s']:g} s not counted; SLO: TTFT <= {a['ttft_slo']:g} s and mean inter-token "
        f"gap <= {a['itl_slo']:g} s. Simulated engines, tokenfab's real router (see "
        "sim/README.md).", "",
        "| policy | history bound (pairs) | seed | hit rate | TTFT p50 / p90 (s) "
        "| mean gap p90 (s) | SLO attainment | missed on the gap alone "
        "| their prompt / output p50 (tokens) "
        "| prefills stalling them: queued behind / arrived during decode "
        "| history peak (pairs) | wall (s) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in result["records"]:
        bound = "-" if r["policy"] == "round_robin" else f"{r['max_history_entries']:,}"
        missed = (f"{r['gap_missed_prompt_p50']:.0f} / {r['gap_missed_output_p50']:.0f}"
                  if r["gap_missed_prompt_p50"] is not None else "-")
        lines.append(
            f"| {r['policy']} | {bound} | {r['seed']} | {r['hit_rate']:.3f} | "
            f"{r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} | {r['itl_mean_p90_s']:.3f} | "
            f"{r['slo_attainment']:.4f} | {r['missed_on_gap_only']} | {missed} | "
            f"{r['stalling_prefills_queued_behind']} / {r['stalling_prefills_during_decode']} | "
            f"{r['history_peak_entries']:,} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def replay_args(parser: argparse.ArgumentParser) -> None:
    """The options of a steady replay on a static simulated pool (this and sim_placement.py)."""
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=400.0)
    parser.add_argument("--warmup-s", type=float, default=100.0)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--ttft-slo", type=float, default=3.0)
    parser.add_argument("--itl-slo", type=float, default=0.1)
    parser.add_argument("--max-output-tokens", type=int, default=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    replay_args(parser)
    parser.add_argument("--rate", type=float, default=45.0)
    parser.add_argument("--bounds", default="250000,1000000,20000000",
                        help="kv_aware's router.max_history_entries values to compare")
    parser.add_argument("--out", default=str(RESULTS / "sim_history.json"))
    args = parser.parse_args()
    params = profiles.load(args.profile)
    rows = workload.read_trace(TRACE)
    records = []
    for seed in (int(s) for s in args.seeds.split(",")):
        runs = [("round_robin", None)] + [("kv_aware", int(b)) for b in args.bounds.split(",")]
        for policy, bound in runs:
            record = run(policy, bound, seed, params, rows, args)
            print(json.dumps(record), flush=True)
            records.append(record)
    result = {"command": command(), "args": vars(args), "records": records}
    print(write(Path(args.out), result, markdown))


if __name__ == "__main__":
    main()
