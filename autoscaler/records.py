"""The autoscaler's record of its decisions, and the seam it writes them through.

The policy runs inside Ray Serve's controller; where its decisions are kept (for `tokenfab
status` and `/tokenfab/autoscaler`) is the deployment's business: the app builder names a sink
by import path, and the policy loads it once.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import msgspec


class ScaleRecord(msgspec.Struct, frozen=True):
    """The autoscaler's latest decision for one pool."""

    pool: str
    current: int
    desired: int
    reason: str
    at: float
    min_replicas: int
    max_replicas: int
    ttft_p90_s: float
    itl_p90_s: float
    last_change: str = ""  # "1 -> 2: <reason>" of the latest decision that moved the count
    last_change_at: float = 0.0


class DecisionSink(Protocol):
    """Stores the latest decision of a pool of application `app`. Must not block for long: the
    controller calls it from its control loop (at most once per decision, or every few seconds)."""

    def __call__(self, app: str, record: ScaleRecord) -> None: ...


def load_sink(path: str) -> DecisionSink:
    """The sink at `module:function`."""
    module, _, name = path.partition(":")
    sink: DecisionSink = getattr(importlib.import_module(module), name)
    return sink
