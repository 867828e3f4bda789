"""NIXL side channels and vLLM NixlConnector settings for prefill and decode replicas.

Every engine that takes part in KV transfer needs its own side channel (host, port) where peers
fetch its NIXL metadata, and an engine id unique in the cluster. Both are chosen per replica, on the
address the replica's node is reached at, so they hold across Ray nodes.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Literal

KVRole = Literal["kv_producer", "kv_consumer"]
ROLE_OF_POOL: dict[str, KVRole] = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class SideChannel:
    host: str
    port: int

    def env(self) -> dict[str, str]:
        """The variables vLLM's NixlConnector reads when the engine starts."""
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port)}


def reserve_side_channel(host: str) -> SideChannel:
    """A port free on `host` now. The engine binds it a few seconds later; a collision in between
    makes the engine fail to start, and Serve restarts the replica with a new port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return SideChannel(host, probe.getsockname()[1])


def connector_config(pool_role: str, engine_id: str, use_gpu: bool) -> dict[str, Any] | None:
    """`kv_transfer_config` for an engine of this pool role; None for unified pools.

    Decode engines recompute locally when a transfer fails (`kv_load_failure_policy`), so a lost
    prefill replica or an unreachable side channel costs latency, never the request.
    """
    role = ROLE_OF_POOL.get(pool_role)
    if role is None:
        return None
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cuda" if use_gpu else "cpu",
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        # vLLM asks UCX for 4 worker threads by default; they poll, and a CPU replica owns one core.
        "kv_connector_extra_config": {"num_threads": 1},
    }
