"""The head-to-head benchmark's outputs: ratio lines, the Markdown report and the bar charts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import process_cpu
from benchmarks.common.intervals import verdict


def _get(records: list[dict[str, Any]], system: str, policy: str, rate: float) -> dict | None:
    return next((r for r in records if (r["system"], r["policy"], r["rate_rps"])
                 == (system, policy, rate)), None)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


# tokenfab round_robin against sglang-router round_robin: (label, field, target ratio at most)
PARITY = (("TTFT p50", "ttft_p50_s", 1.1), ("TTFT p90", "ttft_p90_s", 1.1),
          ("ITL p99", "itl_p99_s", 1.2), ("output tok/s", "output_tok_s", None),
          ("dataplane CPU/token", "dataplane_cpu_ms_per_token", 1.2))


def _compare(ours: dict, theirs: dict, label: str, field: str, target: float | None = None,
             lower_is_better: bool = True) -> str:
    """"TTFT p90 0.97 (tie; target <= 1.1 met)": the ratio of medians, the verdict of the
    ranges (a win or loss only where they are apart) and, where given, the target."""
    if ours.get(field) is None or not theirs.get(field):
        return f"{label} n/a"
    ratio = ours[field] / theirs[field]
    single = min(ours.get("repeats", 1), theirs.get("repeats", 1)) < 2
    said = "one run: no verdict" if single else verdict(ours, theirs, field, lower_is_better)
    if target is not None:
        sign = "<=" if lower_is_better else ">="
        met = ratio <= target if lower_is_better else ratio >= target
        said += f"; target {sign} {target:g} {'met' if met else 'not met'}"
    return f"{label} {ratio:.2f} ({said})"


def ratios(records: list[dict[str, Any]], floor: dict[str, Any] | None = None,
           slo_s: float | None = None) -> list[str]:
    """Ratios of medians, each with its verdict over the repeats' ranges."""
    lines = []
    for rate in sorted({r["rate_rps"] for r in records}):
        here = [r for r in records if r["rate_rps"] == rate]
        ours, theirs = _get(records, "tokenfab", "round_robin", rate), \
            _get(records, "sglang-router", "round_robin", rate)
        if ours and theirs:
            lines.append(f"{rate:g} req/s, tokenfab round_robin / sglang-router round_robin: "
                         + ", ".join(_compare(ours, theirs, label, field, target,
                                              field != "output_tok_s")
                                     for label, field, target in PARITY))
        ours, theirs = _get(records, "tokenfab", "kv_aware", rate), \
            _get(records, "sglang-router", "cache_aware", rate)
        if ours and theirs:
            lines.append(f"{rate:g} req/s, tokenfab kv_aware / sglang-router cache_aware: "
                         + _compare(ours, theirs, "TTFT p90", "ttft_p90_s") + ", "
                         + _compare(ours, theirs, "hit rate", "hit_rate", None, False))
        if floor:
            lines.append(f"{rate:g} req/s, TTFT p90 over the floor's: " + ", ".join(
                f"{r['system']} {r['policy']} {_ratio(r['ttft_p90_s'], floor['ttft_p90_s'])}"
                for r in here))
        base = [r for r in here if r["system"] != "tokenfab"]
        mine = [r for r in here if r["system"] == "tokenfab"]
        key = "dataplane_cpu_ms_per_token"
        if base and mine:
            best = min(base, key=lambda r: r[key])
            lines.append(f"{rate:g} req/s, dataplane CPU/token against the best baseline "
                         f"({best['system']} {best['policy']}, {best[key]:.2f} ms): "
                         + ", ".join(_compare(r, best, f"tokenfab {r['policy']}", key)
                                     for r in mine))
        lines.append(f"{rate:g} req/s, the data path's CPU with no request running (3 s before "
                     "each replay), % of a core, and as ms per output token at this load: "
                     + ", ".join(f"{r['system']} {r['policy']} {r['idle_dataplane_cpu_pct']:.1f}%"
                                 f" ({10 * r['idle_dataplane_cpu_pct'] / r['output_tok_s']:.2f} "
                                 "ms)" for r in here if r["output_tok_s"]))
        lines.append(f"{rate:g} req/s, the client's wait for a CPU (s) and the largest stall "
                     "cluster (requests): " + ", ".join(
                         f"{r['system']} {r['policy']} {r['client_waited_s']:.2f}, "
                         f"{r['stall_cluster_max_range'][1]:.0f}" for r in here))
    return lines + _goodput_lines(records, slo_s)


def _goodput_lines(records: list[dict[str, Any]], slo_s: float | None) -> list[str]:
    rows = {(r["system"], r["policy"]): r for r in records if r.get("goodput_rps") is not None}
    if not rows or slo_s is None:
        return []
    lines = [f"goodput (the highest rate with TTFT p90 <= {slo_s * 1000:.0f} ms and no failed "
             "request; '>=' where every rate met it): " + ", ".join(
                 f"{s} {p} {'>=' if r['goodput_lower_bound'] else ''}{r['goodput_rps']:.2f} "
                 f"[{r['goodput_rps_range'][0]:.2f}-{r['goodput_rps_range'][1]:.2f}] req/s"
                 for (s, p), r in rows.items())]
    for ours, theirs in ((("tokenfab", "kv_aware"), ("sglang-router", "cache_aware")),
                         (("tokenfab", "round_robin"), ("sglang-router", "round_robin"))):
        if ours in rows and theirs in rows:
            lines.append(f"goodput, {' '.join(ours)} / {' '.join(theirs)}: " + _compare(
                rows[ours], rows[theirs], "", "goodput_rps",
                1.2 if ours[1] == "kv_aware" else None, False).strip())
    return lines


def _f(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def _m(row: dict[str, Any], field: str, scale: float = 1.0, digits: int = 3) -> str:
    """A figure's median with its range over the repeats: "0.061 [0.055-0.070]"."""
    low_high = row.get(f"{field}_range")
    if row.get(field) is None or not low_high:
        return "n/a"
    low, high = low_high
    return (f"{_f(row[field], scale, digits)} [{_f(low, scale, digits)}-"
            f"{_f(high, scale, digits)}]")


def _scheduling(scheduling: dict[str, Any]) -> str:
    client = (f"the client in its own at nice {scheduling['client_nice']} (see "
              "`prioritise_client` in machine.py)" if scheduling.get("prioritised", True) else
              f"the client unprioritised: in the shell's group at nice "
              f"{scheduling['client_nice']} (`--unprioritised`)")
    core = scheduling.get("client_core")
    pinned = "" if core is None else \
        f"; during replays its event loop stays on core {core} (see `on_core` in machine.py)"
    return (f"Scheduling: each stack in one session of its own (one autogroup: autogroups "
            f"{'on' if scheduling['autogroup'] else 'off'}), {client}{pinned}.")


def _window(result: dict[str, Any]) -> str:
    s = result["settings"]
    sample = (f"{s['requests']} requests sampled by conversation root from `{s['trace']}` "
              f"(root share {s['root_share']}, seed {s['seed']})")
    if result.get("window") == "no-reuse":
        sample += (", every request's blocks then made its own (`--window no-reuse`: the same "
                   "arrivals and lengths, nothing shared, so no placement wins a hit)")
    return sample


def _knee(result: dict[str, Any]) -> str:
    knee, slo = result.get("knee"), result.get("slo_s")
    if not knee:
        return "Loads: as given (no knee looked for)."
    probes = ", ".join(f"{p['rate_rps']:g} req/s {_f(p['ttft_p90_s'])} s"
                       for p in knee["probes"])
    text = (f"Loads: as given, and {knee['past_knee_rps']:g} req/s, the first rate at which "
            f"{knee['system']} {knee['policy']}'s TTFT p90 "
            + ("missed" if knee["missed"] else "still met (the probe's last step)")
            + f" the target ({slo * 1000:.0f} ms) in the first repeat, with the probe before it "
            f"(probes: {probes}).")
    for other in result.get("knees") or ():  # each other policy's search, from the highest load
        probes = ", ".join(f"{p['rate_rps']:g} req/s {_f(p['ttft_p90_s'])} s"
                           for p in other["probes"])
        text += (f" {other['system']} {other['policy']}: "
                 + (f"missed first at {other['past_knee_rps']:g} req/s" if other["missed"]
                    else f"still met at {other['past_knee_rps']:g} req/s, the probe's last step")
                 + f" (probes: {probes}).")
    return text + " Goodput is interpolated between the measured rates."


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        "# Head to head: tokenfab, sglang-router and vllm-router in front of vLLM", "",
        f"`{result['command']}`", "",
        f"{_window(result)}; each system before 2 engines of the tiny model "
        f"(1 pinned core each, eager, block {s['block_tokens']}, {s['kv_cache']} KV cache each, "
        f"prefix caching on); prompts of single-token words capped at {s['max_blocks']} blocks, "
        f"{s['max_tokens']} output tokens each. Infinite-cache hit rate (bound) of the sample: "
        f"{result['bound_hit_rate']:.3f}. Run took {result['duration_s'] / 60:.1f} min.", "",
        f"Each figure: the median of {result.get('repeats', 1)} repeats, min-max in brackets; the "
        "repeats were interleaved across systems (baselines then tokenfab, then the other way "
        "round), with cold caches in every replay. A ratio is a win or a loss only where the "
        "ranges do not overlap; otherwise a tie.", "",
        _knee(result), "",
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
        "ITL p99 (ms) | output tok/s | hit rate | dataplane CPU (ms/token) | "
        "background CPU (%) | engine CPU (%) | client waited (s) | stall cluster | failed |",
        "|---|---|---|" + "---:|" * 14,
    ]
    for r in result["records"]:
        lines.append(
            f"| {r['system']} | {r['policy']} | {r['load']} | {_m(r, 'ttft_p50_s')} | "
            f"{_m(r, 'ttft_p90_s')} | {_m(r, 'ttft_p99_s')} | {_f(r['e2e_p50_s'])} | "
            f"{_m(r, 'itl_p99_s', 1000, 1)} | {r['output_tok_s']:.1f} | "
            f"{_m(r, 'hit_rate')} | {_m(r, 'dataplane_cpu_ms_per_token', 1, 2)} | "
            f"{r['background_cpu_pct']:.1f} | {r['engine_cpu_pct']:.0f} | "
            f"{_m(r, 'client_waited_s', 1, 2)} | {r['stall_cluster_max_range'][1]:.0f} | "
            f"{r['failed_range'][1]:.0f} |")
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
    lines += ["", "Data-path and background processes, % of one core over the window (the last "
              "repeat):", ""]
    for row in result["records"]:
        r = row["runs"][-1]
        top = [f"{process_cpu.short_name(p['title'])} {p['pct_of_core']:.1f}"
               for p in r["cpu_breakdown"] if p["category"] in ("dataplane", "background")][:8]
        replayed = sum(run.get("attempts", 1) > 1 for run in row["runs"])
        lines.append(f"- {r['system']} {r['policy']} {r['load']}: " + ", ".join(top)
                     + f"; processes outside the stack: {r['cpu_pct_of_core']['other']:.1f}"
                     + (f" ({replayed} replays repeated for outside load)" if replayed else ""))
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
            rows = [_get(records, *setup, rate) or {} for rate in rates]
            values = [row.get(key) or 0 for row in rows]
            spans = [row.get(f"{key}_range") or [v, v] for row, v in zip(rows, values)]
            errors = [[v - lo for v, (lo, _) in zip(values, spans)],
                      [hi - v for v, (_, hi) in zip(values, spans)]]
            ax.bar(np.arange(len(rates)) + i * width, values, width, label=" ".join(setup),
                   yerr=errors, capsize=2, hatch="//" if setup[0] == "tokenfab" else None)
        if key == "hit_rate":
            ax.set_ylim(0, 1)
            ax.axhline(result["bound_hit_rate"], color="k", linestyle="--", linewidth=1,
                       label="infinite-cache bound")
        ax.set_xticks(np.arange(len(rates)) + width * (len(setups) - 1) / 2,
                      [f"{rate:g} req/s" for rate in rates])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{'Mooncake trace sample' if result.get('window') != 'no-reuse' else 'no-reuse window'}"
                 f", 2 tiny-model engines on CPU, median and range of {result.get('repeats', 1)} "
                 "repeats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
