"""Autoscaling at scale, in simulation: quiet, burst, quiet on up to 64 replicas of a GPU profile,
tokenfab's autoscaler policy and Ray Serve's default against static pools, one run.

Requests are the Mooncake trace's shapes (prompts at full length up to the profile's context,
outputs up to --max-output-tokens, the trace's prefixes kept), arriving as a Poisson process at
each phase's rate; tokenfab's kv_aware router places them. Setups:

- autoscaler: tokenfab's policy (`autoscaler.serve_policy.PoolPolicy`), --min..--max replicas;
- ray_default: Ray Serve's default (`ray_requests_policy`, target 2 ongoing requests per
  replica, 30 s up and 600 s down delays), same bounds;
- static_max: --max replicas all the time; static_min: --min replicas.

A request meets the SLO when its TTFT is at most --ttft-slo and its mean inter-token gap at most
--itl-slo. Replica-seconds count every replica from its start until it is gone (a starting or
draining replica holds its GPU too).

    .venv/bin/python benchmarks/sim_autoscaling.py [--phases 300,600,300 --rates 8,45,8]

Writes benchmarks/results/sim_autoscaling.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from autoscaler.serve_policy import PoolPolicy, ray_requests_policy
from autoscaling import arrivals
from sim import params as profiles
from sim import workload
from sim.autoscale import ServeDelays, SimAutoscaler
from sim.cluster import SimCluster
from sim.engine import SimRequest
from sim.loop import EventLoop

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
TRACE = ROOT.parent / "shared/traces/synthetic_trace.jsonl"
SETUPS = ["autoscaler", "ray_default", "static_max", "static_min"]


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


def policy_for(setup: str, args: argparse.Namespace) -> Any:
    if setup == "autoscaler":
        return PoolPolicy("sim", "main", role="unified", min_replicas=args.min,
                          max_replicas=args.max, ttft_p90_s=args.ttft_slo,
                          itl_p90_s=args.itl_slo, target_ongoing=args.target_ongoing,
                          downscale_delay_s=30.0)
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
        args: argparse.Namespace) -> dict[str, Any]:
    loop = EventLoop()
    start = args.max if setup == "static_max" else args.min
    sim = SimCluster(loop, params, "kv_aware", start)
    sim.submit(reqs)
    policy = policy_for(setup, args)
    began = time.perf_counter()
    scaler = SimAutoscaler(loop, sim, policy or (lambda ctx: (ctx.target_num_replicas, {})),
                           until=end + 60.0)
    scaler.start()
    loop.run()
    done = [r for r in reqs if r.first_token is not None]
    ttft = np.array([r.first_token - r.arrival for r in done])
    itl = np.array([r.itl_sum_s / r.itl_count if r.itl_count else 0.0 for r in done])
    met = sum(t <= args.ttft_slo and i <= args.itl_slo for t, i in zip(ttft, itl))
    return {"setup": setup, "requests": len(reqs), "unfinished": len(reqs) - len(done),
            "slo_attainment": met / len(reqs), "replica_seconds": scaler.replica_seconds,
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p90_s": float(np.percentile(ttft, 90)),
            "itl_p90_s": float(np.percentile(itl, 90)),
            "max_replicas": max(n for _, n in scaler.timeline),
            "scale_changes": len(scaler.decisions),
            "timeline": scaler.timeline[::5], "wall_s": time.perf_counter() - began}


def plot(records: list[dict[str, Any]], phases: list[tuple[float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in records:
        times, counts = zip(*r["timeline"])
        ax.step(times, counts, where="post", label=f"{r['setup']} "
                f"(SLO {r['slo_attainment']:.2f}, {r['replica_seconds'] / 3600:.1f} replica-h)")
    edge = 0.0
    for seconds, _ in phases[:-1]:
        edge += seconds
        ax.axvline(edge, color="grey", linestyle=":")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("replicas held")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--phases", default="300,600,300", help="seconds of each phase")
    parser.add_argument("--rates", default="8,45,8", help="requests/s of each phase")
    parser.add_argument("--min", type=int, default=8)
    parser.add_argument("--max", type=int, default=64)
    parser.add_argument("--target-ongoing", type=float, default=8.0)
    parser.add_argument("--ttft-slo", type=float, default=3.0)
    parser.add_argument("--itl-slo", type=float, default=0.1)
    parser.add_argument("--max-output-tokens", type=int, default=1024)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "sim_autoscaling.json"))
    args = parser.parse_args()
    params = profiles.load(args.profile)
    phases = [(float(s), float(r)) for s, r in zip(args.phases.split(","), args.rates.split(","))]
    times = arrivals(phases, args.seed)
    rows = workload.read_trace(TRACE)
    records = []
    for setup in args.setups.split(","):
        record = run(setup, params, requests(params, rows, times, args.max_output_tokens),
                     sum(s for s, _ in phases), args)
        print(json.dumps({k: v for k, v in record.items() if k != "timeline"}), flush=True)
        records.append(record)
    result = {"profile": args.profile, "phases": phases, "ttft_slo_s": args.ttft_slo,
              "itl_slo_s": args.itl_slo, "records": records}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result, args))
    plot(records, phases, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "# Autoscaling at scale, simulated", "",
        f"`python benchmarks/sim_autoscaling.py --phases {args.phases} --rates {args.rates} "
        f"--min {args.min} --max {args.max}`: Poisson arrivals of the Mooncake trace's requests, "
        f"profile `{args.profile}`, kv_aware routing; SLO: TTFT <= {args.ttft_slo:g} s and mean "
        f"inter-token gap <= {args.itl_slo:g} s. Simulated engines, tokenfab's real router and "
        "autoscaler policy (see sim/README.md).", "",
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
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
