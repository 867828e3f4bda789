"""Suite-wide checks: nothing may be left running once the integration tests are done."""

from __future__ import annotations

import os
import subprocess

# Before anything imports Ray: this process joins a loopback-only cluster (see orchestrator.cluster).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402

LEFTOVER_PATTERN = "raylet|gcs_server|VLLM::|EngineCore"


def leftover_processes() -> list[str]:
    """Ray and engine processes still alive (a zombie is dead: its parent, init for daemons
    whose `ray start` exited, has not reaped it yet)."""
    result = subprocess.run(["pgrep", "-af", LEFTOVER_PATTERN], capture_output=True, text=True)
    return [line for line in result.stdout.splitlines()
            if "pgrep" not in line and not _zombie(line.split()[0])]


def _zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True  # gone meanwhile


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not getattr(session.config, "_tokenfab_cluster_used", False):
        return
    leftovers = leftover_processes()
    if leftovers:
        print("\nprocesses left running after the suite:\n" + "\n".join(leftovers))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
