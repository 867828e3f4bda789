"""Autoscaling at scale, in simulation: quiet, burst, quiet on up to 64 replicas of a GPU profile,
tokenfab's autoscaler policy and Ray Serve's default against static pools, one run.

Requests are the Mooncake trace's shapes (prompts at full length up to the profile's context,
outputs up to --max-output-tokens, the trace's prefixes kept), arriving as a Poisson process at
each phase's rate; tokenfab's kv_aware router places them. Setups:

- autoscaler: tokenfab's policy (`autoscaler.serve_policy.PoolPolicy`), --min..--max replicas,
  planning: its capacity per replica (`capacity_rps`, and `target_ongoing`) is profiled first, in
  this run, by `sim.profile` on 8 replicas at a sweep of rates against the same targets;
- autoscaler_rise: the same with a declared rise (`rise_rps_per_s`, --rise): the plan keeps that
  rise over one replica start in hand;
- reactive: the same policy without the plan (`capacity_rps` 0), the profiled `target_ongoing`;
- ray_default: Ray Serve's default (`ray_requests_policy`, target 2 ongoing requests per
  replica, 30 s up and 600 s down delays), same bounds;
- static_max: --max replicas all the time; static_min: --min replicas.

The first quiet phase is longer than Serve's default 600 s scale-down delay: every setup meets
the burst at the size its policy holds for the quiet rate, not at what the start-up transient
left (with a 300 s first phase, ray_default still held the replicas the trace's heavy first
minute had asked for when the burst came).

A request meets the SLO when its TTFT is at most --ttft-slo and its mean inter-token gap at most
--itl-slo. Replica-seconds count every replica from its start until it is gone (a starting or
draining replica holds its GPU too).

    .venv/bin/python benchmarks/simulated/sim_autoscaling.py [--phases 900,600,600 --rates 8,45,8]
    .venv/bin/python benchmarks/simulated/sim_autoscaling.py --ramp-s 300 \
        --out benchmarks/results/sim_autoscaling-ramp.json

Writes benchmarks/results/sim_autoscaling.{json,md,png} (the burst a step, as the issue's
pattern) or, with --ramp-s, the file --out names (the burst reached over that many seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np

from autoscaler.serve_policy import PoolPolicy, ray_requests_policy
from benchmarks.autoscaling import arrivals
from benchmarks.common.results import RESULTS, TRACE, write
from sim import params as profiles
from sim import workload
from sim.autoscale import ServeDelays, SimAutoscaler
from sim.cluster import SimCluster
from sim.engine import SimRequest
from sim.loop import EventLoop
from sim.profile import Capacity, sweep
from tokenfab.stats import percentile

SETUPS = ["autoscaler", "autoscaler_rise", "reactive", "ray_default", "static_max", "static_min"]


def requests(params: profiles.EngineParams, rows: list[dict[str, Any]], times: list[float],
             max_output: int) -> list[SimRequest]:
    """The trace's requests in order (tiled when more are needed), at `times`."""
    tiled = workload.tile(rows, math.ceil(len(times) / len(rows)))
    out = []
    for index, (row, at) in enumerate(zip(tiled, times)):
        prompt = min(row["input_length"] + 1, params.max_model_len - max_output)
        full = prompt // params.block_size
        out.append(SimRequest(f"q{index}", at, prompt,
                              workload.block_hashes(row["hash_ids"], full, 512,
                                                    params.block_size),
                              max(1, min(max_output, row["output_length"]))))
    return out


def profile(params: profiles.EngineParams, rows: list[dict[str, Any]],
            args: argparse.Namespace) -> Capacity:
    """What one replica serves within the targets, on this workload (sim.profile)."""
    def make(rate: float, seconds: float) -> list[SimRequest]:
        return requests(params, rows, arrivals([(seconds, rate)], args.seed + 1),
                        args.max_output_tokens)

    return sweep(params, make, [0.25 * i for i in range(1, 17)], args.ttft_slo, args.itl_slo,
                 replicas=8, seconds=240.0, max_ongoing_requests=args.max_ongoing)


def policy_for(setup: str, args: argparse.Namespace, capacity: Capacity) -> Any:
    if setup in ("autoscaler", "autoscaler_rise", "reactive"):
        return PoolPolicy("sim", "main", role="unified", min_replicas=args.min,
                          max_replicas=args.max, ttft_p90_s=args.ttft_slo,
                          itl_p90_s=args.itl_slo, target_ongoing=capacity.ongoing_per_replica,
                          downscale_delay_s=30.0, replica_start_s=args.replica_start_s,
                          capacity_rps=0 if setup == "reactive" else capacity.rate_per_replica,
                          rise_rps_per_s=args.rise if setup == "autoscaler_rise" else 0.0)
    if setup == "ray_default":
        def raw(ctx: Any) -> tuple[float, dict[str, Any]]:
            ctx.config = _TargetTwo()
            return ray_requests_policy(ctx)

        return ServeDelays(raw, args.min, args.max)
    return None


class _TargetTwo:
    @staticmethod
    def get_target_ongoing_requests() -> float:
        return 2.0  # Serve's default target_ongoing_requests


def run(setup: str, params: profiles.EngineParams, reqs: list[SimRequest], end: float,
        args: argparse.Namespace, capacity: Capacity) -> dict[str, Any]:
    loop = EventLoop()
    start = args.max if setup == "static_max" else args.min
    sim = SimCluster(loop, params, "kv_aware", start, max_ongoing_requests=args.max_ongoing)
    sim.submit(reqs)
    policy = policy_for(setup, args, capacity)
    began = time.perf_counter()
    scaler = SimAutoscaler(loop, sim, policy or (lambda ctx: (ctx.target_num_replicas, {})),
                           until=end + 60.0)
    scaler.start()
    loop.run()
    return {"setup": setup, **outcome(reqs, params, args),
            "replica_seconds": scaler.replica_seconds,
            "max_replicas": max(n for _, n in scaler.timeline),
            "scale_changes": len(scaler.decisions),
            "timeline": scaler.timeline[::5], "wall_s": time.perf_counter() - began}


def outcome(reqs: list[SimRequest], params: profiles.EngineParams,
            args: argparse.Namespace) -> dict[str, Any]:
    """What a replay gave its requests: SLO attainment (overall and per window) and latencies."""
    done = [r for r in reqs if r.first_token is not None]
    ttft = np.array([r.first_token - r.arrival for r in done])
    itl = np.array([r.itl_sum_s / r.itl_count if r.itl_count else 0.0 for r in done])
    met = sum(t <= args.ttft_slo and i <= args.itl_slo for t, i in zip(ttft, itl))
    spans = windows([float(x) for x in args.phases.split(",")], params.start_latency_s)
    return {"requests": len(reqs), "unfinished": len(reqs) - len(done),
            "slo_attainment": met / len(reqs),
            "slo_attainment_by_window": by_window(reqs, spans, args),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "itl_p90_s": percentile(itl, 90)}


def schedule(phases: list[tuple[float, float]], ramp_s: float,
             step_s: float = 5.0) -> list[tuple[float, float]]:
    """The phases, each after the first reaching its rate linearly over its first `ramp_s`
    seconds (in `step_s` steps) instead of at once.

    Example: (300 s at 8), (600 s at 45), ramp 300 s: 300 s at 8, then 60 steps of 5 s from
    8.6 to 45 req/s, then 300 s at 45."""
    out = [phases[0]]
    for (_, before), (seconds, rate) in zip(phases, phases[1:]):
        ramp = min(ramp_s, seconds)
        steps = int(ramp // step_s)
        out += [(step_s, before + (rate - before) * (k + 1) / steps) for k in range(steps)]
        out.append((seconds - steps * step_s, rate))
    return out


def windows(seconds: list[float], start_latency_s: float) -> dict[str, list[float]]:
    """The phases (`seconds` long each), and the first start latency of each phase after the
    first (while replicas asked for at its start cannot serve yet)."""
    out, edge = {}, 0.0
    for index, length in enumerate(seconds):
        out[f"phase {index + 1}"] = [edge, edge + length]
        if index:
            out[f"phase {index + 1}, first {start_latency_s:.0f}s"] = \
                [edge, edge + min(length, start_latency_s)]
        edge += length
    return out


def by_window(reqs: list[SimRequest], spans: dict[str, list[float]],
              args: argparse.Namespace) -> dict[str, float]:
    out = {}
    for name, (begin, end) in spans.items():
        inside = [r for r in reqs if begin <= r.arrival < end]
        met = sum(r.first_token is not None and r.first_token - r.arrival <= args.ttft_slo
                  and (r.itl_sum_s / r.itl_count if r.itl_count else 0.0) <= args.itl_slo
                  for r in inside)
        out[name] = met / len(inside) if inside else float("nan")
    return out


def plot(records: list[dict[str, Any]], phases: list[tuple[float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in records:
        times, counts = zip(*r["timeline"])
        ax.step(times, counts, where="post", label=f"{r['setup']} "
                f"(SLO {r['slo_attainment']:.2f}, {r['replica_seconds'] / 3600:.1f} replica-h)")
    mark_phases(ax, phases)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("replicas held")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def mark_phases(ax: Any, phases: list[tuple[float, float]]) -> None:
    edge = 0.0
    for seconds, _ in phases[:-1]:
        edge += seconds
        ax.axvline(edge, color="grey", linestyle=":")


class Pattern(NamedTuple):
    """A benchmark's workload, as `prepare` makes it from the command line."""

    params: profiles.EngineParams
    phases: list[tuple[float, float]]
    times: list[float]  # the requests' arrivals
    rows: list[dict[str, Any]]  # the trace
    capacity: Capacity  # the unified plan's, profiled
    profiled_s: float


def add_arguments(parser: argparse.ArgumentParser, setups: list[str], out: str) -> None:
    """The options of both autoscaling benchmarks: the pattern, the SLO, the unified pool."""
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--phases", default="900,600,600", help="seconds of each phase")
    parser.add_argument("--rates", default="8,45,8", help="requests/s of each phase")
    parser.add_argument("--ramp-s", type=float, default=0.0,
                        help="each phase reaches its rate over this many seconds (0: a step)")
    parser.add_argument("--min", type=int, default=8)
    parser.add_argument("--max", type=int, default=64)
    parser.add_argument("--max-ongoing", type=int, default=256,
                        help="requests a replica accepts; beyond, gateways hold them")
    parser.add_argument("--replica-start-s", type=float, default=60.0,
                        help="the plan's horizon until it has measured a start")
    parser.add_argument("--ttft-slo", type=float, default=3.0)
    parser.add_argument("--itl-slo", type=float, default=0.1)
    parser.add_argument("--max-output-tokens", type=int, default=1024)
    parser.add_argument("--setups", default=",".join(setups))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rise", type=float, default=0.12,
                        help="the *_rise setups' declared rise (autoscaler.rise_rps_per_s), "
                        "requests/s per second: the users' stated bound on how fast their "
                        "traffic rises (0.12: about 37 req/s over 5 minutes)")
    parser.add_argument("--out", default=str(RESULTS / out))


def prepare(args: argparse.Namespace) -> Pattern:
    """The arrivals of the pattern, the trace, and the unified plan's capacity (profiled now)."""
    params = profiles.load(args.profile)
    phases = [(float(s), float(r)) for s, r in zip(args.phases.split(","), args.rates.split(","))]
    times = arrivals(schedule(phases, args.ramp_s), args.seed)
    rows = workload.read_trace(TRACE)
    began = time.perf_counter()
    capacity = profile(params, rows, args)
    profiled_s = time.perf_counter() - began
    print(f"profiled in {profiled_s:.0f}s: {capacity.rate_per_replica:g} req/s, "
          f"{capacity.ongoing_per_replica:.1f} ongoing per replica", flush=True)
    return Pattern(params, phases, times, rows, capacity, profiled_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, SETUPS, "sim_autoscaling.json")
    args = parser.parse_args()
    p = prepare(args)
    records = []
    for setup in args.setups.split(","):
        record = run(setup, p.params, requests(p.params, p.rows, p.times, args.max_output_tokens),
                     sum(s for s, _ in p.phases), args, p.capacity)
        print(json.dumps({k: v for k, v in record.items() if k != "timeline"}), flush=True)
        records.append(record)
    result = {"args": vars(args), "profile": args.profile, "phases": p.phases,
              "ramp_s": args.ramp_s,
              "max_ongoing_requests": args.max_ongoing, "ttft_slo_s": args.ttft_slo,
              "itl_slo_s": args.itl_slo, "start_latency_s": p.params.start_latency_s,
              "capacity": msgspec.to_builtins(p.capacity), "profile_wall_s": p.profiled_s,
              "records": records}
    print(write(Path(args.out), result, markdown,
                lambda result, path: plot(result["records"], p.phases, path)))


def meets_target(record: dict[str, Any], static: dict[str, Any]) -> bool:
    """The issue's target: attainment at least the static setup's at <= 0.7x its
    replica-seconds."""
    return (record["slo_attainment"] >= static["slo_attainment"]
            and record["replica_seconds"] <= 0.7 * static["replica_seconds"])


def window_table(records: list[dict[str, Any]]) -> list[str]:
    """The page's table of each setup's SLO attainment per window (this page's and
    sim_pd_autoscaling's)."""
    names = list(records[0]["slo_attainment_by_window"])
    lines = ["", "SLO attainment of the requests arriving in each window:", "",
             "| setup | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in records:
        lines.append(f"| {r['setup']} | " + " | ".join(
            f"{r['slo_attainment_by_window'][n]:.3f}" for n in names) + " |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    args = argparse.Namespace(**result["args"])
    lines = [
        "# Autoscaling at scale, simulated", "",
        f"`python benchmarks/simulated/sim_autoscaling.py --phases {args.phases} --rates "
        f"{args.rates} --ramp-s {args.ramp_s:g} --min {args.min} --max {args.max} --rise "
        f"{args.rise:g}`: Poisson arrivals of the Mooncake trace's requests, "
        f"profile `{args.profile}`, kv_aware routing; SLO: TTFT <= {args.ttft_slo:g} s and mean "
        f"inter-token gap <= {args.itl_slo:g} s. Simulated engines, tokenfab's real router and "
        "autoscaler policy (see sim/README.md). autoscaler_rise is the autoscaler with a declared "
        f"rise (`autoscaler.rise_rps_per_s: {args.rise:g}`): the plan keeps that rise over one "
        "replica start in hand.", "",
        "| setup | SLO attainment | replica-seconds | x static_max | TTFT p50 / p90 (s) "
        "| ITL p90 (s) | most replicas | scale changes | requests |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    base = next((r["replica_seconds"] for r in result["records"] if r["setup"] == "static_max"),
                None)
    for r in result["records"]:
        ratio = f"{r['replica_seconds'] / base:.2f}" if base else "-"
        lines.append(f"| {r['setup']} | {r['slo_attainment']:.3f} | {r['replica_seconds']:.0f} | "
                     f"{ratio} | {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} | "
                     f"{r['itl_p90_s']:.3f} | {r['max_replicas']} | {r['scale_changes']} | "
                     f"{r['requests']} |")
    static = next((r for r in result["records"] if r["setup"] == "static_max"), None)
    if static is not None:
        lines += ["", "Against static_max (the issue's target: attainment at least static_max's "
                  "at <= 0.7x its replica-seconds):", ""]
        lines += [f"- {r['setup']}: attainment {r['slo_attainment']:.3f} against "
                  f"{static['slo_attainment']:.3f} at {r['replica_seconds'] / base:.2f}x: "
                  + ("met" if meets_target(r, static) else "not met")
                  for r in result["records"] if r["setup"] not in ("static_max", "static_min")]
    lines += window_table(result["records"])
    cap = result["capacity"]
    lines += ["", f"Capacity profiled first (sim.profile, 8 replicas, 240 s per rate, "
              f"{result['profile_wall_s']:.0f} s of wall time): **{cap['rate_per_replica']:g} "
              f"req/s per replica**, {cap['ongoing_per_replica']:.1f} requests in flight each.", "",
              "| req/s per replica | TTFT signal p90 (s) | ITL signal p90 (s) | requests' TTFT "
              "p90 (s) | requests' ITL p90 (s) | in flight per replica |",
              "|---:|---:|---:|---:|---:|---:|"]
    for p in cap["points"]:
        lines.append(f"| {p['rate_per_replica']:g} | {p['ttft_p90_s']:.2f} | "
                     f"{p['itl_p90_s']:.3f} | {p['request_ttft_p90_s']:.2f} | "
                     f"{p['request_itl_p90_s']:.3f} | {p['ongoing_per_replica']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
