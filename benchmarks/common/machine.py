"""The machine a benchmark shares with the systems it measures: the client's own scheduling
group, processes outside the stack under test, and the sockets the stack opens.

`stack` below is the set of pids listening on the front's port (process_cpu.classify sorts the
rest by role from there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.common import process_cpu

STRAY = ("raylet", "gcs_server", "VLLM::", "vllm.entrypoints", "sglang", "vllm-router", "::router")


def prioritise_client(nice: int) -> dict[str, Any]:
    """Give this process, the benchmark's client, a scheduling group of its own at `nice`.

    The systems under test run on the same 2 cores as the client, and their engines spin. With
    Linux autogroups (on here), each session is one scheduling group: Ray puts all of tokenfab in
    one, and a whole stack in one group starves a client in another of CPU for up to seconds,
    which then shows as TTFT (measured: sglang-router round robin at 3.5 req/s, TTFT p90 0.23 s
    with each baseline process in a session of its own, 1.2-2.2 s with the whole stack in one,
    0.11 s with the client at autogroup nice -10). So every stack gets one session of its own
    (baseline.Session, `ray start`), and the client a session at `nice`, its group's and
    its own (the latter counts where autogroups are off)."""
    if os.getsid(0) != os.getpid():
        try:
            os.setsid()
        except PermissionError:  # a process group leader (started by a shell): start anew
            if os.environ.get("BENCH_CLIENT_REEXEC") != "1":
                os.environ["BENCH_CLIENT_REEXEC"] = "1"
                os.execvp("setsid", ["setsid", "--wait", sys.executable, *sys.argv])
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    applied = {"client_nice": nice,
               "autogroup": autogroup.exists() and autogroup.read_text().strip() == "1",
               "client_session_leader": os.getsid(0) == os.getpid(), "prioritised": True}
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        if applied["autogroup"]:  # else a group's nice would not count
            Path("/proc/self/autogroup").write_text(str(nice))
    except OSError as exc:
        print(f"WARNING: could not raise the client's priority ({exc}); its own CPU starvation "
              "may dominate latencies")
        applied["client_nice"] = os.getpriority(os.PRIO_PROCESS, 0)
    return applied


def client_core(choice: str) -> int | None:
    """The core `--client-core` names: "last" (the highest this process may run on), "none"
    (the kernel places the client), or a core's number."""
    if choice == "none":
        return None
    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1] if choice == "last" else int(choice)
    if core not in allowed:
        raise ValueError(f"--client-core {choice}: this process may run on {allowed} only")
    return core


@contextmanager
def on_core(core: int | None) -> Iterator[None]:
    """The calling thread (a replay's event loop) kept on `core` while the block runs, and
    allowed where it was after it; None: left to the kernel.

    Why: a client in a scheduling group of its own is woken on the CPU of whatever wrote to its
    sockets, and a group's weight on each CPU follows its recent load there. Two ingresses
    (`gateway.colocate`), one on each core, wake it on both. Measured with `perf sched record`
    (2026-12-07, 6 req/s, no-reuse window): behind tokenfab it ran 4,853 times on one core and
    346 on the other, and 17 of its 19 waits over 30 ms were on the other (up to 240 ms; 3.9 s
    in all); behind sglang-router's one process, at most 10 ms (0.3 s in all). Every stream it
    held showed such a wait as one gap, then a burst of tokens. Kept on one core it waited 0.8 s
    and 0.6 s, and no burst was left. Every system's client is kept on the same core."""
    if core is None:
        yield
        return
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def unprioritised() -> dict[str, Any]:
    """The client left where it was started: the shell's session and scheduling group, at its
    priority (as a load generator or sidecar on a serving node would be)."""
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    return {"client_nice": os.getpriority(os.PRIO_PROCESS, 0),
            "autogroup": autogroup.exists() and autogroup.read_text().strip() == "1",
            "client_session_leader": os.getsid(0) == os.getpid(), "prioritised": False}


def waited_for_cpu_s() -> float:
    """Seconds the calling thread (a client's event loop) has spent runnable but waiting for a
    CPU (`/proc/thread-self/schedstat`, the scheduler's run delay): the difference over a replay
    is how long the client was starved; its latencies are late by that much, not the system's."""
    return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9


def stray_processes() -> list[str]:
    """Serving processes (Ray, vLLM, routers) already on the machine: they would share the cores."""
    found = subprocess.run(["pgrep", "-af", "|".join(STRAY)], text=True, capture_output=True)
    mine = {os.getpid(), os.getppid()}
    return [line for line in found.stdout.splitlines() if int(line.split()[0]) not in mine]


def renice_engines(nice: int) -> None:
    """Set every thread of every `VLLM::` process to `nice` (a diagnostic: whether the engines
    lose time to the processes beside them)."""
    for proc in process_cpu.snapshot().values():
        if not proc.title.startswith("VLLM::"):
            continue
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:
                pass


def wait_quiet(stack: set[int], limit_pct: float = 15.0, max_wait_s: float = 300.0
               ) -> dict[str, float]:
    """Wait (up to `max_wait_s`) until processes outside the stack under test use under
    `limit_pct` of a core, so a test run or build elsewhere does not take the engines' cores.
    Returns the last 3-second sample's CPU by category (process_cpu.CATEGORIES), % of a core:
    "other" is what was waited on; the stack's own shares are its cost at idle."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before = process_cpu.snapshot()
        time.sleep(3.0)
        after = process_cpu.snapshot()
        procs = {proc.pid: proc for proc in after.values()}
        categories = process_cpu.classify(procs, stack, os.getpid())
        shares = dict.fromkeys(process_cpu.CATEGORIES, 0.0)
        for pid, (_, used) in process_cpu.cpu_seconds(before, after).items():
            if pid in categories:
                shares[categories[pid]] += 100 / 3.0 * used
        if shares["other"] < limit_pct or time.monotonic() > deadline:
            return shares
        print(f"   waiting: other processes use {shares['other']:.0f}% of a core")
        time.sleep(10.0)


def check_loopback(stack: set[int]) -> dict[str, Any]:
    """Sockets the stack's processes listen on (by process name and host), and any outside
    127.0.0.0/8."""
    procs = {p.pid: p for p in process_cpu.snapshot().values()}
    categories = process_cpu.classify(procs, stack, os.getpid())
    ours = {pid for pid, c in categories.items() if c in ("dataplane", "engine", "background")}
    listening: dict[str, list[str]] = {}
    for row in process_cpu.listeners():
        for pid in ours & set(row["pids"]):
            key = f"{process_cpu.short_name(procs[pid].title)} {row['proto']} {row['host']}"
            listening.setdefault(key, []).append(str(row["port"]))
    outside = [f"{key}:{','.join(sorted(set(listening[key])))}" for key in listening
               if not process_cpu.is_loopback(key.rsplit(" ", 1)[1])]
    dialed = sorted({f"{process_cpu.short_name(procs[pid].title)} -> {row['peer']}"
                     for row in process_cpu.peers() for pid in ours & set(row["pids"])
                     if not process_cpu.is_loopback(row["host"])})
    for line in outside + dialed:
        print(f"   WARNING: not loopback: {line}")
    return {"listening": {key: ",".join(sorted(set(ports))) for key, ports in listening.items()},
            "non_loopback": outside, "connected_outside": dialed}
