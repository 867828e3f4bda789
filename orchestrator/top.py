"""`tokenfab top`: every pool replica's load, latency and health, redrawn in place about once a
second, in the manner of htop. It reads what `tokenfab status` reads (Serve's view of the
replicas, their own reports through the gateway), with the same admin key."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from orchestrator.status import collect, collect_scaling
from tokenfab.errors import TokenfabError

_STATE_STYLES = {"RUNNING": "green", "STARTING": "yellow", "UPDATING": "yellow",
                 "RECOVERING": "yellow", "UNHEALTHY": "bold red", "STOPPING": "dim"}
_HEALTH_STYLES = {"healthy": "green", "not ready": "yellow", "engine failed": "bold red"}
_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("REPLICA", "left"), ("STATE", "left"), ("HEALTH", "left"), ("RUN", "right"),
    ("WAIT", "right"), ("KV%", "right"), ("HIT%", "right"), ("TTFT p50/p90 ms", "right"),
    ("ITL p50/p90 ms", "right"), ("TOK/S", "right"), ("BREAKER", "left"),
    ("XFER/FAIL", "right"))  # requests running and waiting; latencies over the engine's window


@dataclass(frozen=True)
class Frame:
    """One reading: a row per replica (or data-parallel rank), the prefill/decode counters and
    the autoscaler's records; or, when nothing could be read, why."""

    at: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    pd: dict[str, int] = field(default_factory=dict)
    scaling: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def read(dashboard_url: str, app: str | None) -> Frame:
    try:
        rows, pd = collect(dashboard_url, app)
        scaling = collect_scaling(dashboard_url, app)
    except (TokenfabError, httpx.HTTPError, OSError) as exc:
        return Frame(time.time(), error=str(exc) or type(exc).__name__)
    return Frame(time.time(), rows, pd, scaling)


def render(frame: Frame, last: Frame | None = None) -> RenderableType:
    """The screen for `frame`; when it could not be read, the error over `last` (the latest
    frame that could), marked with its time."""
    stamp = time.strftime("%H:%M:%S", time.localtime(frame.at))
    parts: list[RenderableType] = [Text(f"tokenfab top  {stamp}  (Ctrl-C quits)", style="bold")]
    shown = frame
    if frame.error is not None:
        parts.append(Text(f"cannot read the cluster: {frame.error}", style="bold red"))
        if last is None:
            return Group(*parts)
        shown = last
        parts.append(Text("as of " + time.strftime("%H:%M:%S", time.localtime(last.at)),
                          style="dim"))
    scaling = {record["pool"]: record for record in shown.scaling}
    pools = dict.fromkeys((row["pool"], row["role"]) for row in shown.rows)
    for pool, role in pools:
        parts.append(_pool_table(pool, role, [r for r in shown.rows if r["pool"] == pool],
                                 scaling.get(pool)))
    if not pools:
        parts.append(Text("no pool replica is running", style="yellow"))
    if shown.pd:
        parts.append(Text("prefill/decode: " + ", ".join(
            f"{key}={value}" for key, value in sorted(shown.pd.items()))))
    return Group(*parts)


def _pool_table(pool: str, role: str, rows: list[dict[str, Any]],
                scaling: dict[str, Any] | None) -> Table:
    table = Table(title=f"pool {pool} ({role})" + _scaling_title(scaling), title_justify="left",
                  caption=_last_change(scaling), caption_justify="left", expand=False)
    for name, justify in _COLUMNS:
        table.add_column(name, justify=justify)
    for row in rows:
        latency = row.get("latency") or {}
        table.add_row(
            row["replica"],
            Text(row["state"], style=_STATE_STYLES.get(row["state"], "")),
            Text(row["health"], style=_HEALTH_STYLES.get(row["health"], "")),
            _cell(row, "running"), _cell(row, "waiting"), _cell(row, "kv_usage"),
            _cell(row, "prefix_hit"),
            _pair(latency, "ttft_p50_s", "ttft_p90_s"), _pair(latency, "itl_p50_s", "itl_p90_s"),
            f"{latency['generation_tokens_per_s']:.0f}" if latency else "-",
            row.get("breaker", "-"),
            f"{row['kv_transfers']}/{row['kv_transfer_failures']}"
            if role == "decode" and "kv_transfers" in row else "-")
    return table


def _cell(row: dict[str, Any], key: str) -> str:
    return str(row[key]) if key in row else "-"


def _pair(latency: dict[str, float], p50: str, p90: str) -> str:
    """Two latencies in ms, "-" when the window saw none."""
    if not latency or not latency.get(p90):
        return "-"
    return f"{latency[p50] * 1000:.0f}/{latency[p90] * 1000:.0f}"


def _scaling_title(record: dict[str, Any] | None) -> str:
    if record is None:
        return ""
    return (f"  autoscaled {record['current']} -> {record['desired']} "
            f"({record['min_replicas']}..{record['max_replicas']}): {record['reason']}")


def _last_change(record: dict[str, Any] | None) -> str | None:
    if not record or not record.get("last_change"):
        return None
    ago = max(0.0, time.time() - record["last_change_at"])
    return f"last change {ago:.0f} s ago: {record['last_change']}"


def run(dashboard_url: str, app: str | None, interval_s: float = 1.0,
        console: Console | None = None) -> None:
    """Redraw until interrupted (KeyboardInterrupt leaves the terminal as it was)."""
    last: Frame | None = None
    with Live(console=console, auto_refresh=False, screen=True) as live:
        while True:
            frame = read(dashboard_url, app)
            live.update(render(frame, last), refresh=True)
            if frame.error is None:
                last = frame
            time.sleep(interval_s)
