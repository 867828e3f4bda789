"""The engine watchdog: a process that a tokenfab replica started (directly, or through an engine
process) ends soon after that replica is SIGKILLed; the replica itself is never watched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from pools import engine_watchdog

CHILD = ("import threading, time; from pools.engine_watchdog import register; register(); "
         "print('watching' if any(t.name == 'tokenfab-engine-watchdog' "
         "for t in threading.enumerate()) else 'unwatched', flush=True); time.sleep(120)")
PARENT = f"""
import os, subprocess, sys, time
os.environ["{engine_watchdog.ENV}"] = str(os.getpid())
from pools.engine_watchdog import register; register()  # the replica: not watched
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}])
print(child.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_engine_process_ends_when_its_replica_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env=os.environ | {"PYTHONPATH": os.getcwd()})
    lines = {parent.stdout.readline().strip() for _ in range(2)}  # the child's pid, its state
    child = int(next(line for line in lines if line.isdigit()))
    try:
        assert "watching" in lines, lines
        time.sleep(engine_watchdog.PERIOD_S)
        assert not _gone(child) and not _gone(parent.pid)  # nothing ends while the parent lives
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 3 * engine_watchdog.PERIOD_S
        while not _gone(child):
            assert time.monotonic() < deadline, "the engine process outlived its replica"
            time.sleep(0.1)
    finally:
        for pid in (parent.pid, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_outside_a_replica_nothing_is_watched(monkeypatch) -> None:
    monkeypatch.delenv(engine_watchdog.ENV, raising=False)
    engine_watchdog.register()
    monkeypatch.setenv(engine_watchdog.ENV, str(os.getpid()))
    engine_watchdog.register()
    import threading

    assert not any(t.name == "tokenfab-engine-watchdog" for t in threading.enumerate())
