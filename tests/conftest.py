"""Suite-wide checks: nothing may be left running once the integration tests are done."""

from __future__ import annotations

import subprocess

import pytest

LEFTOVER_PATTERN = "raylet|gcs_server|VLLM::|EngineCore"


def leftover_processes() -> list[str]:
    result = subprocess.run(["pgrep", "-af", LEFTOVER_PATTERN], capture_output=True, text=True)
    return [line for line in result.stdout.splitlines() if "pgrep" not in line]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not getattr(session.config, "_tokenfab_cluster_used", False):
        return
    leftovers = leftover_processes()
    if leftovers:
        print("\nprocesses left running after the suite:\n" + "\n".join(leftovers))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
