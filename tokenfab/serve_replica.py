"""Serve's inter-deployment gRPC server, bound to the node's address instead of every interface.

Every Serve replica starts a gRPC server for handle calls between deployments on `[::]:0`
(hard-coded in `ray.serve._private.replica.ReplicaBase._on_initialized`), and that server
unpickles what it receives: anything that can reach the port can run code in the replica. tokenfab
sends nothing through it (requests travel on channel/), but Serve reports the port and its handles
may dial it, at the node's address. So tokenfab's replica modules call `bind_to_node_address()`
when they are imported, before Serve starts the server, and the server listens on the address Ray
uses for the node (loopback on a local cluster), as Ray's other servers do. Ray's own
authentication (`RAY_AUTH_MODE=token`, or `RAY_USE_TLS`) still applies on top where an operator
turns it on.
"""

from __future__ import annotations

WILDCARD = "[::]:0"


def bind_to_node_address() -> None:
    """Patch Serve's replica module once per process (idempotent)."""
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server
    if getattr(original, "tokenfab_node_address", False):
        return

    def add_port_to_grpc_server(server, address: str) -> int:
        if address == WILDCARD:
            import ray

            host = ray.util.get_node_ip_address()
            address = f"[{host}]:0" if ":" in host else f"{host}:0"
        return original(server, address)

    add_port_to_grpc_server.tokenfab_node_address = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port_to_grpc_server
