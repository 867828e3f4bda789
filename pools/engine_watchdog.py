"""A vLLM general plugin: an engine process ends when the process that started it dies.

vLLM on CPU sets no parent-death signal on its engine processes, so a replica killed by SIGKILL
(OOM, a node agent, an operator) left its EngineCore and workers running, re-parented, holding
their memory (on a GPU, the GPU's memory) until someone noticed. A pool replica names itself in
TOKENFAB_ENGINE_PARENT before it starts its engine; vLLM loads this plugin in every process it
spawns (entry point `vllm.general_plugins`), and in each of them but the replica a daemon thread
checks once a second that its parent is still the one that started it. When the parent is gone
the process kills itself; its own children (the EngineCore's workers) see the same and follow.
A thread that polls, not PR_SET_PDEATHSIG, because that signal fires when the parent's *thread*
that forked exits, which in a replica may be a pool thread long before the replica ends.
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV = "TOKENFAB_ENGINE_PARENT"
PERIOD_S = 1.0


def register() -> None:
    replica = os.environ.get(ENV)
    if not replica or int(replica) == os.getpid():
        return  # not under a tokenfab replica, or the replica itself
    if any(t.name == "tokenfab-engine-watchdog" for t in threading.enumerate()):
        return  # vLLM loads plugins more than once per process
    parent = os.getppid()
    threading.Thread(target=_watch, args=(parent,), name="tokenfab-engine-watchdog",
                     daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PERIOD_S)
    os.kill(os.getpid(), signal.SIGKILL)  # orphaned: nothing will ever ask this engine again
