"""Stopping a local Ray head: only the session tokenfab started, and only this user's
processes in it (orphans included); a head tokenfab did not start is refused, not killed."""

from __future__ import annotations

import subprocess
import time

import pytest

from orchestrator import cluster
from tokenfab.errors import ClusterError

DASHBOARD = "http://127.0.0.1:9"


def test_stop_ray_stops_only_the_session_it_started(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cluster, "STATE_DIR", tmp_path)
    # a session like a head's: its leader and two children that outlive it (orphans, as Ray's
    # daemons and engines become once `ray start` exits)
    ours = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)  # someone else's Ray
    try:
        deadline = time.monotonic() + 10
        while len(cluster.session_processes(ours.pid)) < 3:
            assert time.monotonic() < deadline, cluster.session_processes(ours.pid)
            time.sleep(0.05)
        with pytest.raises(ClusterError, match="no Ray head started by tokenfab"):
            cluster.stop_ray(DASHBOARD)  # nothing recorded for this dashboard: nothing killed
        assert len(cluster.session_processes(ours.pid)) == 3
        cluster._record_head(DASHBOARD, ours.pid)
        cluster.stop_ray(DASHBOARD)
        assert cluster.session_processes(ours.pid) == []
        assert ours.wait(5) is not None
        assert other.poll() is None  # another session is left alone
        with pytest.raises(ClusterError):  # the record went with the head
            cluster.stop_ray(DASHBOARD)
    finally:
        for process in (ours, other):
            process.kill()
            process.wait()


def test_ray_env_carries_the_serve_control_loop_period_only_when_set() -> None:
    from orchestrator.config import ClusterSpec

    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in cluster.ray_env(ClusterSpec())
    env = cluster.ray_env(ClusterSpec(serve_control_loop_s=0.5))
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.5"
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # a loopback head stays on lo
    with pytest.raises(ValueError, match="serve_control_loop_s"):
        ClusterSpec(serve_control_loop_s=0)


@pytest.mark.parametrize("log_monitor", [False, True])
def test_a_head_starts_ray_s_log_monitor_only_when_asked(monkeypatch, log_monitor: bool) -> None:
    from orchestrator.config import ClusterSpec

    started: list[list[str]] = []

    class Refused:  # `ray start` as if it failed: start_head stops there
        returncode = 1

        def __init__(self, command: list[str], **_: object) -> None:
            started.append(command)

        def communicate(self) -> tuple[str, str]:
            return "", "refused"

    monkeypatch.setattr(cluster.subprocess, "Popen", Refused)
    with pytest.raises(ClusterError, match="refused"):
        cluster.start_head(ClusterSpec(log_monitor=log_monitor))
    assert ("--include-log-monitor=False" in started[0]) is not log_monitor
    assert "--head" in started[0]
