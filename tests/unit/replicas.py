"""Scripted replicas that speak the real data channel (channel.server), for unit tests of the
channel, the dispatcher and the flows without engines. Real engines behind the same channel are
exercised by tests/integration.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from channel.frames import Request, Usage
from channel.server import ChannelServer, ReplySink
from pools.engine import LoadSnapshot
from pools.registry import ReplicaReport

SECRET = b"s" * 32


@dataclass
class Step:
    """One thing a scripted replica does while serving a request."""

    kind: str  # head, data, token, end, fail, hang, raise, sleep (float(payload) seconds)
    status: int = 200
    streaming: bool = False
    payload: bytes = b""
    usage: Usage = field(default_factory=Usage)
    ids: list[int] = field(default_factory=list)  # the token ids a token step carries


def whole(status: int, body: dict[str, Any], usage: Usage = Usage()) -> list[Step]:
    return [Step("head", status), Step("data", payload=json.dumps(body).encode()),
            Step("end", usage=usage)]


def streamed(*tokens: bytes, usage: Usage = Usage(), first_id: int = 1) -> list[Step]:
    """A stream whose token chunks carry one token each, ids counting from `first_id`."""
    return ([Step("head", 200, streaming=True)]
            + [Step("token", payload=t, ids=[first_id + i]) for i, t in enumerate(tokens)]
            + [Step("data", payload=b"data: [DONE]\n\n"), Step("end", usage=usage)])


class ScriptedReplica:
    """A channel handler that answers each request with the next script (the last one repeats).
    Records the requests it got and how each ended ("done", "cancelled")."""

    def __init__(self, name: str, *scripts: list[Step], capacity: int = 64,
                 state: str = "ready") -> None:
        self.name, self.scripts, self.capacity, self.state = name, list(scripts), capacity, state
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.received: list[Request] = []  # as they came, with their channel fields
        self.outcomes: list[str] = []
        self.in_flight = 0
        self.server = ChannelServer(SECRET, self, name)
        self.port = 0

    async def start(self) -> ScriptedReplica:
        self.port = await self.server.start("127.0.0.1")
        return self

    def report(self, pool: str = "main", state: str = "ready") -> ReplicaReport:
        return ReplicaReport(app="t", pool=pool, role="unified", replica_id=self.name,
                             node_ip="127.0.0.1", pid=0, cores=[], state=state,
                             load=LoadSnapshot(), channel=f"127.0.0.1:{self.port}")

    def admit(self) -> str | None:
        if self.state != "ready":
            return self.state
        if self.in_flight >= self.capacity:
            return "full"
        self.in_flight += 1
        return None

    def release(self) -> None:
        self.in_flight -= 1

    async def serve(self, request: Request, reply: ReplySink) -> None:
        self.requests.append((request.endpoint, json.loads(request.body)))
        self.received.append(request)
        script = self.scripts[0] if len(self.scripts) == 1 else self.scripts.pop(0)
        try:
            for step in script:
                await asyncio.sleep(0)
                if step.kind == "head":
                    reply.head(step.status, step.streaming, self.name)
                elif step.kind == "token" and request.track_tokens:
                    reply.tokens(step.payload, step.ids)
                elif step.kind in ("data", "token"):
                    reply.data(step.payload, step.kind == "token")
                elif step.kind == "end":
                    reply.end(step.usage)
                elif step.kind == "fail":
                    reply.failed("engine died")
                elif step.kind == "hang":
                    await asyncio.sleep(3600)
                elif step.kind == "sleep":
                    await asyncio.sleep(float(step.payload))
                elif step.kind == "raise":
                    raise RuntimeError("engine bug")
            self.outcomes.append("done")
        except asyncio.CancelledError:
            self.outcomes.append("cancelled")
            raise
