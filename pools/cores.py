"""Exclusive CPU cores for engine replicas on one node, claimed with file locks.

A lock dies with the process that holds it, so a crashed replica never leaks its cores.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

LOCK_DIR = Path(os.environ.get("TOKENFAB_CORE_LOCK_DIR", "/tmp/tokenfab-cores"))


@dataclass
class CoreClaim:
    """Cores held by this process until `release` (or process exit)."""

    cores: list[int]
    _files: list[int]

    def omp_bind_ranks(self, ranks: int) -> str:
        """VLLM_CPU_OMP_THREADS_BIND: the cores split evenly across an engine's `ranks` CPU
        workers (tensor x data), in rank order, e.g. 4 cores, 2 ranks -> "0,1|2,3"; one rank,
        "0,1,2,3"."""
        if ranks < 1 or len(self.cores) % ranks:
            raise ValueError(f"{len(self.cores)} cores do not split evenly across {ranks} ranks")
        size = len(self.cores) // ranks
        return "|".join(",".join(str(core) for core in self.cores[i:i + size])
                        for i in range(0, len(self.cores), size))

    def release(self) -> None:
        for fd in self._files:
            os.close(fd)
        self._files.clear()


def claim_cores(count: int, lock_dir: Path = LOCK_DIR) -> CoreClaim | None:
    """Claim `count` cores no other replica on this node holds; None when too few are free."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    lock_dir.mkdir(parents=True, exist_ok=True)
    claimed: list[int] = []
    files: list[int] = []
    for core in sorted(os.sched_getaffinity(0)):
        fd = os.open(lock_dir / f"core-{core}.lock", os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        claimed.append(core)
        files.append(fd)
        if len(claimed) == count:
            return CoreClaim(claimed, files)
    CoreClaim(claimed, files).release()
    return None
