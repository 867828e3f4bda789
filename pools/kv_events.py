"""Where a replica's engine publishes its KV cache events, and where routers read them.

The engine always publishes on a node-local ipc socket. With the `tcp` transport the replica
forwards that stream, frames untouched, to a PUB socket bound on the node's own address, and the
engine binds its replay socket there directly; routers on any node dial those two. (vLLM binds a
tcp publisher only on a wildcard address, which would listen on every interface: the forwarder
keeps the listener on the one address Ray uses for the node.)
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq
import zmq.devices

Transport = Literal["ipc", "tcp"]


@dataclass(frozen=True)
class KVEventEndpoints:
    engine: str  # the engine's publisher (always ipc)
    replay: str  # the engine's replay ROUTER, dialled by routers directly
    public: str  # what routers subscribe to


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def plan_endpoints(transport: Transport, socket_base: Path, node_ip: str) -> KVEventEndpoints:
    engine = f"ipc://{socket_base}.kv"
    if transport == "ipc":
        return KVEventEndpoints(engine, f"ipc://{socket_base}.replay", engine)
    return KVEventEndpoints(engine, f"tcp://{node_ip}:{_free_port(node_ip)}",
                            f"tcp://{node_ip}:{_free_port(node_ip)}")


class EventForwarder:
    """SUB on the engine's ipc publisher -> PUB on the node address, in a daemon thread."""

    def __init__(self, endpoints: KVEventEndpoints) -> None:
        self._device = zmq.devices.ThreadProxy(zmq.SUB, zmq.PUB)
        self._device.setsockopt_in(zmq.SUBSCRIBE, b"")
        self._device.setsockopt_out(zmq.LINGER, 0)
        self._device.connect_in(endpoints.engine)
        self._device.bind_out(endpoints.public)

    def start(self) -> None:
        """Runs until the process exits (the device's thread is a daemon, like the replica's)."""
        self._device.start()
