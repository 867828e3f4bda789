"""A vLLM general plugin: KV events of every data-parallel rank on node-local ipc sockets.

With `data_parallel_size` D, vLLM starts D engine processes and each publishes its own KV events;
rank R derives its endpoints from the configured ones (`ZmqEventPublisher.offset_endpoint_port`):
a tcp port + R, an inproc name + `_dp{R}`, and for ipc it raises ("must contain 'inproc' or
'tcp'"). tcp would put every tenant's prompt token ids on an unauthenticated listener, so tokenfab
keeps events on ipc sockets in a directory only its user can enter (pools.kv_events), and this
plugin gives rank R the ipc path + `_dp{R}`, as vLLM names inproc ones (`rank_endpoint` below is
what the replica subscribes to). Rank 0 keeps the path itself, and tcp and inproc are unchanged.
vLLM loads the plugin in every engine process (entry point `vllm.general_plugins`).
"""

from __future__ import annotations


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where rank `rank` publishes when configured with the ipc `endpoint`."""
    return endpoint if rank == 0 else f"{endpoint}_dp{rank}"


def register() -> None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    original = ZmqEventPublisher.offset_endpoint_port
    if getattr(original, "_tokenfab", False):
        return

    def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
        if endpoint and endpoint.startswith("ipc://"):
            return rank_endpoint(endpoint, data_parallel_rank)
        return original(endpoint, data_parallel_rank)

    offset_endpoint_port._tokenfab = True
    ZmqEventPublisher.offset_endpoint_port = staticmethod(offset_endpoint_port)
