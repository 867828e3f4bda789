"""python -m sim calibrate | replay | capacity: measure an engine's profile, replay a trace in
simulation, or find what one replica serves within latency targets (the autoscaler's plan).

    python -m sim calibrate --url http://127.0.0.1:8000 --model tiny \\
        --model-path ~/.cache/tokenfab/models/tiny-llama --kv-blocks 384 --out my-profile.json
    python -m sim replay --profile h100-llama-3.1-8b \\
        --trace ../shared/traces/synthetic_trace.jsonl \\
        --policy kv_aware --replicas 64 --rate 64 [--pd 16:48 --transfer-gb-s 50]
    python -m sim capacity --profile h100-llama-3.1-8b [--role prefill|decode] \\
        --trace ../shared/traces/synthetic_trace.jsonl --ttft-p90-s 3 --itl-p90-s 0.1
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from sim import params as profiles
from sim import workload
from sim.run import replay


def _calibrate(args: argparse.Namespace) -> None:
    from sim.calibrate import calibrate, single_token_words

    words = single_token_words(args.model_path)
    params, error, observations = calibrate(
        f"{args.url.rstrip('/')}/v1", args.model, words, block_size=args.block_size,
        kv_blocks=args.kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        start_latency_s=args.start_latency_s, name=Path(args.out).stem, repeats=args.repeats,
        headers={"authorization": f"Bearer {args.api_key}"} if args.api_key else None)
    profiles.dump(params, Path(args.out))
    print(f"{len(observations)} probes, median fit error {error:.1%}; wrote {args.out}")


def _replay(args: argparse.Namespace) -> None:
    params = profiles.load(args.profile)
    rows = workload.tile(workload.read_trace(Path(args.trace)), args.copies, args.seed)

    def make(index: int, start: float) -> list:
        return workload.requests(
            rows, args.rate, tokens_per_id=args.tokens_per_id, block_size=params.block_size,
            max_prompt_tokens=params.max_model_len - args.max_output_tokens, start=start,
            output_tokens=lambda row: max(1, min(args.max_output_tokens, row["output_length"])))

    if args.pd is None:
        result = replay(params, args.policy, args.replicas, make, seed=args.seed)
        result.pop("per_request")
    else:
        from sim import pd

        prefill, decode = args.pd
        result = pd.replay(params, args.policy, prefill, decode, make(0, 0.0),
                           transfer_bytes_per_s=args.transfer_gb_s * 1e9,
                           transfer_latency_s=args.transfer_latency_ms / 1e3,
                           min_prompt_tokens=args.min_prompt_tokens, seed=args.seed)
    json.dump(result, sys.stdout, indent=2)
    print()


def _split(value: str) -> tuple[int, int]:
    try:
        prefill, decode = (int(n) for n in value.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected PREFILL:DECODE, e.g. 4:12") \
            from None
    if prefill < 1 or decode < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: each pool needs at least one replica")
    return prefill, decode


def _capacity(args: argparse.Namespace) -> None:
    from sim.profile import sweep, sweep_pd

    params = profiles.load(args.profile)
    rows = workload.read_trace(Path(args.trace))

    def make(rate: float, seconds: float) -> list:
        need = int(rate * seconds) + 1
        tiled = workload.tile(rows, math.ceil(need / len(rows)), args.seed)[:need]
        return workload.requests(
            tiled, rate, tokens_per_id=args.tokens_per_id, block_size=params.block_size,
            max_prompt_tokens=params.max_model_len - args.max_output_tokens,
            output_tokens=lambda row: max(1, min(args.max_output_tokens, row["output_length"])))

    rates = [args.step * k for k in range(1, int(args.max_rate / args.step) + 1)]
    if args.role == "unified":
        capacity = sweep(params, make, rates, args.ttft_p90_s, args.itl_p90_s,
                         replicas=args.replicas, seconds=args.seconds)
    else:  # rates offered; the points are the pool's own arrivals
        capacity = sweep_pd(params, make, rates, args.ttft_p90_s, args.itl_p90_s, args.role,
                            replicas=args.replicas, other=args.other, seconds=args.seconds,
                            transfer_bytes_per_s=args.transfer_gb_s * 1e9,
                            transfer_latency_s=args.transfer_latency_ms / 1e3,
                            min_prompt_tokens=args.min_prompt_tokens)
    print("req/s per replica | TTFT signal p90 | ITL signal p90 | in flight per replica")
    for p in capacity.points:
        print(f"{p.rate_per_replica:17g} | {p.ttft_p90_s:15.2f} | {p.itl_p90_s:14.3f} | "
              f"{p.ongoing_per_replica:.1f}")
    if capacity.rate_per_replica <= 0:
        sys.exit(f"even {rates[0]:g} req/s per replica misses a target: no capacity to plan with")
    print(f"\nautoscaler:  # or a pool's own autoscaling: section\n"
          f"  capacity_rps: {capacity.rate_per_replica:g}\n"
          f"  target_ongoing_requests: {capacity.ongoing_per_replica:.2f}\n"
          f"  ttft_p90_s: {args.ttft_p90_s:g}\n  itl_p90_s: {args.itl_p90_s:g}\n"
          f"  replica_start_s: {params.start_latency_s:g}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cal = commands.add_parser("calibrate", help="fit a profile to a running tokenfab gateway's "
                              "engines (run it on an otherwise idle deployment)")
    cal.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    cal.add_argument("--model", required=True, help="the served model name")
    cal.add_argument("--model-path", required=True, help="its tokenizer (for exact prompts)")
    cal.add_argument("--kv-blocks", type=int, required=True, help="KV blocks of one replica "
                     "(tokenfab status shows them)")
    cal.add_argument("--block-size", type=int, default=32)
    cal.add_argument("--max-model-len", type=int, default=2048)
    cal.add_argument("--max-num-batched-tokens", type=int, default=2048)
    cal.add_argument("--max-num-seqs", type=int, default=128)
    cal.add_argument("--start-latency-s", type=float, default=40.0,
                     help="a replica's start, measured apart (e.g. a deploy timed)")
    cal.add_argument("--repeats", type=int, default=3)
    cal.add_argument("--api-key", default="", help="a tenant key, if the gateway asks for one")
    cal.add_argument("--out", required=True)
    cal.set_defaults(run=_calibrate)
    rep = commands.add_parser("replay", help="replay a Mooncake-format trace in simulation")
    rep.add_argument("--profile", required=True, help="a profile name (sim/profiles) or file")
    rep.add_argument("--trace", required=True)
    rep.add_argument("--policy", default="kv_aware",
                     help="a tokenfab policy, or another router's ported (sim.baselines): "
                     "sglang:cache_aware, vllm-router:cache_aware, dynamo:kv")
    rep.add_argument("--replicas", type=int, default=2)
    rep.add_argument("--rate", type=float, required=True, help="mean arrivals per second")
    rep.add_argument("--copies", type=int, default=1, help="tile the trace this many times")
    rep.add_argument("--tokens-per-id", type=int, default=512)
    rep.add_argument("--max-output-tokens", type=int, default=1024)
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--pd", type=_split, default=None, metavar="P:D",
                     help="a prefill pool of P and a decode pool of D replicas (not --replicas)")
    rep.add_argument("--transfer-gb-s", type=float, default=50.0,
                     help="with --pd: the KV link of a pull, GB/s")
    rep.add_argument("--transfer-latency-ms", type=float, default=1.0)
    rep.add_argument("--min-prompt-tokens", type=int, default=256,
                     help="with --pd: disaggregation.min_prompt_tokens")
    rep.set_defaults(run=_replay)
    cap = commands.add_parser("capacity", help="the requests/s one replica serves within "
                              "latency targets, for the autoscaler's capacity_rps")
    cap.add_argument("--profile", required=True, help="a profile name (sim/profiles) or file")
    cap.add_argument("--trace", required=True, help="requests shaped as the pool's workload")
    cap.add_argument("--ttft-p90-s", type=float, required=True)
    cap.add_argument("--itl-p90-s", type=float, required=True)
    cap.add_argument("--replicas", type=int, default=8)
    cap.add_argument("--seconds", type=float, default=240.0, help="simulated time per rate")
    cap.add_argument("--step", type=float, default=0.25, help="req/s per replica between rates")
    cap.add_argument("--max-rate", type=float, default=16.0)
    cap.add_argument("--tokens-per-id", type=int, default=512)
    cap.add_argument("--max-output-tokens", type=int, default=1024)
    cap.add_argument("--seed", type=int, default=0)
    cap.add_argument("--role", choices=["unified", "prefill", "decode"], default="unified",
                     help="a unified pool, or one pool of a disaggregated pair (its capacity "
                     "in its own arrivals, beside --other replicas of the other pool)")
    cap.add_argument("--other", type=int, default=16, help="with --role prefill or decode")
    cap.add_argument("--transfer-gb-s", type=float, default=50.0)
    cap.add_argument("--transfer-latency-ms", type=float, default=1.0)
    cap.add_argument("--min-prompt-tokens", type=int, default=256,
                     help="disaggregation.min_prompt_tokens")
    cap.set_defaults(run=_capacity)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except profiles.SimConfigError as exc:
        parser.exit(2, f"sim: {exc}\n")


if __name__ == "__main__":
    main()
