"""Prefill and decode pools autoscaled, in simulation: quiet, burst, quiet, each pool sized by
tokenfab's policy on its own signals, against a unified pool autoscaled and against static pools,
one run.

The workload and the SLO are `sim_autoscaling.py`'s (the Mooncake trace's requests as a Poisson
process at each phase's rate, TTFT <= --ttft-slo and mean inter-token gap <= --itl-slo per
request); the P/D cluster is `sim.pd`'s (the gateway's rule for which prompts take a prefill leg,
pulls timed by bytes over --transfer-gb-s). Setups:

- unified_autoscaler: one pool, tokenfab's policy with its plan (capacity profiled first, in this
  run, as sim_autoscaling.py does), --min..--max replicas;
- pd_autoscaler: a prefill pool and a decode pool, each with tokenfab's policy for its role (a
  prefill pool reads its engines' TTFT and prompt backlog, a decode pool their inter-token
  latency; Serve runs one policy per deployment), each from --pd-min replicas up to the
  --pd-max bound (--pd-min auto, the default: the floor that serves the first phase's rate at
  the pool's profiled capacity, every request counted as a prefill leg, as --min 8 does a
  unified pool's), each with a plan: its capacity in its own arrivals (a prefill pool gets only
  the prompts that take a prefill leg) profiled first, in this run, by `sim.profile.sweep_pd`
  on 4 replicas of the pool beside 16 of the other, so each pool is sized for what its role
  needs of the workload (the ratio follows);
- pd_autoscaler_rise: the same with a declared rise (`rise_rps_per_s`, --rise, as
  sim_autoscaling.py's autoscaler_rise): each pool's plan keeps that rise over one replica start
  in hand (a rise of all requests: the prefill pool's plan holds it in prefill legs too);
- pd_reactive: the same pools and policies without a plan (no capacity per role);
- pd_static: the --pd-static split all the time;
- unified_static: --max replicas all the time.

Replica-seconds count both pools, every replica from its start until it is gone. The plot shows
each setup's replicas held, and the P/D setups' prefill and decode pools apart.

    .venv/bin/python benchmarks/simulated/sim_pd_autoscaling.py [--ramp-s 300]

Writes benchmarks/results/sim_pd_autoscaling.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import msgspec

from autoscaler.serve_policy import PoolPolicy
from benchmarks.autoscaling import arrivals
from benchmarks.common.results import write
from benchmarks.simulated.sim_autoscaling import (add_arguments, mark_phases, meets_target,
                                                  outcome, prepare, requests, window_table,
                                                  windows)
from sim import params as profiles
from sim.autoscale import SimAutoscaler
from sim.cluster import SimCluster
from sim.engine import SimRequest
from sim.loop import EventLoop
from sim.pd import SimPDCluster
from sim.profile import Capacity, sweep_pd
from tokenfab.stats import percentile

SETUPS = ["unified_autoscaler", "pd_autoscaler", "pd_autoscaler_rise", "pd_reactive", "pd_static",
          "unified_static"]
PLANNED = ("pd_autoscaler", "pd_autoscaler_rise")  # the setups that profile each pool and plan
ROLES = ("prefill", "decode")


def _split(value: str) -> tuple[int, int]:
    prefill, decode = (int(n) for n in value.split(":"))
    return prefill, decode


def _still(ctx: Any) -> tuple[int, dict[str, Any]]:
    return ctx.target_num_replicas, {}


def _policy(role: str, low: int, high: int, args: argparse.Namespace,
            capacity: Capacity | None, rise: float = 0.0) -> PoolPolicy:
    return PoolPolicy("sim", role, role=role, min_replicas=low, max_replicas=high,
                      ttft_p90_s=args.ttft_slo, itl_p90_s=args.itl_slo,
                      target_ongoing=capacity.ongoing_per_replica if capacity else 8.0,
                      downscale_delay_s=30.0, replica_start_s=args.replica_start_s,
                      capacity_rps=capacity.rate_per_replica if capacity else 0.0,
                      rise_rps_per_s=rise)


def profile_pd(params: profiles.EngineParams, rows: list[dict[str, Any]],
               args: argparse.Namespace) -> dict[str, Capacity]:
    """Each pool's capacity on this workload, in its own arrivals (sim.profile.sweep_pd)."""
    def make(rate: float, seconds: float) -> list[SimRequest]:
        return requests(params, rows, arrivals([(seconds, rate)], args.seed + 1),
                        args.max_output_tokens)

    rates = {"prefill": [0.25 * i for i in range(1, 17)],
             "decode": [0.5 * i for i in range(1, 13)]}
    return {role: sweep_pd(params, make, rates[role], args.ttft_slo, args.itl_slo, role,
                           replicas=4, other=16, seconds=240.0,
                           max_ongoing_requests=args.max_ongoing,
                           transfer_bytes_per_s=args.transfer_gb_s * 1e9,
                           transfer_latency_s=args.transfer_latency_ms / 1e3)
            for role in ROLES}


def floors(rate: float, capacity: dict[str, Capacity]) -> str:
    """PREFILL:DECODE replicas that serve `rate` requests/s at each pool's profiled capacity.

    A prefill pool's capacity counts prefill legs, and only some requests take one: every
    request is counted as one here (an upper bound; a trace's first turns all take one).
    Example: 8 req/s, prefill 0.71 and decode 5.97 req/s per replica: "12:2"."""
    out = []
    for role in ROLES:
        per_replica = capacity[role].rate_per_replica
        if per_replica <= 0:
            raise SystemExit(f"--pd-min auto: the {role} pool missed its targets at every rate "
                             "swept (capacity 0); give --pd-min PREFILL:DECODE")
        out.append(str(max(1, math.ceil(rate / per_replica))))
    return ":".join(out)


def run(setup: str, params: profiles.EngineParams, reqs: list[SimRequest], end: float,
        args: argparse.Namespace, capacity: Capacity,
        pd_capacity: dict[str, Capacity]) -> dict[str, Any]:
    loop = EventLoop()
    scalers: dict[str, SimAutoscaler] = {}
    until = end + 60.0
    if setup.startswith("unified"):
        start = args.max if setup == "unified_static" else args.min
        pool = SimCluster(loop, params, "kv_aware", start, max_ongoing_requests=args.max_ongoing)
        pool.submit(reqs)
        policy = _policy("unified", args.min, args.max, args, capacity) \
            if setup == "unified_autoscaler" else _still
        scalers["unified"] = SimAutoscaler(loop, pool, policy, until=until)
    else:
        low, high = _split(args.pd_min), _split(args.pd_max)
        prefill, decode = _split(args.pd_static) if setup == "pd_static" else low
        sim = SimPDCluster(loop, params, "kv_aware", prefill, decode,
                           transfer_bytes_per_s=args.transfer_gb_s * 1e9,
                           transfer_latency_s=args.transfer_latency_ms / 1e3,
                           max_ongoing_requests=args.max_ongoing)
        sim.submit(reqs)
        for index, (role, pool) in enumerate(zip(ROLES, (sim.prefill, sim.decode))):
            plan = pd_capacity[role] if setup in PLANNED else None
            rise = args.rise if setup == "pd_autoscaler_rise" else 0.0
            policy = _policy(role, low[index], high[index], args, plan, rise) \
                if setup in (*PLANNED, "pd_reactive") else _still
            scalers[role] = SimAutoscaler(loop, pool, policy, until=until)
    began = time.perf_counter()
    for scaler in scalers.values():
        scaler.start()
    loop.run()
    itl = [r.itl_sum_s / r.itl_count if r.itl_count else 0.0 for r in reqs if r.first_token]
    return {"setup": setup, **outcome(reqs, params, args),
            "itl_p99_s": percentile(itl, 99),
            "replica_seconds": sum(s.replica_seconds for s in scalers.values()),
            "replica_seconds_by_pool": {role: s.replica_seconds for role, s in scalers.items()},
            "max_replicas_by_pool": {role: max(n for _, n in s.timeline)
                                     for role, s in scalers.items()},
            "scale_changes": sum(len(s.decisions) for s in scalers.values()),
            "timeline_by_pool": {role: s.timeline[::5] for role, s in scalers.items()},
            "wall_s": time.perf_counter() - began}


def plot(records: list[dict[str, Any]], phases: list[tuple[float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in records:
        pools = r["timeline_by_pool"]
        times = [t for t, _ in next(iter(pools.values()))]
        held = [sum(n for n in counts) for counts in zip(*([n for _, n in tl]
                                                            for tl in pools.values()))]
        top.step(times, held, where="post", label=f"{r['setup']} (SLO {r['slo_attainment']:.3f}, "
                 f"{r['replica_seconds'] / 3600:.1f} replica-h)")
        if "prefill" in pools and r["setup"] in PLANNED:
            for role, style in (("prefill", "-"), ("decode", "--")):
                t, n = zip(*pools[role])
                bottom.step(t, n, where="post", linestyle=style, label=f"{r['setup']}: {role}")
    for ax in (top, bottom):
        mark_phases(ax, phases)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    top.set_ylabel("replicas held, all pools")
    bottom.set_ylabel("replicas held, per pool")
    bottom.set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, SETUPS, "sim_pd_autoscaling.json")
    parser.add_argument("--pd-min", default="auto",
                        help="PREFILL:DECODE least replicas, or auto: each pool's floor serves "
                        "the first phase's rate at its profiled capacity, every request counted "
                        "as a prefill leg (as --min 8 does the unified pool's, at 1 req/s per "
                        "replica)")
    parser.add_argument("--pd-max", default="48:32", help="PREFILL:DECODE most replicas")
    parser.add_argument("--pd-static", default="48:16", help="PREFILL:DECODE of pd_static")
    parser.add_argument("--transfer-gb-s", type=float, default=50.0)
    parser.add_argument("--transfer-latency-ms", type=float, default=1.0)
    args = parser.parse_args()
    p = prepare(args)
    began = time.perf_counter()
    # the planned setups plan with them; --pd-min auto sizes the autoscaled P/D floors by them
    setups = set(args.setups.split(","))
    needed = bool(set(PLANNED) & setups) or (args.pd_min == "auto" and "pd_reactive" in setups)
    pd_capacity = profile_pd(p.params, p.rows, args) if needed else {}
    pd_profiled_s = time.perf_counter() - began
    pd_min_rule, settings = args.pd_min, dict(vars(args))  # as given, before auto's floors
    if args.pd_min == "auto":
        args.pd_min = floors(p.phases[0][1], pd_capacity)
    print(f"profiled P/D in {pd_profiled_s:.0f}s: " + ", ".join(
        f"{role} {c.rate_per_replica:.2f} req/s" for role, c in pd_capacity.items()), flush=True)
    records = []
    for setup in args.setups.split(","):
        record = run(setup, p.params, requests(p.params, p.rows, p.times, args.max_output_tokens),
                     sum(s for s, _ in p.phases), args, p.capacity, pd_capacity)
        print(json.dumps({k: v for k, v in record.items() if k != "timeline_by_pool"}),
              flush=True)
        records.append(record)
    result = {"args": settings, "profile": args.profile, "phases": p.phases, "ramp_s": args.ramp_s,
              "transfer_gb_s": args.transfer_gb_s, "ttft_slo_s": args.ttft_slo,
              "itl_slo_s": args.itl_slo, "start_latency_s": p.params.start_latency_s,
              "capacity": msgspec.to_builtins(p.capacity), "profile_wall_s": p.profiled_s,
              "pd_capacity": msgspec.to_builtins(pd_capacity), "pd_profile_wall_s": pd_profiled_s,
              "pd_min": args.pd_min, "pd_min_rule": pd_min_rule,
              "records": records}
    print(write(Path(args.out), result, markdown,
                lambda result, path: plot(result["records"], p.phases, path)))


def markdown(result: dict[str, Any]) -> str:
    args = argparse.Namespace(**result["args"])
    rule = result.get("pd_min_rule", "4:4")  # the runs before --pd-min auto were at 4:4
    rise = (f" --rise {args.rise:g}" if any(r["setup"] == "pd_autoscaler_rise"
                                            for r in result["records"]) else "")
    floor = (f" The P/D pools' floors (--pd-min auto) serve the first phase's rate at each pool's "
             f"profiled capacity (below): {result['pd_min']} (prefill:decode)."
             if rule == "auto" else "")
    lines = [
        "# Prefill and decode pools autoscaled, simulated", "",
        f"`python benchmarks/simulated/sim_pd_autoscaling.py --phases {args.phases} --rates "
        f"{args.rates} --ramp-s {args.ramp_s:g} --min {args.min} --max {args.max} --pd-min {rule} "
        f"--pd-max {args.pd_max} --pd-static {args.pd_static}{rise} --transfer-gb-s "
        f"{args.transfer_gb_s:g}`: Poisson arrivals of the Mooncake trace's requests, profile "
        f"`{args.profile}`, kv_aware routing in every pool; SLO: TTFT <= {args.ttft_slo:g} s and "
        f"mean inter-token gap <= {args.itl_slo:g} s. Simulated engines, tokenfab's real router "
        "and autoscaler policy (see sim/README.md); replicas start in "
        f"{result['start_latency_s']:g} s.{floor}", "",
        "| setup | SLO attainment | replica-seconds (prefill + decode) | x unified_static "
        "| TTFT p50 / p90 (s) | ITL p90 / p99 (ms) | most replicas | scale changes |",
        "|---|---:|---:|---:|---|---|---|---:|",
    ]
    base = next((r["replica_seconds"] for r in result["records"]
                 if r["setup"] == "unified_static"), None)
    for r in result["records"]:
        ratio = f"{r['replica_seconds'] / base:.2f}" if base else "-"
        pools = r["replica_seconds_by_pool"]
        split = f" ({pools['prefill']:.0f} + {pools['decode']:.0f})" if "prefill" in pools else ""
        most = ":".join(str(n) for n in r["max_replicas_by_pool"].values())
        lines.append(f"| {r['setup']} | {r['slo_attainment']:.3f} | "
                     f"{r['replica_seconds']:.0f}{split} | {ratio} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p90_s']:.2f} | {r['itl_p90_s'] * 1e3:.1f} / "
                     f"{r['itl_p99_s'] * 1e3:.1f} | {most} | {r['scale_changes']} |")
    lines += targets(result["records"])
    lines += window_table(result["records"])
    for pd in (r for r in result["records"] if r["setup"] in (*PLANNED, "pd_reactive")):
        lines += ["", f"{pd['setup']}'s pools, replicas held at the end of each window "
                  "(prefill:decode):", ""]
        timeline = pd["timeline_by_pool"]
        phases = [seconds for seconds, _ in result["phases"]]
        for name, (_, end) in windows(phases, result["start_latency_s"]).items():
            lines.append(f"- {name}: " + ":".join(str(_at(timeline[role], end))
                                                  for role in ROLES))
    cap = result["capacity"]
    lines += ["", f"The unified plan's capacity, profiled first: {cap['rate_per_replica']:g} "
              f"req/s and {cap['ongoing_per_replica']:.1f} requests in flight per replica "
              f"({result['profile_wall_s']:.0f} s of wall time)."]
    if result["pd_capacity"]:
        lines[-1] += (f" Each pool's, profiled next ({result['pd_profile_wall_s']:.0f} s), in "
                      "its own arrivals (the highest point swept when none missed a target: a "
                      "lower bound):")
        lines += ["", "| pool | capacity (req/s per replica) | in flight per replica "
                  "| points swept | highest swept (req/s) |", "|---|---:|---:|---:|---:|"]
    for role, c in result["pd_capacity"].items():
        lines.append(f"| {role} | {c['rate_per_replica']:.2f} | "
                     f"{c['ongoing_per_replica']:.1f} | {len(c['points'])} | "
                     f"{c['points'][-1]['rate_per_replica']:.2f} |")
    return "\n".join(lines) + "\n"


def targets(records: list[dict[str, Any]]) -> list[str]:
    """Each autoscaled setup against each static one, by the issue's measure: attainment at
    least the static setup's at <= 0.7x its replica-seconds."""
    static = [r for r in records if r["setup"].endswith("_static")]
    if not static:
        return []
    lines = ["", "Against each static setup (the target: attainment at least the static one's "
             "at <= 0.7x its replica-seconds; attainment to four places):", ""]
    for r in records:
        if r["setup"].endswith("_static"):
            continue
        lines.append(f"- {r['setup']}: " + "; ".join(
            f"{r['slo_attainment']:.4f} against {s['setup']}'s {s['slo_attainment']:.4f} at "
            f"{r['replica_seconds'] / s['replica_seconds']:.3f}x: " +
            ("met" if meets_target(r, s) else "not met")
            for s in static))
    return lines


def _at(timeline: list[list[float]], t: float) -> int:
    """Replicas held at time `t` (the last sample at or before it)."""
    held = timeline[0][1]
    for at, n in timeline:
        if at > t:
            break
        held = n
    return int(held)


if __name__ == "__main__":
    main()
