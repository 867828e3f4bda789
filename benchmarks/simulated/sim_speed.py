"""How fast the simulator could run at scale, against how fast it runs: the block lives a workload
needs at CPython's cheapest cost per life, and the real router's own time.

For each policy, the run of benchmarks/simulated/simulator.py at --replicas (the same requests) is replayed
once and its wall time split: building the requests, the real router (decisions and applying
the engines' KV events, as the cluster times them), and the rest (engines, block pools, loop).
A block's life is a block taken for new data (`BlockPool.allocated`): its prompt tokens were
computed, its hash stored, and later evicted.

The floor is what no per-block simulator in CPython can avoid for one life: its hash inserted
into its engine's hash -> block table and deleted at eviction, both in C (`dict.update`,
`map(dict.__delitem__)`), over tables of the same number and size as the run's engines' (each
full, random 64-bit hashes; the tables' total size sets how often these miss the CPU caches).
Lives x floor is the least wall time the run's engines need; add the router's own measured
time for the least the run needs with tokenfab's router unchanged. Simulated seconds over each
is the most "x real time" any such simulator could show on this machine.

    .venv/bin/python benchmarks/simulated/sim_speed.py [--replicas 64] [--policies round_robin,kv_aware]

Writes benchmarks/results/sim_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque
from pathlib import Path
from typing import Any

from benchmarks.common.results import RESULTS, TRACE, write
from benchmarks.simulated.simulator import scale_workload, workload_arguments
from sim import params as profiles
from sim import workload
from sim.cluster import SimCluster
from sim.loop import EventLoop

TARGET = 100.0  # issue 18: at least 100x real time at 64 replicas


def run(params: profiles.EngineParams, policy: str, replicas: int, make: Any,
        seed: int) -> dict[str, Any]:
    """One replay, as sim.run.replay runs it, with its wall time split."""
    loop = EventLoop()
    sim = SimCluster(loop, params, policy, replicas, seed=seed)
    began = time.perf_counter()
    requests = make(0, 0.0)
    made = time.perf_counter()
    sim.submit(requests)
    loop.run()
    wall = time.perf_counter() - began
    router = (sum(sim.decision_ns) + sim.apply_ns) / 1e9
    lives = sum(r.engine.pool.allocated for r in sim.replicas.values())
    sim_s = loop.now
    return {"policy": policy, "replicas": replicas, "requests": len(requests), "sim_s": sim_s,
            "wall_s": wall, "sim_speedup": sim_s / wall, "make_s": made - began,
            "router_s": router, "engines_s": wall - (made - began) - router,
            "block_lives": lives, "block_lives_per_request": lives / len(requests),
            "block_lives_per_sim_s": lives / sim_s}


def floor_ns(engines: int, blocks: int, per_request: int, lives: int, seed: int = 0) -> float:
    """Wall ns per block life of the unavoidable table work (see the module docstring)."""
    rng = random.Random(seed)
    tables, rings = [], []
    for _ in range(engines):
        ring = [rng.getrandbits(64) for _ in range(blocks)]
        tables.append(dict(zip(ring, range(blocks))))
        rings.append(ring)
    at, spent, done, engine = [0] * engines, 0.0, 0, 0
    while done < lives:
        table, ring, start = tables[engine], rings[engine], at[engine]
        n = min(per_request, blocks - start)
        new = [rng.getrandbits(64) for _ in range(n)]  # not timed: the workload makes these
        began = time.perf_counter()
        deque(map(table.__delitem__, ring[start:start + n]), maxlen=0)  # evicted
        table.update(zip(new, range(start, start + n)))  # stored
        ring[start:start + n] = new
        spent += time.perf_counter() - began
        at[engine] = (start + n) % blocks
        engine = (engine + 1) % engines
        done += n
    return spent / done * 1e9


def markdown(result: dict[str, Any]) -> str:
    a, p = result["args"], result["profile"]
    lines = [
        "# Simulator speed: measured, and the most it could be", "",
        f"`python benchmarks/simulated/sim_speed.py --replicas {a['replicas']} --policies "
        f"{a['policies']}`: benchmarks/simulated/simulator.py's workload at {a['replicas']} replicas "
        f"(`{TRACE.name}` at full length, {a['rate_per_replica']:g} req/s per replica, profile "
        f"`{p['name']}`: {p['kv_blocks']} blocks of {p['block_size']} tokens per engine). "
        f"Run took {result['wall_s'] / 60:.1f} min.", "",
        f"Floor: {result['floor_ns']:.0f} ns of wall time per block life, the hash inserted into "
        f"and deleted from its engine's table in C, over {a['replicas']} tables of "
        f"{p['kv_blocks']} blocks (measured here, {result['floor_lives']:,} lives).", "",
        "| policy | requests | simulated (s) | wall (s) | x real time | building requests (s) "
        "| router (s) | engines and loop (s) | block lives | per request | engines' floor (s) "
        "| most x real time: engines at the floor | ... and the router as measured |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["records"]:
        lines.append(
            f"| {r['policy']} | {r['requests']} | {r['sim_s']:.1f} | {r['wall_s']:.2f} | "
            f"{r['sim_speedup']:.1f} | {r['make_s']:.2f} | {r['router_s']:.2f} | "
            f"{r['engines_s']:.2f} | {r['block_lives']:,} | {r['block_lives_per_request']:.0f} | "
            f"{r['floor_s']:.2f} | {r['bound_speedup_engines']:.0f} | "
            f"{r['bound_speedup_with_router']:.0f} |")
    lines += ["", f"Against the target ({TARGET:.0f}x real time):", ""]
    for r in result["records"]:
        budget = r["sim_s"] / TARGET
        lines.append(
            f"- {r['policy']}: {TARGET:.0f}x leaves {budget:.2f} s of wall time for "
            f"{r['block_lives']:,} block lives, {budget / r['block_lives'] * 1e9:.0f} ns each "
            f"(floor {result['floor_ns']:.0f} ns), and the router took {r['router_s']:.2f} s")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=64)
    workload_arguments(parser)
    parser.add_argument("--out", default=str(RESULTS / "sim_speed.json"))
    args = parser.parse_args()
    began = time.monotonic()
    params = profiles.load(args.profile)
    make, _, _ = scale_workload(params, workload.read_trace(TRACE), args.replicas, args)
    records = []
    for policy in args.policies.split(","):
        records.append(run(params, policy, args.replicas, make, args.seed))
        print(f"{policy}: {records[-1]['sim_speedup']:.1f}x real time", flush=True)
    per_request = round(max(r["block_lives_per_request"] for r in records))
    lives = max(r["block_lives"] for r in records)
    floor = floor_ns(args.replicas, params.kv_blocks, per_request, lives)
    for r in records:
        r["floor_s"] = r["block_lives"] * floor / 1e9
        r["bound_speedup_engines"] = r["sim_s"] / r["floor_s"]
        r["bound_speedup_with_router"] = r["sim_s"] / (r["floor_s"] + r["router_s"])
    kept = ("replicas", "policies", "rate_per_replica", "requests_per_replica",
            "max_output_tokens", "seed")
    result = {"profile": {"name": params.name, "kv_blocks": params.kv_blocks,
                          "block_size": params.block_size},
              "floor_ns": floor, "floor_lives": lives, "records": records,
              "wall_s": time.monotonic() - began,
              "args": {k: getattr(args, k) for k in kept}}
    out = Path(args.out)
    print(write(out, result, markdown))


if __name__ == "__main__":
    main()
