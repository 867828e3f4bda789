"""`tokenfab top`'s screen from what status reads: a table per pool, latencies from the replicas'
windows, the autoscaler's decision, and the last good reading kept when the cluster cannot be
read."""

from __future__ import annotations

from rich.console import Console

from orchestrator.top import Frame, render

LATENCY = {"ttft_p50_s": 0.031, "ttft_p90_s": 0.122, "itl_p50_s": 0.0102, "itl_p90_s": 0.0207,
           "generation_tokens_per_s": 187.4}


def row(replica: str, state: str = "RUNNING", health: str = "healthy", **extra) -> dict:
    return {"pool": "main", "role": "unified", "replica": replica, "state": state,
            "health": health, "running": 3, "waiting": 1, "kv_usage": 12.5,
            "prefix_hit": 40.0} | extra


def screen(frame: Frame, last: Frame | None = None) -> str:
    console = Console(record=True, width=200, color_system=None)
    console.print(render(frame, last))
    return console.export_text()


def test_a_pool_shows_each_replica_with_its_window() -> None:
    text = screen(Frame(0.0, [row("abc", latency=LATENCY, breaker="closed"),
                              row("def", state="STARTING", health="not ready")]))
    lines = {line.split()[1]: line for line in text.splitlines() if line.startswith("│ ")
             and line.split()[1] in ("abc", "def")}
    assert "pool main (unified)" in text
    cells = [cell.strip() for cell in lines["abc"].split("│")[1:-1]]
    assert cells == ["abc", "RUNNING", "healthy", "3", "1", "12.5", "40.0", "31/122", "10/21",
                     "187", "closed", "-"]
    cells = [cell.strip() for cell in lines["def"].split("│")[1:-1]]
    assert cells[:3] == ["def", "STARTING", "not ready"] and cells[7:10] == ["-", "-", "-"]


def test_decode_pools_show_transfers_and_the_autoscaler_its_decision() -> None:
    decode = row("d1", kv_transfers=12, kv_transfer_failures=1) | {"pool": "dec", "role": "decode"}
    scaling = {"pool": "dec", "current": 1, "desired": 2, "min_replicas": 1, "max_replicas": 4,
               "reason": "ITL p90 over target", "last_change": "1 -> 2", "last_change_at": 0.0}
    text = screen(Frame(0.0, [decode], {"kv_pulls": 12}, [scaling]))
    assert "pool dec (decode)  autoscaled 1 -> 2 (1..4): ITL p90 over target" in text
    assert "12/1" in text and "last change" in text and "prefill/decode: kv_pulls=12" in text


def test_an_unreadable_cluster_keeps_the_last_reading_with_its_time() -> None:
    good = Frame(3600.0, [row("abc")])
    text = screen(Frame(3660.0, error="the gateway did not answer"), good)
    assert "cannot read the cluster: the gateway did not answer" in text
    assert "as of" in text and "abc" in text
    assert "abc" not in screen(Frame(3660.0, error="down"))  # nothing read yet: nothing shown
    assert "no pool replica is running" in screen(Frame(0.0))
