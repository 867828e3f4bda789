"""kv_aware's placement at scale, simulated: what the `delay` score buys in SLO attainment and what
it costs in prefix hits, against kv_aware as shipped, a plain heavier load weight, and round_robin.

`delay` (router/scorers.py) scores the waiting a placement adds to everyone on the replica: the
request's own estimated TTFT plus, for each request in flight there, the time its uncached
prefill takes (their decode steps share every engine step with it). The variants, at each rate:

- `round_robin`;
- `kv_aware`: the shipped weights (`ttft`, `approx_prefix`, `cache_room`, 1 each);
- `kv_aware ttft:2`: the same with `ttft` at 2. Where no request is in flight, `delay` equals
  `ttft`, so adding it also doubles the load's weight against affinity; this row is that weight
  without the decodes' delay, to tell the two apart;
- `kv_aware +delay`: the shipped weights plus `delay` at 1;
- `kv_aware delay-for-ttft`: `delay` in place of `ttft`, the load's weight unchanged.

Each replays the Mooncake trace's shapes at one steady Poisson rate on a static pool of simulated
engines (tokenfab's real router code, see sim/README.md), the requests of the first --warmup-s
served but not counted, and reports the hit rate, TTFT p50/p90, SLO attainment (as
sim_autoscaling.py counts it), the requests missed on the inter-token gap alone, and the other
prefills that ran on their replica while they decoded: queued behind them (FCFS ran them right
after their prefill) or arrived during their decode (sim_history.stalling_prefills).

    .venv/bin/python benchmarks/simulated/sim_placement.py

Writes benchmarks/results/sim_placement.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common.results import RESULTS, TRACE, command, write
from benchmarks.simulated.sim_history import replay_args, run, shown_command
from router.policies import DEFAULT_WEIGHTS
from sim import params as profiles
from sim import workload

SHIPPED = DEFAULT_WEIGHTS["kv_aware"]
VARIANTS: dict[str, tuple[str, dict[str, float] | None]] = {
    "round_robin": ("round_robin", None),
    "kv_aware": ("kv_aware", None),
    "kv_aware ttft:2": ("kv_aware", {**SHIPPED, "ttft": 2.0}),
    "kv_aware +delay": ("kv_aware", {**SHIPPED, "delay": 1.0}),
    "kv_aware delay-for-ttft": ("kv_aware", {**{k: v for k, v in SHIPPED.items() if k != "ttft"},
                                             "delay": SHIPPED["ttft"]}),
}


def one(job: tuple[str, float, int, argparse.Namespace]) -> dict[str, Any]:
    variant, rate, seed, args = job
    policy, weights = VARIANTS[variant]
    params = profiles.load(args.profile)
    rows = workload.read_trace(TRACE)
    at_rate = argparse.Namespace(**{**vars(args), "rate": rate})
    record = run(policy, None, seed, params, rows, at_rate, weights)
    record.update(variant=variant, rate=rate, weights=weights or DEFAULT_WEIGHTS[policy])
    print(json.dumps(record), flush=True)
    return record


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        "# kv_aware's placement at scale, simulated: the `delay` score", "",
        f"`{shown_command(result, 'sim_placement')}`: {a['replicas']} static replicas of profile "
        f"`{a['profile']}`, Poisson arrivals of the Mooncake trace's shapes (outputs up to "
        f"{a['max_output_tokens']}) for {a['seconds']:g} s, requests of the first "
        f"{a['warmup_s']:g} s not counted; SLO: TTFT <= {a['ttft_slo']:g} s and mean inter-token "
        f"gap <= {a['itl_slo']:g} s. Simulated engines, tokenfab's real router (see "
        "sim/README.md).", "",
        "| rate (req/s) | variant | seed | hit rate | TTFT p50 / p90 (s) | mean gap p90 (s) "
        "| SLO attainment | missed on the gap alone "
        "| prefills stalling them: queued behind / arrived during decode | requests |",
        "|---:|---|---:|---:|---|---:|---:|---:|---|---:|",
    ]
    for r in result["records"]:
        lines.append(
            f"| {r['rate']:g} | {r['variant']} | {r['seed']} | {r['hit_rate']:.3f} | "
            f"{r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} | {r['itl_mean_p90_s']:.4f} | "
            f"{r['slo_attainment']:.4f} | {r['missed_on_gap_only']} | "
            f"{r['stalling_prefills_queued_behind']} / {r['stalling_prefills_during_decode']} | "
            f"{r['requests']} |")
    lines += ["", "Against `kv_aware` as shipped, same rate and seed (hit rate and SLO attainment "
              "as differences in points, TTFT p50 and p90 as ratios):", ""]
    base = {(r["rate"], r["seed"]): r for r in result["records"] if r["variant"] == "kv_aware"}
    for r in result["records"]:
        b = base.get((r["rate"], r["seed"]))
        if b is None or r is b:
            continue
        lines.append(
            f"- {r['rate']:g} req/s, seed {r['seed']}, {r['variant']}: hit rate "
            f"{100 * (r['hit_rate'] - b['hit_rate']):+.1f}, SLO attainment "
            f"{100 * (r['slo_attainment'] - b['slo_attainment']):+.2f}, TTFT p50 "
            f"{r['ttft_p50_s'] / b['ttft_p50_s']:.3f}x, p90 "
            f"{r['ttft_p90_s'] / b['ttft_p90_s']:.3f}x")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    replay_args(parser)
    parser.add_argument("--rates", default="25,45,58")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--jobs", type=int, default=2, help="replays run at once (processes)")
    parser.add_argument("--out", default=str(RESULTS / "sim_placement.json"))
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")
    jobs = [(v, float(rate), int(seed), args) for rate in args.rates.split(",")
            for seed in args.seeds.split(",") for v in variants]
    with ProcessPoolExecutor(args.jobs) as pool:
        records = list(pool.map(one, jobs))
    result = {"command": command(), "args": vars(args), "records": records}
    print(write(Path(args.out), result, markdown))


if __name__ == "__main__":
    main()
