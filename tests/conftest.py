"""Suite-wide checks: nothing may be left running once the integration tests are done."""

from __future__ import annotations

import os
import re
import subprocess

# Before anything imports Ray: this process joins a loopback-only cluster (see orchestrator.cluster).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402

LEFTOVER_PATTERN = "raylet|gcs_server|VLLM::|EngineCore"
CLIENT_NICE = -10
AUTOGROUP = "/proc/self/autogroup"


def pytest_configure(config: pytest.Config) -> None:
    """Give this process, the tests' client, priority over the stack it drives.

    The stack runs on the same 2 cores, and its engines spin. With Linux autogroups each session
    is one scheduling group: Ray's (`ray start` runs in a session of its own) starves a client in
    another of CPU for most of a second at a time, and a test would time the machine, not the
    system (measured: a 48-token stream's chunks all reached this process at once after 200-730
    ms on the run queue, though the gateway had written them 5 ms apart). So, as the benchmarks
    do (`prioritise_client` in benchmarks/common/machine.py), the client's session group and the process
    itself (where autogroups are off) run at CLIENT_NICE, until the session ends."""
    try:
        before = (group := _autogroup_nice(), os.getpriority(os.PRIO_PROCESS, 0))
        _set_nice(None if group is None else CLIENT_NICE, CLIENT_NICE)
        config._tokenfab_nice = before
    except OSError as exc:
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"could not raise the client's priority to nice {CLIENT_NICE} ({exc}): the stack "
            "may starve it of CPU, and timings would show it"), stacklevel=2)


def pytest_unconfigure(config: pytest.Config) -> None:
    if (before := getattr(config, "_tokenfab_nice", None)) is not None:
        _set_nice(*before)  # the session's group outlives this process: give it back as it was


def _autogroup_nice() -> int | None:
    """The nice of this process's session group; None where no autogroup applies."""
    try:
        with open(AUTOGROUP) as autogroup:
            return autogroup_nice(autogroup.read())
    except FileNotFoundError:  # a kernel without autogroups
        return None


def autogroup_nice(text: str) -> int | None:
    """Parse /proc/<pid>/autogroup ("/autogroup-176 nice 0"). It reads empty where the process's
    session has no group of its own (the kernel's default group: autogroups off when the session
    began, or booted `noautogroup`; so on CI), whose nice cannot be set: None, as without them."""
    match = re.fullmatch(r"/autogroup-\d+ nice (-?\d+)\s*", text)
    return int(match[1]) if match else None


def _set_nice(group: int | None, process: int) -> None:
    os.setpriority(os.PRIO_PROCESS, 0, process)
    if group is not None:  # None: no session group to set
        with open(AUTOGROUP, "w") as autogroup:
            autogroup.write(str(group))


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
