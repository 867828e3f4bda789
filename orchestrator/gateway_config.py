"""A topology's gateway section: the OpenAI-compatible endpoint, its deadlines, and what one
client can make an ingress hold (see orchestrator.config for the whole document)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from orchestrator.pool_config import ByteSize, parse_bytes
from orchestrator.strict import Strict as _Strict


class GatewaySpec(_Strict):
    """The OpenAI-compatible HTTP endpoint."""

    host: str = Field("127.0.0.1", description="Address the gateway listens on (its replicas on "
                      "a node share it).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    route_prefix: str = Field("/", pattern=r"^/", description="URL prefix of this application.")
    replicas: int = Field(1, ge=1, description="Ingress replicas (in processes of their own; "
                          "with colocate, the pool's replicas are the ingress replicas).")
    colocate: bool = Field(
        False, description="Serve the gateway from the pool's replicas instead of processes of "
        "its own: each replica listens on host:port of its node (they share it) and answers the "
        "requests it places on itself in-process, one process and one hop fewer per request. A "
        "single unified pool that keeps at least one replica, on nodes where host is reachable; "
        "the replicas share the tenants' limits as they come and go.")
    request_timeout_s: float = Field(300.0, gt=0, description="Deadline for one request.")
    retries: int = Field(
        2, ge=0, description="Times a request goes to another replica of its pool when the one "
        "it was on failed (engine dead, replica gone): before any byte of the answer reached the "
        "client, within the request's deadline; after, as a continuation of its stream (see "
        "migrate). With no other replica listed, it waits for one (Serve replacing the failed "
        "one) until that deadline. Charged once.")
    migrate: bool = Field(
        True, description="Continue a stream whose replica failed after tokens reached the "
        "client on another replica, from the tokens the client has (one stream, usage as one "
        "request). Streams carry their token ids from replica to gateway for this.")
    max_body_bytes: ByteSize = Field(1_048_576, description="Largest accepted request body.")
    header_timeout_s: float = Field(
        10.0, gt=0, description="Time a request has to deliver its whole head (request line and "
        "headers) from its first byte; then 408 and the connection closes. A head is a few "
        "hundred bytes: ten seconds is ample on any link and stops a client that trickles one "
        "(slowloris).")
    body_timeout_s: float = Field(
        60.0, gt=0, description="Time a request has to deliver its whole body once its head is "
        "in; then 408 and the connection closes (a max_body_bytes body at 20 KB/s fits).")
    idle_timeout_s: float = Field(
        75.0, gt=0, description="A kept-alive connection with no request for this long is "
        "closed (nginx's keepalive_timeout).")
    stalled_client_timeout_s: float = Field(
        60.0, gt=0, description="A streamed reply whose client has read nothing while 64 KiB of "
        "it waited in the gateway for this long is dropped: the connection closes, the engine "
        "stops generating it, and what was sent is charged (nginx's send_timeout). It bounds "
        "what a client that stops reading makes the gateway hold to what its engine generates "
        "meanwhile.")
    max_connections: int = Field(
        8192, ge=1, description="Open client connections per ingress process; beyond it a new "
        "one is closed at once. Each holds a socket and its buffers.")
    max_connections_per_client: int | None = Field(
        1024, ge=1, description="Open connections per client address per ingress process; "
        "beyond it that address's new connections are closed at once. Behind a proxy or load "
        "balancer every client shares its address: raise it, or null for no limit.")

    @field_validator("max_body_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return parse_bytes(value)
