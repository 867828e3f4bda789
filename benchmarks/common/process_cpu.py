"""CPU per process over a window, read from /proc, and the part of a serving stack each process
plays (data path, engine, Ray background, load generator); plus the sockets they listen on.

Which process is what (`classify`), first rule that matches:

1. `client`: the benchmark's own process (the load generator).
2. `engine`: titles starting with `VLLM::` (vLLM retitles its engine core and workers so) whose
   nearest other ancestor is an engine host of the stack: a Ray worker (`ray::...`) or vLLM's API
   server (`vllm.entrypoints...`). A `VLLM::` process of anything else (a test run) is `other`.
3. `dataplane`: a process listening on the front's HTTP port (a router, Ray Serve's proxy, a
   gateway that listens itself, HAProxy); an engine host that owns such an engine (vLLM's API
   server, a tokenfab pool replica); a title matching `DATA_PATH`
   (`ray::ServeReplica:<app>:<deployment>`, `ray::...Proxy...`, `ray::...Gateway...`,
   `ray::...Ingress...`, `haproxy`). Matching by role as well as by title keeps the rule right
   when the proxy or gateway is renamed or replaced.
4. `engine`: other descendants of an engine's owner (multiprocessing's resource tracker).
5. `background`: Ray's own processes off the data path: `ray::` titles left over (ServeController,
   idle workers, actors such as the replica registry), gcs_server, raylet, and Python run from
   Ray's package (dashboard, its agents and modules, log monitor, runtime-env agent).
6. `other`: everything else on the machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HZ = os.sysconf("SC_CLK_TCK")
CATEGORIES = ("dataplane", "engine", "background", "client", "other")
DATA_PATH = re.compile(r"^ray::(ServeReplica:|\S*(Proxy|Gateway|Ingress))|^(\S*/)?haproxy(\s|$)",
                       re.IGNORECASE)
ENGINE_HOST = re.compile(r"^ray::|vllm\.entrypoints")
RAY_DAEMON = re.compile(r"^ray(::|-|_)|/ray/|(^|/)(gcs_server|raylet)(\s|$)")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    title: str
    ticks: int  # utime + stime from /proc/PID/stat: the kernel's total over live and exited threads
    thread_ticks: int  # the same summed over /proc/PID/task/*/stat (live threads only)
    waited_ns: int = 0  # run delay (runnable, waiting for a CPU) over live threads: schedstat
    nice: int = 0
    session: int = 0  # with autogroups on, one scheduling group per session


def _fields(stat: str) -> list[str]:
    return stat[stat.rindex(")") + 2:].split()


def _read(pid_dir: Path) -> Proc | None:
    try:
        fields = _fields((pid_dir / "stat").read_text())
        threads = waited = 0
        for task in (pid_dir / "task").iterdir():
            try:
                tf = _fields((task / "stat").read_text())
                waited += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError):  # the thread exited
                continue
            threads += int(tf[11]) + int(tf[12])
        title = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        title = title.strip() or f"[{(pid_dir / 'comm').read_text().strip()}]"
    except (OSError, ValueError):
        return None
    return Proc(int(pid_dir.name), int(fields[1]), title, int(fields[11]) + int(fields[12]),
                threads, waited, int(fields[16]), int(fields[3]))


def snapshot() -> dict[tuple[int, int], Proc]:
    """Every process now, keyed by (pid, start time) so a reused pid is a new process."""
    procs = {}
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            start = int(_fields((pid_dir / "stat").read_text())[19])
        except (OSError, ValueError, IndexError):
            continue
        proc = _read(pid_dir)
        if proc is not None:
            procs[(proc.pid, start)] = proc
    return procs


def cpu_seconds(before: dict[tuple[int, int], Proc],
                after: dict[tuple[int, int], Proc]) -> dict[int, tuple[Proc, float]]:
    """CPU seconds each process used between the snapshots, all threads counted. A process that
    started in between counts from zero; one that ended in between is lost (and not seen)."""
    used = {}
    for key, proc in after.items():
        old = before.get(key)
        ticks = max(proc.ticks - (old.ticks if old else 0),
                    proc.thread_ticks - (old.thread_ticks if old else 0))
        if ticks > 0:
            used[proc.pid] = (proc, ticks / HZ)
    return used


def waited_seconds(before: dict[tuple[int, int], Proc],
                   after: dict[tuple[int, int], Proc]) -> dict[int, float]:
    """Seconds each process's threads spent runnable but waiting for a CPU between the snapshots
    (threads alive at both; a process that started in between counts from zero)."""
    out = {}
    for key, proc in after.items():
        old = before.get(key)
        waited = proc.waited_ns - (old.waited_ns if old else 0)
        if waited > 0:
            out[proc.pid] = waited / 1e9
    return out


def classify(procs: dict[int, Proc], front_pids: set[int], client_pid: int) -> dict[int, str]:
    """pid -> category, by the rules in the module docstring."""

    def ancestors(pid: int):
        seen = set()
        while pid in procs and pid not in seen:
            seen.add(pid)
            pid = procs[pid].ppid
            yield pid

    def is_engine(pid: int) -> bool:
        return pid in procs and procs[pid].title.startswith("VLLM::")

    def host(pid: int) -> int | None:
        return next((a for a in ancestors(pid) if not is_engine(a)), None)

    owners = {h for pid in procs if is_engine(pid) and (h := host(pid)) in procs
              and ENGINE_HOST.search(procs[h].title)}
    out = {}
    for pid, proc in procs.items():
        if pid == client_pid:
            out[pid] = "client"
        elif is_engine(pid):
            out[pid] = "engine" if host(pid) in owners else "other"
        elif pid in front_pids or pid in owners or DATA_PATH.search(proc.title):
            out[pid] = "dataplane"
        elif any(a in owners for a in ancestors(pid)):
            out[pid] = "engine"
        elif RAY_DAEMON.search(proc.title):
            out[pid] = "background"
        else:
            out[pid] = "other"
    return out


def listeners() -> list[dict[str, object]]:
    """Listening TCP and UDP sockets with their owners' pids (from `ss`; needs root for all)."""
    out = subprocess.run(["ss", "-Hltunp"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 6:
            continue
        address = parts[4]
        host, _, port = address.rpartition(":")
        rows.append({"proto": parts[0], "address": address, "host": host.strip("[]"),
                     "port": int(port) if port.isdigit() else port,
                     "pids": [int(p) for p in re.findall(r"pid=(\d+)", line)]})
    return rows


def peers() -> list[dict[str, object]]:
    """Remote ends of established TCP connections, with the local owners' pids."""
    out = subprocess.run(["ss", "-Htnp", "state", "established"], capture_output=True, text=True,
                         check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            rows.append({"peer": parts[3], "host": parts[3].rpartition(":")[0].strip("[]"),
                         "pids": [int(p) for p in re.findall(r"pid=(\d+)", line)]})
    return rows


def is_loopback(host: str) -> bool:
    host = host.split("%", 1)[0]
    return host.startswith("127.") or host in ("::1", "localhost") or \
        host.startswith("::ffff:127.")


def short_name(title: str) -> str:
    """A process's name for tables: its title up to the first space, or for a Python process
    the module (`-m`) or script it runs."""
    words = title.split() or [title]
    if re.search(r"python[0-9.]*$", words[0]):
        for i, word in enumerate(words[1:], 1):
            if word == "-m" and i + 1 < len(words):
                return words[i + 1]
            if word.endswith(".py"):
                return word.rsplit("/", 1)[-1]
            if word == "-c" and i + 1 < len(words):
                return f"python -c {words[i + 1][:40]}"
    return words[0].rsplit("/", 1)[-1] if words[0].startswith("/") else words[0]


def port_owners(port: int) -> set[int]:
    """Pids of the processes listening on a TCP port."""
    return {pid for row in listeners() if row["proto"] == "tcp" and row["port"] == port
            for pid in row["pids"]}


def summary(run: dict[str, Any], output_tokens: int) -> dict[str, Any]:
    """A replay's CPU by category: the data path's per output token, each category's % of a
    core over `run["window_s"]`, and the processes that counted (`run["cpu"]`: pid -> (proc,
    seconds); `run["categories"]`: pid -> category)."""
    window, categories = run["window_s"], run["categories"]
    waits = run.get("waited", {})  # pid -> seconds runnable, waiting for a CPU
    seconds, waited = dict.fromkeys(CATEGORIES, 0.0), dict.fromkeys(CATEGORIES, 0.0)
    breakdown = []
    for pid, (proc, used) in run["cpu"].items():
        category = categories.get(pid, "other")
        seconds[category] += used
        waited[category] += waits.get(pid, 0.0)
        if category != "other" or used >= 0.05 * window:
            breakdown.append({"pid": pid, "title": proc.title[:100], "category": category,
                              "cpu_s": round(used, 3),
                              "pct_of_core": round(100 * used / window, 1),
                              "waited_s": round(waits.get(pid, 0.0), 3), "nice": proc.nice,
                              "session": proc.session})
    breakdown.sort(key=lambda row: -row["cpu_s"])
    return {"dataplane_cpu_ms_per_token": 1000 * seconds["dataplane"] / max(1, output_tokens),
            "cpu_pct_of_core": {c: round(100 * s / window, 1) for c, s in seconds.items()},
            "waited_s": {c: round(s, 3) for c, s in waited.items()},
            "cpu_breakdown": breakdown}


def profile_dataplane(stack: set[int], label: str, snap: dict[tuple[int, int], Proc],
                      out: Path) -> threading.Thread:
    """py-spy on one data-path Python process of each title, 15 s from 5 s on (a thread; join
    it): raw stacks to `out`/<label>-<title>-<pid>.txt."""
    procs = {p.pid: p for p in snap.values()}
    chosen: dict[str, int] = {}
    for pid, category in sorted(classify(procs, stack, os.getpid()).items()):
        if category == "dataplane":
            chosen.setdefault(procs[pid].title.split()[0], pid)
    out.mkdir(parents=True, exist_ok=True)
    spy = str(Path(sys.executable).with_name("py-spy"))

    def run() -> None:
        time.sleep(5)
        jobs = []
        for title, pid in chosen.items():
            name = f"{label}-{re.sub(r'[^A-Za-z0-9.-]+', '_', title)}-{pid}.txt"
            jobs.append(subprocess.Popen([spy, "record", "-p", str(pid), "-d", "15", "-r", "50",
                                          "-f", "raw", "--nonblocking", "--threads",
                                          "-o", str(out / name)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            print(f"   profiling {title} (pid {pid}) -> {out / name}")
        for job in jobs:
            job.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
