"""The head-to-head benchmark's outputs: ratio lines, the Markdown report and the bar charts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import process_cpu


def _get(records: list[dict[str, Any]], system: str, policy: str, rate: float) -> dict | None:
    return next((r for r in records if (r["system"], r["policy"], r["rate_rps"])
                 == (system, policy, rate)), None)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def ratios(records: list[dict[str, Any]], floor: dict[str, Any] | None = None) -> list[str]:
    lines = []
    for rate in sorted({r["rate_rps"] for r in records}):
        ours, theirs = _get(records, "tokenfab", "round_robin", rate), \
            _get(records, "sglang-router", "round_robin", rate)
        if ours and theirs:
            parts = [f"{label} {_ratio(ours[key], theirs[key])}" for label, key in (
                ("TTFT p50", "ttft_p50_s"), ("TTFT p90", "ttft_p90_s"), ("ITL p99", "itl_p99_s"),
                ("output tok/s", "output_tok_s"),
                ("dataplane CPU/token", "dataplane_cpu_ms_per_token"))]
            lines.append(f"{rate:g} req/s, tokenfab round_robin / sglang-router round_robin: "
                         + ", ".join(parts))
        ours, theirs = _get(records, "tokenfab", "kv_aware", rate), \
            _get(records, "sglang-router", "cache_aware", rate)
        if ours and theirs:
            lines.append(f"{rate:g} req/s, tokenfab kv_aware / sglang-router cache_aware: "
                         f"TTFT p90 {_ratio(ours['ttft_p90_s'], theirs['ttft_p90_s'])}, "
                         f"hit rate {_ratio(ours['hit_rate'], theirs['hit_rate'])}")
            if floor:
                target = 0.8 * theirs["ttft_p90_s"]
                lines.append(
                    f"{rate:g} req/s, 0.8x cache_aware's TTFT p90 is {target:.3f} s, "
                    f"{_ratio(target, floor['ttft_p90_s'])}x the floor's p90 "
                    f"({floor['ttft_p90_s']:.3f} s)"
                    + (": below what any router can reach" if target < floor["ttft_p90_s"]
                       else ""))
        if floor:
            here = [r for r in records if r["rate_rps"] == rate]
            if here:
                lines.append(f"{rate:g} req/s, TTFT p90 over the floor's: " + ", ".join(
                    f"{r['system']} {r['policy']} {_ratio(r['ttft_p90_s'], floor['ttft_p90_s'])}"
                    for r in here))
        base = [r for r in records if r["rate_rps"] == rate and r["system"] != "tokenfab"]
        mine = [r for r in records if r["rate_rps"] == rate and r["system"] == "tokenfab"]
        if base and mine:
            key = "dataplane_cpu_ms_per_token"
            best = min(base, key=lambda r: r[key])
            parts = [f"tokenfab {r['policy']} {_ratio(r[key], best[key])}" for r in mine]
            lines.append(f"{rate:g} req/s, dataplane CPU/token against the best baseline "
                         f"({best['system']} {best['policy']}, {best[key]:.2f} ms): "
                         + ", ".join(parts))
        idle = [r for r in records if r["rate_rps"] == rate and "idle_dataplane_cpu_pct" in r]
        if idle:
            lines.append(f"{rate:g} req/s, the data path's CPU with no request running (3 s "
                         "before the replay), % of a core, and as ms per output token at this "
                         "load: " + ", ".join(
                             f"{r['system']} {r['policy']} {r['idle_dataplane_cpu_pct']:.1f}% "
                             f"({10 * r['idle_dataplane_cpu_pct'] / r['output_tok_s']:.2f} ms)"
                             for r in idle if r["output_tok_s"]))
    return lines


def _f(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def _scheduling(scheduling: dict[str, Any]) -> str:
    return (f"Scheduling: each stack in one session of its own (one autogroup: autogroups "
            f"{'on' if scheduling['autogroup'] else 'off'}), the client in its own at nice "
            f"{scheduling['client_nice']} (see `prioritise_client` in machine.py).")


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        "# Head to head: tokenfab, sglang-router and vllm-router in front of vLLM", "",
        f"`{result['command']}`", "",
        f"{s['requests']} requests sampled by conversation root from `{s['trace']}` (root share "
        f"{s['root_share']}, seed {s['seed']}); each system before 2 engines of the tiny model "
        f"(1 pinned core each, eager, block {s['block_tokens']}, {s['kv_cache']} KV cache each, "
        f"prefix caching on); prompts of single-token words capped at {s['max_blocks']} blocks, "
        f"{s['max_tokens']} output tokens each. Infinite-cache hit rate (bound) of the sample: "
        f"{result['bound_hit_rate']:.3f}. Run took {result['duration_s'] / 60:.1f} min.", "",
        "tokenfab's gateway: " + ("served by the pool's two replicas themselves "
                                  "(`gateway.colocate`)" if s.get("tokenfab_gateway") == "colocated"
                                  else "in a process of its own (the topology default)") + ".",
        "",
        _scheduling(s["scheduling"]), "",
        f"ITL: {result['itl_definition']}. `return_token_ids` passed through: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}"
                    for k, v in result["token_ids_passthrough"].items()) + ".", "",
        "Data-path CPU is the router or Serve proxy, gateway and vLLM API servers or pool "
        "replicas (not the `VLLM::` engine processes), over the replay window, all threads; "
        "background is Ray's own daemons in % of one core; engine is the `VLLM::` processes in % "
        "of one core. Listening sockets outside loopback: "
        + (", ".join(sorted({x for v in result["sockets"].values() for x in v["non_loopback"]}))
           or "none")
        + "; connections to a peer outside loopback: "
        + (", ".join(sorted({x for v in result["sockets"].values()
                             for x in v["connected_outside"]})) or "none") + ".", "",
        "| system | policy | load | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | E2E p50 (s) | "
        "ITL p50 (ms) | ITL p99 (ms) | output tok/s | hit rate | dataplane CPU (ms/token) | "
        "background CPU (%) | engine CPU (%) | requests | failed |",
        "|---|---|---|" + "---:|" * 13,
    ]
    for r in result["records"]:
        lines.append(
            f"| {r['system']} | {r['policy']} | {r['load']} | {_f(r['ttft_p50_s'])} | "
            f"{_f(r['ttft_p90_s'])} | {_f(r['ttft_p99_s'])} | {_f(r['e2e_p50_s'])} | "
            f"{_f(r['itl_p50_s'], 1000, 2)} | {_f(r['itl_p99_s'], 1000, 1)} | "
            f"{r['output_tok_s']:.1f} | {r['hit_rate']:.3f} | "
            f"{r['dataplane_cpu_ms_per_token']:.2f} | {r['background_cpu_pct']:.1f} | "
            f"{r['cpu_pct_of_core']['engine']:.0f} | {r['requests']} | {r['failed']} |")
    floor = result.get("floor")
    if floor:
        lines += ["", f"Floor: each request alone, in trace order, straight to one idle vLLM "
                  f"server of the same settings whose cache holds every block it has seen "
                  f"({floor['kv_cache_bytes'] >> 20} MiB), one output token; a request's floor is "
                  f"its fastest of {floor['passes']} passes. Behind any router on these engines, "
                  f"a request's TTFT is at least its floor, so each percentile is too. TTFT p50 "
                  f"{_f(floor['ttft_p50_s'])} s, p90 {_f(floor['ttft_p90_s'])} s, p99 "
                  f"{_f(floor['ttft_p99_s'])} s; hit rate {floor['hit_rate']:.3f} (the engine's "
                  f"count; bound {result['bound_hit_rate']:.3f})."]
    lines += ["", "Ratios:", ""] + [f"- {line}" for line in result["ratios"]]
    lines += ["", "Data-path and background processes, % of one core over the window:", ""]
    for r in result["records"]:
        top = [f"{process_cpu.short_name(row['title'])} {row['pct_of_core']:.1f}"
               for row in r["cpu_breakdown"]
               if row["category"] in ("dataplane", "background")][:8]
        lines.append(f"- {r['system']} {r['policy']} {r['load']}: " + ", ".join(top)
                     + f"; processes outside the stack: {r['cpu_pct_of_core']['other']:.1f}"
                     + (f" (replayed {r['attempts']} times)" if r.get("attempts", 1) > 1 else ""))
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    setups = list(dict.fromkeys((r["system"], r["policy"]) for r in records))
    rates = sorted({r["rate_rps"] for r in records})
    panels = (("ttft_p90_s", "TTFT p90 (s)"), ("hit_rate", "prefix hit rate"),
              ("dataplane_cpu_ms_per_token", "data-path CPU (ms per output token)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.5))
    width = 0.8 / max(1, len(setups))
    for ax, (key, label) in zip(axes, panels):
        for i, setup in enumerate(setups):
            values = [(_get(records, *setup, rate) or {}).get(key) or 0 for rate in rates]
            ax.bar(np.arange(len(rates)) + i * width, values, width, label=" ".join(setup),
                   hatch="//" if setup[0] == "tokenfab" else None)
        if key == "hit_rate":
            ax.set_ylim(0, 1)
            ax.axhline(result["bound_hit_rate"], color="k", linestyle="--", linewidth=1,
                       label="infinite-cache bound")
        ax.set_xticks(np.arange(len(rates)) + width * (len(setups) - 1) / 2,
                      [f"{rate:g} req/s" for rate in rates])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Mooncake trace sample, 2 tiny-model engines on CPU, cold caches per run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
