"""Give every vLLM engine of a pool a fixed share of one core, as an accelerator would be.

On a GPU cluster each replica brings its own accelerator: a second replica doubles the compute
and takes nothing from the gateway or the other replica. On this 2-core machine an
engine left alone takes a whole core, and two take both, so a second replica starves everything
else. A benchmark of capacity decisions (the autoscaler's) needs the first behaviour.

`EngineShare` puts each engine core process (`VLLM::EngineCore`, a child of a pool's Serve
replica) and its worker processes into their own CPU cgroup with a CFS quota of `share` of a
core once Serve reports the replica RUNNING: the engine is real and runs the same code, its
serving compute is capped at a fixed rate, and the rest of the machine stays with the
front-ends. Its start is not capped (on a GPU, a start is loading weights, not compute). Needs
root and a writable cgroup v1 `cpu` or cgroup v2 hierarchy (true on this kind of machine).
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil

from orchestrator.deploy import ServeClient

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # short periods: a throttled engine waits at most ~6 ms, not ~60 ms


def _root() -> tuple[Path, int] | None:
    """The cgroup directory new groups go under, and the cgroup version (None: not usable)."""
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1, 1
    if (V2 / "cgroup.subtree_control").exists() and "cpu" in (V2 / "cgroup.controllers").read_text():
        return V2, 2
    return None


class EngineShare:
    """Caps each pool replica's engine process at `share` of a core while running."""

    def __init__(self, share: float, dashboard_url: str, name: str = "tokenfab-engines") -> None:
        found = _root()
        if found is None:
            raise RuntimeError("no writable CPU cgroup hierarchy: run as root on cgroup v1/v2")
        root, self._version = found
        self._share, self._base = share, root / name
        self._client = ServeClient(dashboard_url)
        self._done: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-share", daemon=True)

    def __enter__(self) -> EngineShare:
        self._base.mkdir(exist_ok=True)
        if self._version == 2:
            (self._base / "cgroup.subtree_control").write_text("+cpu")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for group in self._base.glob("[0-9]*"):
            try:
                group.rmdir()  # empty once its engine exited
            except OSError:
                pass

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            try:
                running = self._running_replica_pids()
            except Exception as exc:  # noqa: BLE001 - the dashboard is busy: ask again
                print(f"   engine share: no replica list ({exc})")
                continue
            for pid in _engine_pids(running) - self._done:
                try:
                    self._cap(pid)
                except (OSError, psutil.Error) as exc:  # it exited meanwhile
                    print(f"   engine {pid} not capped: {exc}")
                self._done.add(pid)

    def _running_replica_pids(self) -> set[int]:
        pids = set()
        for app in (self._client.details().get("applications") or {}).values():
            for name, deployment in (app.get("deployments") or {}).items():
                if name.startswith("pool-"):
                    pids |= {r["pid"] for r in deployment.get("replicas") or []
                             if r["state"] == "RUNNING" and r.get("pid")}
        return pids

    def _cap(self, pid: int) -> None:
        group = self._base / str(pid)
        group.mkdir(exist_ok=True)
        quota = int(self._share * PERIOD_US)
        if self._version == 1:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        engine = psutil.Process(pid)
        for process in [engine, *engine.children(recursive=True)]:  # later ones inherit it
            (group / "cgroup.procs").write_text(str(process.pid))


def _engine_pids(replicas: set[int]) -> set[int]:
    """Engine core processes: the `VLLM::EngineCore` children of these replica processes."""
    pids = set()
    for replica in replicas:
        try:
            for child in psutil.Process(replica).children():
                if " ".join(child.cmdline()).startswith("VLLM::EngineCore"):
                    pids.add(child.pid)
        except psutil.Error:
            continue
    return pids
