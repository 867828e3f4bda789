"""Every use tokenfab makes of Ray's internals, and the Ray versions it was written for.

- `bind_serve_grpc_to_node_address`: Serve's inter-deployment gRPC server on the node's address.
- `gcs_client`: this process's GCS client (the replica registry's key-value store).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from tokenfab.compat import require

RAY_VERSIONS = ("2.60.0",)
WILDCARD = "[::]:0"


@cache  # once per process and patch
def _require(patch: str) -> None:
    import ray

    require("Ray", ray.__version__, RAY_VERSIONS, patch)


def bind_serve_grpc_to_node_address() -> None:
    """Serve's inter-deployment gRPC server, bound to the node's address instead of every
    interface. Patches Serve's replica module once per process (idempotent).

    Every Serve replica starts a gRPC server for handle calls between deployments on `[::]:0`
    (hard-coded in `ray.serve._private.replica.Replica._on_initialized`), and that server
    unpickles what it receives: anything that can reach the port can run code in the replica.
    tokenfab sends nothing through it (requests travel on channel/), but Serve reports the port
    and its handles may dial it, at the node's address. So tokenfab's replica modules call this
    when they are imported, before Serve starts the server, and the server listens on the
    address Ray uses for the node (loopback on a local cluster), as Ray's other servers do.
    Ray's own authentication (`RAY_AUTH_MODE=token`, or `RAY_USE_TLS`) still applies on top.

    Upstream, this would be Serve binding the server to the node IP it already knows (as the
    raylet and the object manager do), or a setting for it.
    """
    _require("Serve's replica gRPC server bound to the node's address")
    from ray.serve._private import replica

    original: Callable[[Any, str], int] = replica.add_port_to_grpc_server
    if getattr(original, "tokenfab_node_address", False):
        return

    def add_port_to_grpc_server(server: Any, address: str) -> int:  # a grpc server
        if address == WILDCARD:
            import ray

            host = ray.util.get_node_ip_address()
            address = f"[{host}]:0" if ":" in host else f"{host}:0"
        return original(server, address)

    add_port_to_grpc_server.tokenfab_node_address = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port_to_grpc_server


def gcs_client() -> Any:
    """This process's GCS client (a Ray worker or driver connected to the cluster), whose
    internal key-value store holds the replica registry. Ray exposes no public handle to it."""
    _require("the GCS client of ray._private.worker.global_worker")
    import ray

    # ray sets Worker.gcs_client when it connects; its class does not declare it
    return ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]
