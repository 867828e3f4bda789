"""NIXL side channels and vLLM NixlConnector settings for prefill and decode replicas.

Every engine that takes part in KV transfer needs its own side channel (host, port) where peers
fetch its NIXL metadata, and an engine id unique in the cluster. Both are chosen per replica, on the
address the replica's node is reached at, so they hold across Ray nodes.
"""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

KVRole = Literal["kv_producer", "kv_consumer"]
ROLE_OF_POOL: dict[str, KVRole] = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass(frozen=True)
class SideChannel:
    host: str
    port: int
    ranks: int = 1  # data-parallel rank R of the engine listens on port + R

    @property
    def ports(self) -> range:
        return range(self.port, self.port + self.ranks)

    def env(self) -> dict[str, str]:
        """The variables vLLM's NixlConnector reads when the engine starts."""
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port)}


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LISTEN_FLOOR = 10_000  # below: well-known and registered services


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in _EPHEMERAL.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def reserve_side_channel(host: str, rng: random.Random | None = None,
                         ranks: int = 1) -> SideChannel:
    """A port free on `host` now, outside the kernel's ephemeral range. The engine binds it a few
    seconds later. A port from the ephemeral range (what binding port 0 gives) can be taken in
    between by any outgoing connection on the node, and then vLLM's handshake listener dies and
    its engine waits for it forever (seen in the suite: `Address already in use`, the decode
    replica stuck initialising). Outgoing connections and port-0 listeners never take a port
    outside that range, so only another listener choosing the same port at random could.
    An engine with data-parallel ranks gets `ranks` consecutive ports (vLLM gives rank R the
    configured port + R).
    """
    rng = rng or random.SystemRandom()
    low, high = _ephemeral_range()
    candidates = [(_LISTEN_FLOOR, low - 1)] if low - 1 > _LISTEN_FLOOR else []
    candidates += [(high + 1, 65535)] if high < 65535 else []
    for _ in range(64 if candidates else 0):
        start, end = rng.choice(candidates)
        port = rng.randint(start, end - ranks + 1)
        if all(_free(host, port + rank) for rank in range(ranks)):
            return SideChannel(host, port, ranks)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # no room outside: any
        probe.bind((host, 0))
        return SideChannel(host, probe.getsockname()[1], ranks)


def _free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


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
