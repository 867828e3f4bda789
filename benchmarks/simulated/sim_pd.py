"""Prefill/decode pools against a unified pool of the same size, in simulation, at GPU scale.

The same requests (the Mooncake trace at full length, tiled as `simulator.py` tiles it) go to a
unified pool of --replicas engines and to prefill/decode splits of the same engines, each split at
each KV transfer bandwidth. Both route with tokenfab's real router (--policy, on each pool); P/D
sends prompts that would leave decode at least --min-prompt-tokens to compute through a prefill
leg, and decode pulls their KV (`sim/pd.py`). The engines are the --profile's (default: the H100
Llama-3.1-8B roofline, 128 KiB of KV per token), so this compares shapes of one cluster, not
measured systems.

Per record: TTFT p50/p90/p99, each request's mean inter-token gap (ITL) p50/p90/p99, the share of
prompt tokens no engine computed (hit rate), output tokens/s, how many requests took the prefill
leg, the KV pulled and how long pulls took.

    .venv/bin/python benchmarks/simulated/sim_pd.py [--replicas 16] [--splits 4:12,8:8]

Writes benchmarks/results/sim_pd.{json,md,png}.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.common.results import RESULTS, TRACE, write
from sim import params as profiles
from sim import pd, workload
from sim.run import replay

TOKENS_PER_ID = 512


def requests(params: profiles.EngineParams, rows: list[dict[str, Any]], rate: float,
             args: argparse.Namespace) -> list:
    return workload.requests(
        rows, rate, tokens_per_id=TOKENS_PER_ID, block_size=params.block_size,
        max_prompt_tokens=params.max_model_len - args.max_output_tokens, start=0.0,
        output_tokens=lambda row: max(1, min(args.max_output_tokens, row["output_length"])))


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    params = profiles.load(args.profile)
    rows = workload.read_trace(Path(args.trace))
    copies = max(1, math.ceil(args.replicas * args.requests_per_replica / len(rows)))
    tiled = workload.tile(rows, copies, seed=args.seed)
    began, records = time.monotonic(), []
    for per_replica in (float(r) for r in args.rates_per_replica.split(",")):
        rate = per_replica * args.replicas
        base = {"rate_rps": rate, "rate_per_replica": per_replica}
        unified = replay(params, args.policy, args.replicas,
                         lambda i, start: requests(params, tiled, rate, args), seed=args.seed)
        unified.pop("per_request")
        records.append(base | {"setup": "unified", "prefill": 0, "decode": args.replicas,
                               "transfer_gb_s": None, **unified})
        _print(records[-1])
        for gb_s in (float(b) for b in args.bandwidths_gb_s.split(",")):
            for split in args.splits.split(","):
                prefill, decode = (int(n) for n in split.split(":"))
                result = pd.replay(params, args.policy, prefill, decode,
                                   requests(params, tiled, rate, args),
                                   transfer_bytes_per_s=gb_s * 1e9,
                                   transfer_latency_s=args.transfer_latency_ms / 1e3,
                                   min_prompt_tokens=args.min_prompt_tokens, seed=args.seed)
                records.append(base | {"setup": f"pd {prefill}:{decode}", "prefill": prefill,
                                       "decode": decode, "transfer_gb_s": gb_s, **result})
                _print(records[-1])
    return {"args": vars(args), "profile": msgspec.to_builtins(params), "trace_requests": len(rows),
            "copies": copies, "records": records, "wall_s": time.monotonic() - began}


def _print(r: dict[str, Any]) -> None:
    link = "" if r["transfer_gb_s"] is None else f"{r['transfer_gb_s']:g} GB/s "
    print(f"{r['rate_rps']:g} req/s {r['setup']} {link}"
          f"TTFT p50 {r['ttft_p50_s']:.3f} p90 {r['ttft_p90_s']:.3f}s, ITL p50 "
          f"{r['itl_p50_s'] * 1e3:.1f} p90 {r['itl_p90_s'] * 1e3:.1f} ms, "
          f"hit {r['hit_rate']:.3f}, "
          f"{r['output_tok_s']:.0f} tok/s, unfinished {r['unfinished']}", flush=True)


def markdown(result: dict[str, Any]) -> str:
    args, p = argparse.Namespace(**result["args"]), result["profile"]
    lines = [
        "# Prefill/decode pools against a unified pool, simulated", "",
        f"`python benchmarks/simulated/sim_pd.py --replicas {args.replicas} --splits {args.splits} "
        f"--bandwidths-gb-s {args.bandwidths_gb_s} --rates-per-replica {args.rates_per_replica} "
        f"--policy {args.policy}`. Run took {result['wall_s'] / 60:.1f} min.", "",
        f"Simulated, not measured: engines of profile `{p['name']}` ({p['source']}), "
        f"{p['kv_bytes_per_token']:,} bytes of KV per token; a pull takes "
        f"{args.transfer_latency_ms:g} ms plus its bytes at the bandwidth. Real: tokenfab's "
        f"router (`{args.policy}`) places every request in each pool, and the gateway's rule "
        f"(`router.recent_prefixes.skip_prefill`, {args.min_prompt_tokens} tokens) decides "
        "which take a prefill leg.", "",
        f"Workload: `{TRACE.name}` ({result['trace_requests']} requests) tiled "
        f"{result['copies']}x, prompts up to {p['max_model_len'] - args.max_output_tokens} "
        f"tokens, outputs up to {args.max_output_tokens}; the same requests for every setup. "
        "ITL is each request's mean gap between its tokens; hit rate is the share of prompt "
        "tokens no engine computed; of the requests that took a prefill leg, their prefill hit "
        "rate is what the prefill engines had cached of their prompts; the others' is what "
        "decode had of theirs.", "",
        "| load | setup | KV link (GB/s) | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) "
        "| ITL p50 (ms) | ITL p90 (ms) | ITL p99 (ms) | hit rate | output tok/s "
        "| via prefill | their prefill hit rate | others' hit rate | KV pulled (GB) "
        "| pull p90 (ms) | unfinished |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["records"]:
        pulled = "" if r["transfer_gb_s"] is None else f"{r['pulled_gb']:.1f}"
        pull = "" if r["transfer_gb_s"] is None else f"{r['pull_p90_s'] * 1e3:.1f}"
        via = "" if r["transfer_gb_s"] is None else (
            f"{r['disaggregated']} | {r['prefill_leg_hit_rate']:.3f} | "
            f"{r['decode_only_hit_rate']:.3f}")
        link = "" if r["transfer_gb_s"] is None else f"{r['transfer_gb_s']:g}"
        lines.append(
            f"| {r['rate_rps']:g} req/s | {r['setup']} | {link} | {r['ttft_p50_s']:.3f} | "
            f"{r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['itl_p50_s'] * 1e3:.1f} | "
            f"{r['itl_p90_s'] * 1e3:.1f} | {r['itl_p99_s'] * 1e3:.1f} | {r['hit_rate']:.3f} | "
            f"{r['output_tok_s']:.0f} | {via or ' | | '} | {pulled} | {pull} | "
            f"{r['unfinished']} |")
    lines += ["", "Each P/D setup against the unified pool at the same load:", ""]
    for r in result["records"]:
        if r["transfer_gb_s"] is None:
            base = r
            continue
        lines.append(
            f"- {r['rate_rps']:g} req/s, {r['setup']} at {r['transfer_gb_s']:g} GB/s: "
            f"TTFT p50 {r['ttft_p50_s'] / base['ttft_p50_s']:.2f}x, p90 "
            f"{r['ttft_p90_s'] / base['ttft_p90_s']:.2f}x; ITL p50 "
            f"{r['itl_p50_s'] / base['itl_p50_s']:.2f}x, p90 "
            f"{r['itl_p90_s'] / base['itl_p90_s']:.2f}x, p99 "
            f"{r['itl_p99_s'] / base['itl_p99_s']:.2f}x; output tok/s "
            f"{r['output_tok_s'] / base['output_tok_s']:.2f}x")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate_rps"] for r in result["records"]))
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.8), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for r in (r for r in result["records"] if r["rate_rps"] == rate):
            label = r["setup"] if r["transfer_gb_s"] is None else \
                f"{r['setup']}, {r['transfer_gb_s']:g} GB/s"
            marker = "*" if r["transfer_gb_s"] is None else "o"
            ax.scatter(r["ttft_p90_s"], r["itl_p90_s"] * 1e3, marker=marker, s=90, label=label)
        ax.set_xscale("log")  # the splits that fall behind are minutes off
        ax.set_xlabel("TTFT p90 (s, log)")
        ax.set_ylabel("ITL p90 (ms, each request's mean gap)")
        ax.set_title(f"{rate:g} req/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Simulated: {result['args']['replicas']} engines of "
                 f"{result['profile']['name']}, unified or split into prefill:decode")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--splits", default="4:12,8:8,12:4",
                        help="prefill:decode replicas, comma-separated; each sums to --replicas")
    parser.add_argument("--bandwidths-gb-s", default="50,12.5",
                        help="KV link per pull, GB/s (50: a 400 Gb/s RDMA NIC; 12.5: 100 Gb/s)")
    parser.add_argument("--transfer-latency-ms", type=float, default=1.0)
    parser.add_argument("--rates-per-replica", default="0.75,1.5")
    parser.add_argument("--policy", default="kv_aware")
    parser.add_argument("--min-prompt-tokens", type=int, default=256,
                        help="the topology's disaggregation.min_prompt_tokens")
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--requests-per-replica", type=int, default=20)
    parser.add_argument("--max-output-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "sim_pd.json"))
    args = parser.parse_args()
    for split in args.splits.split(","):
        if sum(int(n) for n in split.split(":")) != args.replicas:
            parser.error(f"--splits: {split} does not add up to --replicas {args.replicas}")
    result = simulate(args)
    out = Path(args.out)
    write(out, result, markdown, plot)
    print(f"wrote {out} and its .md and .png")


if __name__ == "__main__":
    main()
