"""Give every vLLM engine of a pool a fixed share of one core, as an accelerator would be.

On a GPU cluster each replica brings its own accelerator: a second replica doubles the compute
and takes nothing from the gateway, the proxy or the other replica. On this 2-core machine an
engine left alone takes a whole core, and two take both, so a second replica starves everything
else. A benchmark of capacity decisions (the autoscaler's) needs the first behaviour.

`EngineShare` puts each engine core process (`VLLM::EngineCore`, a child of a pool's Serve
replica) and its worker processes into their own CPU cgroup with a CFS quota of `share` of a core, as soon as it appears: the engine
is real and runs the same code, its compute is capped at a fixed rate, and the rest of the
machine stays with the front-ends. Needs root and a writable cgroup v1 `cpu` or cgroup v2
hierarchy (true on this kind of machine); `EngineShare.available()` says whether it is.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil

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

    def __init__(self, share: float, name: str = "tokenfab-engines") -> None:
        found = _root()
        if found is None:
            raise RuntimeError("no writable CPU cgroup hierarchy: run as root on cgroup v1/v2")
        root, self._version = found
        self._share, self._base = share, root / name
        self._done: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-share", daemon=True)

    @staticmethod
    def available() -> bool:
        found = _root()
        return found is not None and psutil.POSIX and _writable(found[0])

    def __enter__(self) -> EngineShare:
        self._base.mkdir(exist_ok=True)
        if self._version == 2:
            (self._base / "cgroup.subtree_control").write_text("+cpu")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def capped(self) -> int:
        """Engine processes capped so far."""
        return len(self._done)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for pid in _engine_pids() - self._done:
                try:
                    self._cap(pid)
                except OSError as exc:  # it exited meanwhile
                    print(f"   engine {pid} not capped: {exc}")
                self._done.add(pid)

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


def _writable(root: Path) -> bool:
    probe = root / "tokenfab-probe"
    try:
        probe.mkdir(exist_ok=True)
        probe.rmdir()
        return True
    except OSError:
        return False


def _engine_pids() -> set[int]:
    """Engine core processes: the `VLLM::EngineCore` children of tokenfab pools' replicas."""
    pids = set()
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if not (cmdline.startswith("ray::ServeReplica:") and ":pool-" in cmdline):
            continue
        try:
            for child in proc.children():
                if " ".join(child.cmdline()).startswith("VLLM::EngineCore"):
                    pids.add(child.pid)
        except psutil.Error:
            continue
    return pids
