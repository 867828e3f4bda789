"""A vLLM general plugin that lets NIXL's progress thread sleep between polls.

NIXL's Python agent hard-codes `pthrDelay = 0`: its progress thread spins, a whole core per engine
even when idle. On a GPU node that buys microseconds; on a CPU replica it steals the core the engine
computes on. Replicas that want a delay set TOKENFAB_NIXL_PROGRESS_DELAY_US; vLLM loads this plugin
in every engine process (entry point `vllm.general_plugins`), before any NIXL agent exists.
This is tokenfab's one patch of NIXL (its bindings' `nixlAgent`), gated on the NIXL versions it
was written for (tokenfab.compat). Upstream, this would be a `pthrDelay` argument (or setting)
of NIXL's Python agent, and of vLLM's NixlConnector above it.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib.metadata import version
from typing import Any

from tokenfab.compat import require

ENV = "TOKENFAB_NIXL_PROGRESS_DELAY_US"
NIXL_VERSIONS = ("1.5.1",)
logger = logging.getLogger(__name__)


def register() -> None:
    delay_us = int(os.environ.get(ENV) or 0)
    if delay_us <= 0:
        return
    try:
        from nixl._api import nixl_agent
    except ImportError:  # no NIXL here: nothing to tune
        return
    require("NIXL", version("nixl"), NIXL_VERSIONS, "nixlAgent, its progress thread's delay")
    bindings = sys.modules[nixl_agent.__module__].nixlBind
    if getattr(bindings.nixlAgent, "_tokenfab_delay_us", None) == delay_us:
        return
    original = getattr(bindings.nixlAgent, "_tokenfab_original", bindings.nixlAgent)

    def agent_with_delay(name: str, config: Any) -> Any:  # nixl's bindings are untyped
        config.pthrDelay = delay_us
        return original(name, config)

    # setattr: mypy types no new attribute of a function
    setattr(agent_with_delay, "_tokenfab_delay_us", delay_us)  # noqa: B010
    setattr(agent_with_delay, "_tokenfab_original", original)  # noqa: B010
    bindings.nixlAgent = agent_with_delay
    logger.info("NIXL progress thread delay set to %d us", delay_us)
